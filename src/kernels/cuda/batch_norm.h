// batch_norm.h — CUDA kernels of SyncBatchNorm, the device counterpart of
// kernels/cpu/batch_norm.h; they know nothing of communication.
//
// Geometry: both layouts are the logical tensor [outer, c, inner], element (o, ch, s) at
// (o*c + ch)*inner + s: NCHW has outer = n, inner = prod(spatial); channels-last has
// outer = n*prod(spatial), inner = 1. Per-channel sums take two stages: partial sums of
// (channel, split) blocks into float scratch, then a fixed-order sum over splits per channel
// (deterministic for a shape). Element work is float32; x - mean is (x - head) - tail with
// the mean split into floats, as on CPU. Per-channel constants are computed once per channel
// by a small kernel and read by the element-wise kernels.
//
// Device checks: kernels that take a Header read the summed call header (see row_norm.h);
// a failed or disagreeing call, or a training forward with global count n <= 1, writes no
// output, saved or running statistic and sets *err. A Header with base == nullptr means a call
// without a collective (eval): nothing to check.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/row_norm.h"

namespace tpnorm::kernels::cuda {

struct BnArgs {
  int64_t outer = 0, c = 0, inner = 1;
  bool channels_last = false;  ///< the layout (picks the robust pivot's span, as on CPU)
  void* stream = nullptr;      ///< cudaStream_t
};

/// Device scratch (bytes) the functions below need, for any pass.
size_t bn_scratch_bytes(const BnArgs& a);

/// payload[2ch] = {sum x, sum x^2} of this rank's elements of channel ch (around a pivot in the
/// robust mode, sent as float64 moments), W = double when w64.
template <class T>
void bn_partial_forward(const BnArgs& a, const T* x, bool robust, bool w64, void* payload,
                        void* scratch);

/// Per-channel constants of the forward into scratch, saved statistics, running statistics.
/// Training / batch statistics: from the summed payload (hd.base != nullptr); update_running
/// applies momentum m. Eval: from running_mean / running_var (hd.base == nullptr).
struct BnForwardStats {
  Header hd;
  double eps = 1e-5;
  bool update_running = false;
  double momentum = 0.1;
  void* running_mean = nullptr;
  void* running_var = nullptr;
  bool r64 = false;
  void* save_mean = nullptr;
  void* save_invstd = nullptr;
  bool mean64 = false, invstd64 = false;  ///< dtypes of save_mean / save_invstd
};
template <class T>
void bn_forward_stats(const BnArgs& a, const BnForwardStats& f, const T* gamma, const T* beta,
                      void* scratch, int* err);
template <class T>
void bn_apply_forward(const BnArgs& a, const Header& hd, const T* x, T* y, void* scratch, int* err);

/// payload[2ch] = {sum dy, sum dy*(x - mean)} of this rank's elements; a float64 copy of these
/// local sums stays in scratch for dgamma / dbeta.
template <class T>
void bn_partial_backward(const BnArgs& a, const T* dy, const T* x, const void* mean, bool s64,
                         bool w64, void* payload, void* scratch);

/// dx (with summed sums when hd.base != nullptr, else the eval backward dx = gamma*invstd*dy),
/// dgamma = invstd * local sum dy*(x-mean), dbeta = local sum dy (either may be null).
template <class T>
void bn_apply_backward(const BnArgs& a, const Header& hd, const T* dy, const T* x, const T* gamma,
                       const void* mean, const void* invstd, bool s64, T* dx, T* dgamma, T* dbeta,
                       void* scratch, int* err);

}  // namespace tpnorm::kernels::cuda
