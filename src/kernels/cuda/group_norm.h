// group_norm.h — CUDA kernels of GroupNorm / InstanceNorm on NCHW with channels sharded, the
// device side of kernels/cpu/group_norm.h (same layout, same stats, same order of additions):
// x is [n, c_local, spatial]; each (sample, local channel) plane is a row of `spatial` values,
// this rank's channels are [c0, c0 + c_local), channel c belongs to group c / cpg, and the
// payload holds per-(sample, group) sums of ALL groups (groups this rank does not touch: 0).
//
// Partials: the row kernels (row_norm.h) over the planes into scratch (forward pivoted per
// plane; backward {sum dy, sum dy*xhat} with the plane's group mean / rstd), then a fold that
// adds each group's planes in channel order (times gamma[c] in the backward) into the payload,
// and, backward, this rank's per-channel dgamma / dbeta sums (float64, in sample order) into
// scratch. Applies check the summed header on device (error flag, fingerprint, and that the
// ranks' channel counts add up to `channels`): a failed call writes nothing and sets *err.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/row_norm.h"

namespace tpnorm::kernels::cuda {

struct GroupArgs {
  int64_t n = 0, c_local = 0, spatial = 0, c0 = 0, groups = 1, cpg = 1;
  int64_t channels = 0;    ///< all channels: what the header's summed count must be
  bool s64 = false;        ///< saved mean / rstd are double
  void* stream = nullptr;  ///< cudaStream_t
};

/// Device scratch the functions below need (any pass).
size_t group_scratch_bytes(const GroupArgs& a);

template <class T>
void group_partial_forward(const GroupArgs& a, const T* x, bool robust, bool w64, void* payload,
                           void* scratch);

/// count: elements per group over all ranks (cpg * spatial). mean / rstd [n * groups] or null.
template <class T>
void group_apply_forward(const GroupArgs& a, const Header& hd, double count, double eps, const T* x,
                         const T* gamma, const T* beta, T* y, void* mean, void* rstd, void* scratch,
                         int* err);

template <class T>
void group_partial_backward(const GroupArgs& a, const T* dy, const T* x, const T* gamma,
                            const void* mean, const void* rstd, bool w64, void* payload,
                            void* scratch);

/// dx, and dgamma / dbeta [c_local] (either may be null) from this rank's sums in scratch.
template <class T>
void group_apply_backward(const GroupArgs& a, const Header& hd, double count, const T* dy,
                          const T* x, const T* gamma, const void* mean, const void* rstd, T* dx,
                          T* dgamma, T* dbeta, void* scratch, int* err);

}  // namespace tpnorm::kernels::cuda
