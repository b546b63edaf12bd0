// traffic.cpp — tpnorm/cuda_traffic.h: the byte accounting of the CUDA kernels, from the same
// launch plans (plan.h) the launchers use. Compiled only with the CUDA backend.
#include <string>
#include <vector>

#include "kernels/cuda/plan.h"
#include "tpnorm/cuda_traffic.h"

namespace tpnorm {

using kernels::cuda::BnPlan;
using kernels::cuda::plan_channels;
using kernels::cuda::row_bwd_parts;

namespace {

// The row kernels of a call. `header_in_partial`: the partial kernel writes the call header
// (the row ops' own calls, fused included; the header kernel only when there is no row), else
// the header kernel does, between the partials and the applies (batched calls, GroupNorm).
Traffic row_forward_kernels(const RowTrafficArgs& a, bool header_in_partial) {
  const int64_t n = a.rows * a.h * a.elem, k = a.centered ? 2 : 1, pay = a.rows * k * a.wire;
  const int64_t hdr = a.header * a.wire;
  const bool by_partial = header_in_partial && a.rows > 0;
  Traffic t;
  if (a.rows > 0) t.kernels.push_back({"row partial_fwd", n, pay + (by_partial ? hdr : 0)});
  if (!by_partial) t.kernels.push_back({"call header", 0, hdr});
  if (a.rows > 0) {
    const int64_t params = ((a.gamma ? 1 : 0) + (a.beta && a.centered ? 1 : 0)) * a.h * a.elem;
    const int64_t saved =
        ((a.save_mean && a.centered ? 1 : 0) + (a.save_rstd ? 1 : 0)) * a.rows * a.saved;
    t.kernels.push_back({"row apply_fwd", n + params + hdr + pay, n + saved});
  }
  return t;
}

Traffic row_backward_kernels(const RowTrafficArgs& a, bool header_in_partial) {
  const int64_t n = a.rows * a.h * a.elem, k = a.centered ? 2 : 1, pay = a.rows * k * a.wire;
  const int64_t gamma = a.gamma ? a.h * a.elem : 0;
  const int64_t stats = (a.centered ? 2 : 1) * a.rows * a.saved;  // saved mean (LN) and rstd
  const bool dbeta = a.dbeta && a.centered;                       // RMSNorm has no beta
  const bool params = (a.dgamma || dbeta) && a.h > 0;
  // The partial's column sums: [row_bwd_parts, 2, h] floats, written once, read once.
  const int64_t part = params ? row_bwd_parts(a.rows, a.h) * 2 * a.h * 4 : 0;
  const int64_t hdr = a.header * a.wire;
  const bool by_partial = header_in_partial && a.rows > 0;
  Traffic t;
  if (a.rows > 0)
    t.kernels.push_back(
        {"row partial_bwd", 2 * n + gamma + stats, pay + part + (by_partial ? hdr : 0)});
  if (!by_partial) t.kernels.push_back({"call header", 0, hdr});
  if (a.rows > 0) t.kernels.push_back({"row apply_bwd", 2 * n + gamma + stats + hdr + pay, n});
  if (params)
    t.kernels.push_back(
        {"row dgamma_final", part + hdr, ((a.dgamma ? 1 : 0) + (dbeta ? 1 : 0)) * a.h * a.elem});
  return t;
}

}  // namespace

Traffic row_forward_traffic(const RowTrafficArgs& a) { return row_forward_kernels(a, true); }
Traffic row_backward_traffic(const RowTrafficArgs& a) { return row_backward_kernels(a, true); }

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

// ---- composite calls ----------------------------------------------------------------------

namespace {

// A call's kernels before / after its "call header" entry (the partial side / the apply side).
std::vector<KernelBytes> split_at_header(const Traffic& t, bool after) {
  std::vector<KernelBytes> out;
  bool seen = false;
  for (const KernelBytes& k : t.kernels) {
    if (std::string(k.kernel) == "call header") {
      seen = true;
      continue;
    }
    if (seen == after) out.push_back(k);
  }
  return out;
}
void append(Traffic& t, const std::vector<KernelBytes>& ks) {
  t.kernels.insert(t.kernels.end(), ks.begin(), ks.end());
}

template <class RowFn>
Traffic batched(const std::vector<RowTrafficArgs>& items, RowFn row) {
  Traffic t;
  if (items.empty()) return t;
  const int64_t k = static_cast<int64_t>(items.size()), wire = items[0].wire;
  t.kernels.push_back({"write values", 0, k * wire});  // the K column counts
  std::vector<Traffic> each;
  for (const RowTrafficArgs& a : items) each.push_back(row(a));
  for (const Traffic& e : each) append(t, split_at_header(e, false));
  t.kernels.push_back({"call header", 0, items[0].header * wire});
  for (const Traffic& e : each) append(t, split_at_header(e, true));
  return t;
}

// Slots (sample, group) whose constants this rank's channels read: n x the groups that
// [c0, c0 + c_local) touches.
int64_t touched_slots(const GroupTrafficArgs& a) {
  if (a.c_local <= 0 || a.n <= 0) return 0;
  return a.n * ((a.c0 + a.c_local - 1) / a.cpg - a.c0 / a.cpg + 1);
}

// The row kernels' view of the planes (group_norm.cu: plane_rows), centred, without params.
RowTrafficArgs plane_rows(const GroupTrafficArgs& a) {
  RowTrafficArgs r;
  r.rows = a.n * a.c_local;
  r.h = a.spatial;
  r.elem = a.elem;
  r.wire = a.wire;
  r.saved = a.saved;
  r.header = a.header;
  r.gamma = r.beta = r.dgamma = r.dbeta = false;
  return r;
}

}  // namespace

Traffic fused_forward_traffic(const RowTrafficArgs& norm) {
  const int64_t n = norm.rows * norm.h * norm.elem;
  Traffic t;
  if (n > 0) t.kernels.push_back({"residual add", 2 * n, n});
  append(t, row_forward_traffic(norm).kernels);
  return t;
}

Traffic fused_backward_traffic(const RowTrafficArgs& norm, bool dh_extra) {
  const int64_t n = norm.rows * norm.h * norm.elem;
  Traffic t = row_backward_traffic(norm);
  if (n > 0) t.kernels.push_back({"residual epilogue", (dh_extra ? 2 : 1) * n, 2 * n});
  return t;
}

Traffic batched_forward_traffic(const std::vector<RowTrafficArgs>& items) {
  return batched(items, [](const RowTrafficArgs& a) { return row_forward_kernels(a, false); });
}
Traffic batched_backward_traffic(const std::vector<RowTrafficArgs>& items) {
  return batched(items, [](const RowTrafficArgs& a) { return row_backward_kernels(a, false); });
}

Traffic group_forward_traffic(const GroupTrafficArgs& a) {
  const int64_t n = a.n * a.c_local * a.spatial * a.elem, planes = a.n * a.c_local;
  const int64_t slots = a.n * a.groups, touched = touched_slots(a);
  const int64_t pay = 2 * slots * a.wire, hdr = a.header * a.wire;
  Traffic t;
  append(t, split_at_header(row_forward_kernels(plane_rows(a), false), false));  // plane sums
  if (slots > 0) t.kernels.push_back({"group fold", planes * 2 * a.wire, pay});
  t.kernels.push_back({"call header", 0, hdr});
  const int64_t consts = 16;  // a float4 per slot: mean head, tail, rstd
  const int64_t saved = ((a.save_mean ? 1 : 0) + (a.save_rstd ? 1 : 0)) * slots * a.saved;
  if (slots > 0) t.kernels.push_back({"group slot_stats", hdr + pay, slots * consts + saved});
  const int64_t params = ((a.gamma ? 1 : 0) + (a.beta ? 1 : 0)) * a.c_local * a.elem;
  if (n > 0) t.kernels.push_back({"group apply_fwd", n + params + touched * consts + hdr, n});
  return t;
}

Traffic group_backward_traffic(const GroupTrafficArgs& a) {
  const int64_t n = a.n * a.c_local * a.spatial * a.elem, planes = a.n * a.c_local;
  const int64_t slots = a.n * a.groups, touched = touched_slots(a);
  const int64_t pay = 2 * slots * a.wire, hdr = a.header * a.wire;
  const int64_t gamma = a.gamma ? a.c_local * a.elem : 0, rows = planes * 2 * a.wire;
  Traffic t;
  // each plane's group mean / rstd, which the row backward partial takes per row
  if (planes > 0)
    t.kernels.push_back({"group expand", 2 * touched * a.saved, 2 * planes * a.saved});
  append(t, split_at_header(row_backward_kernels(plane_rows(a), false), false));  // plane sums
  if (slots > 0) t.kernels.push_back({"group fold", rows + gamma, pay});
  if (a.c_local > 0) t.kernels.push_back({"group channel_sums", rows, 2 * a.c_local * 8});
  t.kernels.push_back({"call header", 0, hdr});
  // slot constants (two float4 a slot) from the saved statistics and the summed payload
  if (slots > 0)
    t.kernels.push_back({"group bwd_consts", hdr + 2 * slots * a.saved + pay, slots * 32});
  if (n > 0) t.kernels.push_back({"group apply_bwd", 2 * n + gamma + touched * 32 + hdr, n});
  const int64_t grads = (a.dgamma ? 1 : 0) + (a.dbeta ? 1 : 0);
  if (grads > 0 && a.c_local > 0)
    t.kernels.push_back(
        {"group param_grads", hdr + grads * a.c_local * 8, grads * a.c_local * a.elem});
  return t;
}

}  // namespace tpnorm
