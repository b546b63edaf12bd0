// tpnorm/batch_norm.h — SyncBatchNorm (data parallelism): per-channel statistics over the
// global batch, with PyTorch's semantics.
//
// x is NCHW [N_local, C, *spatial] (any number of spatial dims, including none: [N, C]) or
// channels-last [N_local, *spatial, C]. N_local may differ across ranks and may be 0; such a
// rank still joins the collective with count 0. With n = global count per channel
// (sum over ranks of N_local * prod(spatial)):
//
//   training:  mu_c = sum(x)/n   var_c = max(sum(x^2)/n - mu_c^2, 0)   invstd = 1/sqrt(var + eps)
//              y = gamma * (x - mu) * invstd + beta
//              running_mean = (1-m)*running_mean + m*mu
//              running_var  = (1-m)*running_var  + m*var*n/(n-1)      (unbiased, as PyTorch)
//              m = momentum, or 1/num_batches_tracked when momentum is "none" (cumulative
//              average); num_batches_tracked is incremented first, as in PyTorch.
//   eval:      running statistics, no communication at all.
//   backward (training), sums over the global batch, g = dy:
//              dx = gamma*invstd*(dy - sum(dy)/n - (x-mu)*invstd^2*sum(dy*(x-mu))/n)
//              dgamma = sum_local(dy * xhat), dbeta = sum_local(dy): this rank's sums; the
//              caller's gradient all-reduce combines them (as PyTorch's SyncBatchNorm does).
//   backward (eval): dx = gamma * invstd_running * dy, no communication.
//
// A training forward makes ONE collective: per-channel partials plus the count (an exact
// integer in float64, never float16; Stats::kNaive sends float32 and refuses 2^24 or more values
// per channel; Stats::kExact sends 13 int64 per channel forward, 11 backward, the integer sums
// that give the same bits at every world size) and the call header (see tpnorm/norm.h). A training
// call whose global count per channel is 1 is an error on every rank, as in PyTorch; an empty
// global batch (count 0) normalises nothing, as PyTorch's SyncBatchNorm: over several ranks the
// running statistics become (1 - momentum) times themselves (at one rank, PyTorch's plain
// batch_norm, they stay), num_batches_tracked counts the call, save_mean and
// save_invstd are 0 (so its backward gives zero dgamma / dbeta). On device communicators a
// count of 0 is still an error (the device kernels' rule).
#pragma once

#include <cstdint>
#include <limits>

#include "tpnorm/communicator.h"
#include "tpnorm/error.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

enum class Layout : int32_t {
  kNCHW = 0,          ///< [N, C, *spatial]
  kChannelsLast = 1,  ///< [N, *spatial, C]
};

struct BatchNormOptions {
  double eps = 1e-5;
  /// Running-statistics momentum; NaN means PyTorch's momentum=None (cumulative moving average).
  double momentum = 0.1;
  bool training = true;
  Layout layout = Layout::kNCHW;
  Stats stats = Stats::kRobust;
  bool check_agreement = true;
  int num_threads = 0;
  static double cumulative() { return std::numeric_limits<double>::quiet_NaN(); }
};

/// SyncBatchNorm forward.
/// [in]     x             [N_local, C, *spatial] or [N_local, *spatial, C] (opt.layout, which
///                        may differ between ranks: e.g. an empty batch left NCHW)
/// [in]     gamma, beta   [C] or absent (affine off); x's dtype, or float32 next to float16 /
///                        bfloat16 x (mixed precision, as autocast runs BatchNorm: fp32
///                        parameters, half activations; CPU communicators only, a device
///                        communicator refuses it on every rank). Both of the same dtype, the
///                        same on every rank.
/// [in,out] running_mean, running_var  [C] float32/float64 (the same), or absent
///                        (track_running_stats off; then eval mode uses batch statistics too,
///                        over the global batch with one collective, where PyTorch would use
///                        this rank's batch alone; pass training=true to the backward then)
/// [in,out] num_batches_tracked  may be null; incremented by a training call
/// [out]    y             like x
/// [out]    save_mean, save_invstd  [C] float32/float64 or absent: the statistics used (batch
///                        statistics in training, running ones in eval) for the backward
void sync_batch_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                             const TensorView& beta, const TensorView& running_mean,
                             const TensorView& running_var, int64_t* num_batches_tracked,
                             const TensorView& y, const TensorView& save_mean,
                             const TensorView& save_invstd, const BatchNormOptions& opt = {});

/// SyncBatchNorm backward. save_mean / save_invstd as written by the forward (in eval mode the
/// forward saves running_mean and 1/sqrt(running_var + eps)). opt.training says whether those
/// were batch statistics: then ONE collective of per-channel {sum dy, sum dy*(x-mean)} (count in
/// the header); otherwise they are constants and nothing is sent.
/// [out] dx like x; dgamma, dbeta [C] or absent: this rank's local sums (overwritten), in
///       gamma's dtype (float32 with mixed precision, see the forward).
void sync_batch_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                              const TensorView& gamma, const TensorView& save_mean,
                              const TensorView& save_invstd, const TensorView& dx,
                              const TensorView& dgamma, const TensorView& dbeta,
                              const BatchNormOptions& opt = {});

}  // namespace tpnorm
