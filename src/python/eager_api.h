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

inline constexpr uint32_t kVersion = 1;
inline constexpr const char* kCapsuleName = "tpnorm._tpnorm.eager_api";

/// Each call is the binding's call of the same name (layer_norm_* when centered, else
/// rms_norm_*, which ignore beta / mean / dbeta): the same checks, the same agreement, the GIL
/// released while the op runs. A null Tensor* is an absent argument. Called with the GIL
/// held; returns true, or false with the Python error set (tpnorm.Error as the binding raises
/// it), so that the caller re-raises it as its framework does.
struct Api {
  uint32_t version;
  bool (*row_norm_forward)(void* comm, const void* opt, bool centered, const Tensor* x,
                           const Tensor* gamma, const Tensor* beta, const Tensor* y,
                           const Tensor* mean, const Tensor* rstd);
  bool (*row_norm_backward)(void* comm, const void* opt, bool centered, const Tensor* dy,
                            const Tensor* x, const Tensor* gamma, const Tensor* mean,
                            const Tensor* rstd, const Tensor* dx, const Tensor* dgamma,
                            const Tensor* dbeta);
};

}  // namespace tpnorm::python::eager
