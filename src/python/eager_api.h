// eager_api.h — the table of calls through which tpnorm._autograd (C++ autograd functions,
// compiled against the torch that runs them) reaches the ops inside tpnorm._tpnorm (compiled
// without torch).
//
// Why a table: the ops, their communicators and their error type live in _tpnorm, which links
// libtpnorm statically; a second copy of libtpnorm in the autograd module would have its own
// state. _tpnorm publishes the table as the capsule `_tpnorm.eager_api` (kCapsuleName); the
// autograd module reads it once at import. Tensors cross as Tensor below, filled from an
// at::Tensor without a copy (this header includes nothing of torch or DLPack, so both sides can
// include it); communicators and NormOptions as the addresses of objects the Python package
// keeps alive for the life of the process.
#pragma once

#include <cstdint>

namespace tpnorm::python::eager {

/// A tensor's description: dtype_code as DLPack's (2 float, 4 bfloat), device_type 1 CPU or
/// 2 CUDA, strides in elements. data is the address of the first element.
struct Tensor {
  void* data;
  const int64_t* shape;
  const int64_t* strides;
  int32_t ndim;
  int32_t device_type;
  int32_t device_id;
  uint8_t dtype_code;
  uint8_t dtype_bits;
};

inline constexpr uint32_t kVersion = 2;
inline constexpr const char* kCapsuleName = "tpnorm._tpnorm.eager_api";

/// Each call is the binding's call of the same op (the row norms: layer_norm_* when centered,
/// else rms_norm_*, which ignore beta / mean / dbeta; the fused ones likewise; group_*:
/// instance_norm_* when `instance`): the same checks, the same agreement, the GIL released while
/// the op runs. A null Tensor* is an absent argument. `opt` is the address of a NormOptions the
/// package keeps alive; SyncBatchNorm's options travel as values (its momentum changes per
/// call). Called with the GIL held; returns true, or false with the Python error set
/// (tpnorm.Error as the binding raises it), so that the caller re-raises it as its framework
/// does.
struct Api {
  uint32_t version;
  bool (*row_norm_forward)(void* comm, const void* opt, bool centered, const Tensor* x,
                           const Tensor* gamma, const Tensor* beta, const Tensor* y,
                           const Tensor* mean, const Tensor* rstd);
  bool (*row_norm_backward)(void* comm, const void* opt, bool centered, const Tensor* dy,
                            const Tensor* x, const Tensor* gamma, const Tensor* mean,
                            const Tensor* rstd, const Tensor* dx, const Tensor* dgamma,
                            const Tensor* dbeta);
  /// h = alpha * x + f, y = Norm(h) (tpnorm/fused.h).
  bool (*fused_forward)(void* comm, const void* opt, bool centered, double alpha,
                        const Tensor* x, const Tensor* f, const Tensor* gamma, const Tensor* beta,
                        const Tensor* h, const Tensor* y, const Tensor* mean, const Tensor* rstd);
  bool (*fused_backward)(void* comm, const void* opt, bool centered, double alpha,
                         const Tensor* dy, const Tensor* dh_extra, const Tensor* h,
                         const Tensor* gamma, const Tensor* mean, const Tensor* rstd,
                         const Tensor* dx, const Tensor* df, const Tensor* dgamma,
                         const Tensor* dbeta);
  /// GroupNorm / InstanceNorm (tpnorm/group_norm.h): ChannelGroups{groups, channels, offset}.
  bool (*group_forward)(void* comm, const void* opt, int64_t groups, int64_t channels,
                        int64_t offset, bool instance, const Tensor* x, const Tensor* gamma,
                        const Tensor* beta, const Tensor* y, const Tensor* mean,
                        const Tensor* rstd);
  bool (*group_backward)(void* comm, const void* opt, int64_t groups, int64_t channels,
                         int64_t offset, bool instance, const Tensor* dy, const Tensor* x,
                         const Tensor* gamma, const Tensor* mean, const Tensor* rstd,
                         const Tensor* dx, const Tensor* dgamma, const Tensor* dbeta);
  /// The gated RMSNorm (tpnorm/rms_norm_gated.h): GatedGroups{group_size, hidden, offset,
  /// norm_before_gate}.
  bool (*gated_forward)(void* comm, const void* opt, int64_t group_size, int64_t hidden,
                        int64_t offset, bool norm_before_gate, const Tensor* x, const Tensor* z,
                        const Tensor* weight, const Tensor* y, const Tensor* rstd);
  bool (*gated_backward)(void* comm, const void* opt, int64_t group_size, int64_t hidden,
                         int64_t offset, bool norm_before_gate, const Tensor* dy,
                         const Tensor* x, const Tensor* z, const Tensor* weight,
                         const Tensor* rstd, const Tensor* dx, const Tensor* dz,
                         const Tensor* dweight);
  /// SyncBatchNorm (tpnorm/batch_norm.h); x (and dy, dx) as the kernels take them (channels
  /// last: the [N, *spatial, C] view); stats as tpnorm::Stats.
  bool (*batch_norm_forward)(void* comm, double eps, double momentum, bool training,
                             bool channels_last, int stats, const Tensor* x, const Tensor* gamma,
                             const Tensor* beta, const Tensor* running_mean,
                             const Tensor* running_var, const Tensor* y, const Tensor* save_mean,
                             const Tensor* save_invstd);
  bool (*batch_norm_backward)(void* comm, double eps, bool training, bool channels_last,
                              int stats, const Tensor* dy, const Tensor* x, const Tensor* gamma,
                              const Tensor* save_mean, const Tensor* save_invstd,
                              const Tensor* dx, const Tensor* dgamma, const Tensor* dbeta);
  /// K row norms in one collective (tpnorm/batched.h): item i's tensors are t[6i..6i+5] =
  /// x, gamma, beta, y, mean, rstd forward and t[8i..8i+7] = dy, x, gamma, mean, rstd, dx,
  /// dgamma, dbeta backward; hidden[i] its hidden size (0: not checked).
  bool (*batched_forward)(void* comm, const void* opt, int64_t k, const bool* centered,
                          const int64_t* hidden, const Tensor* const* t);
  bool (*batched_backward)(void* comm, const void* opt, int64_t k, const bool* centered,
                           const int64_t* hidden, const Tensor* const* t);
};

}  // namespace tpnorm::python::eager
