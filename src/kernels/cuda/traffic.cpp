// traffic.cpp — tpnorm/cuda_traffic.h: the byte accounting of the CUDA kernels, from the same
// launch plans (plan.h) the launchers use. Compiled only with the CUDA backend.
#include "kernels/cuda/plan.h"
#include "tpnorm/cuda_traffic.h"

namespace tpnorm {

using kernels::cuda::BnPlan;
using kernels::cuda::dgamma_chunks;
using kernels::cuda::plan_channels;

Traffic row_forward_traffic(const RowTrafficArgs& a) {
  const int64_t n = a.rows * a.h * a.elem, k = a.centered ? 2 : 1, pay = a.rows * k * a.wire;
  Traffic t;
  if (a.rows > 0) t.kernels.push_back({"row partial_fwd", n, pay});
  t.kernels.push_back({"call header", 0, a.header * a.wire});
  if (a.rows > 0) {
    const int64_t params = ((a.gamma ? 1 : 0) + (a.beta && a.centered ? 1 : 0)) * a.h * a.elem;
    const int64_t saved =
        ((a.save_mean && a.centered ? 1 : 0) + (a.save_rstd ? 1 : 0)) * a.rows * a.saved;
    t.kernels.push_back({"row apply_fwd", n + params + a.header * a.wire + pay, n + saved});
  }
  return t;
}

Traffic row_backward_traffic(const RowTrafficArgs& a) {
  const int64_t n = a.rows * a.h * a.elem, k = a.centered ? 2 : 1, pay = a.rows * k * a.wire;
  const int64_t gamma = a.gamma ? a.h * a.elem : 0;
  const int64_t stats = (a.centered ? 2 : 1) * a.rows * a.saved;  // saved mean (LN) and rstd
  Traffic t;
  if (a.rows > 0) t.kernels.push_back({"row partial_bwd", 2 * n + gamma + stats, pay});
  t.kernels.push_back({"call header", 0, a.header * a.wire});
  if (a.rows > 0)
    t.kernels.push_back({"row apply_bwd", 2 * n + gamma + stats + a.header * a.wire + pay, n});
  const bool dbeta = a.dbeta && a.centered;  // RMSNorm has no beta
  if ((a.dgamma || dbeta) && a.h > 0) {
    int64_t rpc = 0;
    const int64_t chunks = dgamma_chunks(a.rows, a.h, &rpc);
    const int64_t part = 2 * chunks * a.h * 4;  // float partials per (chunk, column)
    if (chunks > 0) t.kernels.push_back({"row dgamma_part", 2 * n + stats, part});
    t.kernels.push_back({"row dgamma_final", part + a.header * a.wire,
                         ((a.dgamma ? 1 : 0) + (dbeta ? 1 : 0)) * a.h * a.elem});
  }
  return t;
}

// SyncBatchNorm: the plan of the sums kernel (x, and dy backward) and of the apply kernel,
// pointers aligned (the accounting does not depend on the vector width, only the walk's name
// and the splits do).
BnPlan bn_plan(const BnTrafficArgs& a) {
  return plan_channels(a.outer, a.c, a.inner, static_cast<size_t>(a.elem));
}
const char* bn_sums_name(const BnPlan& p) { return p.rows ? "bn sums_rows" : "bn sums_planes"; }

Traffic bn_forward_traffic(const BnTrafficArgs& a) {
  const BnPlan p = bn_plan(a);
  const int64_t n = a.outer * a.c * a.inner * a.elem, part = p.splits * 2 * a.c * 4;
  const int64_t pay = 2 * a.c * a.wire, hdr = a.header * a.wire;
  const int64_t params = ((a.gamma ? 1 : 0) + (a.beta ? 1 : 0)) * a.c * a.elem;
  const int64_t consts = 4 * a.c * 4;  // head, tail, scale, shift (float)
  Traffic t;
  if (!a.training) {  // eval with running statistics: no partial, no collective, no header
    if (a.c <= 0) return t;
    t.kernels.push_back(
        {"bn fwd_consts", params + 2 * a.c * a.running, consts + 2 * a.c * a.saved});
    if (n > 0) t.kernels.push_back({"bn apply_fwd", n + consts, n});
    return t;
  }
  if (a.c <= 0) {  // nothing but the header
    t.kernels.push_back({"call header", 0, hdr});
    return t;
  }
  // The robust pivot (the channel's first values, re-read by the sums kernel: nothing extra)
  // is stored by split 0 as one float per channel, which combine reads.
  const int64_t pivots = a.robust && p.has_values ? a.c * 4 : 0;
  if (p.splits > 0) t.kernels.push_back({bn_sums_name(p), n, part + pivots});
  t.kernels.push_back({"bn combine", part + pivots, pay});
  t.kernels.push_back({"call header", 0, hdr});
  const int64_t run = a.update_running ? 2 * a.c * a.running : 0;
  t.kernels.push_back(
      {"bn fwd_consts", hdr + pay + params + run, consts + 2 * a.c * a.saved + run});
  if (n > 0) t.kernels.push_back({"bn apply_fwd", n + consts + hdr, n});
  return t;
}

Traffic bn_backward_traffic(const BnTrafficArgs& a) {
  const BnPlan p = bn_plan(a);
  const int64_t n = a.outer * a.c * a.inner * a.elem, part = p.splits * 2 * a.c * 4;
  const int64_t pay = 2 * a.c * a.wire, hdr = a.training ? a.header * a.wire : 0;
  const int64_t stat = a.c * a.saved, grads = (a.dgamma ? 1 : 0) + (a.dbeta ? 1 : 0);
  Traffic t;
  if (a.c <= 0) {  // nothing but the header (training)
    if (a.training) t.kernels.push_back({"call header", 0, hdr});
    return t;
  }
  // Eval without parameter gradients has no partial pass at all.
  const bool sums = a.training || grads > 0;
  const int64_t local = 2 * a.c * 8;  // the local sums kept in float64 for dgamma / dbeta
  if (sums && p.splits > 0) t.kernels.push_back({bn_sums_name(p), 2 * n + stat, part});
  if (sums) t.kernels.push_back({"bn combine", part, (a.training ? pay : 0) + local});
  if (a.training) t.kernels.push_back({"call header", 0, hdr});
  const int64_t consts = 5 * a.c * 4;  // head, tail, k, c1, c2 (float)
  t.kernels.push_back({"bn bwd_consts",
                       (a.training ? hdr + pay : 0) + (a.gamma ? a.c * a.elem : 0) + 2 * stat,
                       consts});
  // training: dy and x; eval: dy alone (dx = gamma * invstd * dy)
  if (n > 0) t.kernels.push_back({"bn apply_bwd", (a.training ? 2 : 1) * n + consts + hdr, n});
  if (grads > 0)  // one float64 local sum per gradient and channel; invstd for dgamma
    t.kernels.push_back(
        {"bn param_grads", hdr + grads * a.c * 8 + (a.dgamma ? stat : 0), grads * a.c * a.elem});
  return t;
}

}  // namespace tpnorm
