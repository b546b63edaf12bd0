// batch_norm.h — CPU kernels of SyncBatchNorm: per-channel statistics over a batch that is
// sharded across data-parallel ranks.
//
// The kernels know nothing of communication: partial_* reduce this rank's elements of every
// channel into a packed stats buffer; the op sums that buffer over ranks; apply_* finish each
// element from the summed statistics. A CUDA version provides the same functions for device
// memory.
//
// Geometry: x holds n samples of c channels with `inner` = prod(spatial) positions each;
//   NCHW          element (b, ch, s) at (b*c + ch)*inner + s   (a channel is n runs of inner)
//   channels-last element (b, s, ch) at (b*inner + s)*c + ch   (rows of c channels)
// n may be 0 (an empty local batch still joins the collective with zero partials).
//
// Stats layout per channel ch: forward {sum x, sum x^2} at [2ch, 2ch+1]; backward
// {sum dy, sum dy*(x-mean)}. W (the wire type) is double in the robust mode, where forward sums
// are accumulated around a per-channel pivot (common/pivot.h, from this rank's first values of
// the channel), so rounding does not grow with the count and 1e4 + N(0,1) loses nothing;
// shifting the sums back for the wire still leaves a relative variance error of about
// 1e-16 * (mean/std)^2. W is float in the naive mode.
//
// P, the type of gamma / beta / dgamma / dbeta, is T or float: fp16/bf16 activations with
// float32 parameters and parameter gradients (mixed precision, as autocast runs BatchNorm).
// Running and saved statistics keep their own float32/float64 dtypes either way.
#pragma once

#include <cstdint>

namespace tpnorm::kernels::cpu {

struct BatchNormArgs {
  int64_t n = 0;               ///< local samples (may be 0)
  int64_t c = 0;               ///< channels
  int64_t inner = 1;           ///< positions per sample and channel (1 for [N, C])
  bool channels_last = false;  ///< [N, *spatial, C] instead of [N, C, *spatial]
  int threads = 0;             ///< 0: OpenMP default
  /// NCHW: only channels [c_begin, c_end) (c_end -1: c), one chunk of a chunked call (the
  /// partials write, and the applies read, those channels' stats only; the same bits per
  /// channel as the whole call). Channels-last: always every channel.
  int64_t c_begin = 0, c_end = -1;
  int64_t channel_end() const { return c_end < 0 ? c : c_end; }
};

/// stats[2c]: {sum x, sum x^2} of this rank's elements of each channel.
template <class T, class W>
void bn_partial_forward(const BatchNormArgs& a, const T* x, W* stats);

/// Per-channel batch moments from stats summed over ranks; n: global count per channel (> 0).
/// var is the biased variance, clamped at 0.
template <class W>
void bn_moments(int64_t c, const W* stats, double n, double* mean, double* var);

/// y = gamma * (x - mean) * invstd + beta; gamma/beta may be null (1 / 0).
template <class T, class P, class S>
void bn_apply_forward(const BatchNormArgs& a, const T* x, const P* gamma, const P* beta,
                      const S* mean, const S* invstd, T* y);

/// stats[2c]: {sum dy, sum dy*(x - mean)} of this rank's elements of each channel.
template <class T, class W, class S>
void bn_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean, W* stats);

/// dx = gamma*invstd*(dy - sum(dy)/n - (x-mean)*invstd^2*sum(dy*(x-mean))/n), stats summed over
/// ranks, n the global count. Zero stats give the eval backward dx = gamma*invstd*dy.
template <class T, class P, class W, class S>
void bn_apply_backward(const BatchNormArgs& a, const T* dy, const T* x, const P* gamma,
                       const S* mean, const S* invstd, const W* stats, double n, T* dx);

// One rank (the reduce is the identity), NCHW: a channel's statistics and its outputs in one
// pass over the channel, threads over channels, so that the apply re-reads the channel's planes
// from the caches instead of memory (x read from memory once instead of twice, and dy too in
// the backward). The same sums in the same order, the same constants and formulas as the
// partial + apply kernels above: the same bits. Channels-last has no such path: a channel's
// statistics need every row, so nothing of x is still in cache when the apply starts.

/// Whether the fused path pays for `a`: NCHW, a channel's planes of the re-read inputs
/// (input_bytes per element: x, or x and dy) fit in bn_fused_channel_bytes, and the channels
/// split evenly enough over the threads (the two-pass apply splits planes, not channels).
bool bn_fuses(const BatchNormArgs& a, int64_t input_bytes);

/// The most bytes of a channel's re-read planes the fused path takes at `threads` threads: the
/// core's L2 plus a share of the last-level cache, L2 + LLC / (4 max(threads, 2)). A channel
/// larger than the L2 is still re-read from cache: the lines the apply's prefetch of the next
/// channel pushes out of L2 are in the L3 (a victim cache on AMD and on Intel since Skylake-SP),
/// so the fused path paid up to about 5 MB of x and dy per channel on a 512 KiB-L2 / 32 MiB-L3
/// core (docs/measurements.md), and stops paying where the
/// thread's two live channels crowd the L3 (6.4 MB measured even at one thread, a loss at
/// 12.8 MB).
int64_t bn_fused_channel_bytes(int threads);

/// bn_partial_forward + bn_moments + invstd = 1/sqrt(var + eps) + bn_apply_forward, channel by
/// channel; n: the count per channel (the call header's); mean, var, invstd: [c] outputs.
template <class T, class P, class W>
void bn_fused_forward(const BatchNormArgs& a, const T* x, const P* gamma, const P* beta, double eps,
                      double n, double* mean, double* var, double* invstd, T* y);

/// bn_partial_backward into sums[2c] + bn_apply_backward from them, channel by channel; n: the
/// count per channel, or 0 for the eval backward (dx = gamma*invstd*dy; sums still written, for
/// dgamma / dbeta).
template <class T, class P, class W, class S>
void bn_fused_backward(const BatchNormArgs& a, const T* dy, const T* x, const P* gamma,
                       const S* mean, const S* invstd, double n, W* sums, T* dx);

/// dgamma = invstd * sum_local(dy*(x-mean)), dbeta = sum_local(dy) from this rank's (unsummed)
/// backward partials; either output may be null.
template <class P, class W, class S>
void bn_param_grads(int64_t c, const W* local_stats, const S* invstd, P* dgamma, P* dbeta);

// float64 storage: double kernels of their own (kernels/cpu/float64.cpp), every sum and
// element formula in double, for every wire and saved-statistics type.
#define TPNORM_BN_F64_W(W)                                                                        \
  template <>                                                                                     \
  void bn_partial_forward<double, W>(const BatchNormArgs&, const double*, W*);                    \
  template <>                                                                                     \
  void bn_apply_forward<double, double, W>(const BatchNormArgs&, const double*, const double*,    \
                                           const double*, const W*, const W*, double*);           \
  template <>                                                                                     \
  void bn_fused_forward<double, double, W>(const BatchNormArgs&, const double*, const double*,    \
                                           const double*, double, double, double*, double*,       \
                                           double*, double*);
#define TPNORM_BN_F64_WS(W, S)                                                                    \
  template <>                                                                                     \
  void bn_partial_backward<double, W, S>(const BatchNormArgs&, const double*, const double*,      \
                                         const S*, W*);                                           \
  template <>                                                                                     \
  void bn_apply_backward<double, double, W, S>(const BatchNormArgs&, const double*,               \
                                               const double*, const double*, const S*, const S*,  \
                                               const W*, double, double*);                        \
  template <>                                                                                     \
  void bn_fused_backward<double, double, W, S>(const BatchNormArgs&, const double*,               \
                                               const double*, const double*, const S*, const S*,  \
                                               double, W*, double*);                              \
  template <>                                                                                     \
  void bn_param_grads<double, W, S>(int64_t, const W*, const S*, double*, double*);
TPNORM_BN_F64_W(float)
TPNORM_BN_F64_W(double)
TPNORM_BN_F64_WS(float, float)
TPNORM_BN_F64_WS(float, double)
TPNORM_BN_F64_WS(double, float)
TPNORM_BN_F64_WS(double, double)
#undef TPNORM_BN_F64_W
#undef TPNORM_BN_F64_WS

}  // namespace tpnorm::kernels::cpu
