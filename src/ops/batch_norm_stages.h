// batch_norm_stages.h — the arguments of one SyncBatchNorm call with their geometry, computed
// once: what the spec of ops/batch_norm.cpp checks and its host and device hooks (the latter in
// ops/cuda/batch_norm_cuda.cpp) read.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cpu/batch_norm.h"
#include "ops/validate.h"
#include "tpnorm/batch_norm.h"

namespace tpnorm::detail {

/// x as [N, C, inner] (channels first) or [N, inner, C] (channels last); zeros for a shape the
/// validator rejects (see shape_fits).
inline kernels::cpu::BatchNormArgs bn_geometry(const TensorView& x, const BatchNormOptions& opt) {
  kernels::cpu::BatchNormArgs a;
  a.channels_last = opt.layout == Layout::kChannelsLast;
  a.threads = opt.num_threads;
  if (x.shape.ndim < 2 || !shape_fits(x.shape)) return a;
  a.n = x.shape[0];
  const int cdim = a.channels_last ? x.shape.ndim - 1 : 1;
  a.c = x.shape[cdim];
  for (int i = 1; i < x.shape.ndim; ++i)
    if (i != cdim) a.inner *= x.shape[i];
  return a;
}

struct BnForward {
  TensorView x, gamma, beta, running_mean, running_var;
  int64_t* num_batches_tracked;
  TensorView y, save_mean, save_invstd;
  BatchNormOptions opt;
  kernels::cpu::BatchNormArgs a = bn_geometry(x, opt);
  bool tracking = running_mean.present() || running_var.present();
  /// Training, or eval without running statistics: the call reduces batch statistics.
  bool batch_stats = opt.training || !tracking;
  /// momentum NaN: the running statistics are a cumulative average.
  bool cumulative = std::isnan(opt.momentum);
  DType param = param_dtype(x, {&gamma, &beta});  ///< gamma's and beta's dtype
  /// The communicator has one rank: the reduce is the identity (see fuses()).
  bool one_rank = false;
  /// Whether the host path computes the statistics in the apply, channel by channel while a
  /// channel's planes are in cache (kernels/cpu/batch_norm.h bn_fuses), the partial doing
  /// nothing. Decided once, by the partial (valid arguments), and kept for the apply.
  bool fuses() const {
    return one_rank && batch_stats && opt.stats != Stats::kExact &&
           kernels::cpu::bn_fuses(a, static_cast<int64_t>(dtype_size(x.dtype)));
  }
};

struct BnBackward {
  TensorView dy, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta;
  BatchNormOptions opt;
  kernels::cpu::BatchNormArgs a = bn_geometry(x, opt);
  DType param = param_dtype(x, {&gamma, &dgamma, &dbeta});  ///< gamma's, dgamma's, dbeta's
  bool one_rank = false;                                    ///< as BnForward's
  /// As BnForward::fuses: the apply computes this rank's sums itself (x and dy re-read).
  bool fuses() const {
    return one_rank && opt.stats != Stats::kExact &&
           kernels::cpu::bn_fuses(a, 2 * static_cast<int64_t>(dtype_size(x.dtype)));
  }
};

}  // namespace tpnorm::detail
