// tpnorm/tensor.h — the non-owning tensor view every tpnorm call takes.
//
// A TensorView is a pointer, a dtype, a device and a row-major shape. It never owns memory:
// the caller allocates, keeps it alive for the duration of the call, and frees it. An "absent"
// optional argument (no gamma, no beta, no running statistics) is the default-constructed view.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace tpnorm {

/// Storage types. Accumulation is float32 or float64 whatever the storage type. I64 is not a
/// tensor dtype: it is the wire type of Stats::kExact (integer limbs summed by all_reduce_sum).
enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, F64 = 3, I64 = 4 };

/// Size in bytes of one element of `t`.
size_t dtype_size(DType t);
/// "fp32", "fp16", "bf16", "fp64", "int64".
const char* dtype_name(DType t);

/// Where a view's memory lives. CUDA views carry the device ordinal.
enum class DeviceKind : int32_t { CPU = 0, CUDA = 1 };
struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceKind::CUDA, i}; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

/// Up to 8 dimensions, row-major (the last dimension is contiguous).
struct Shape {
  static constexpr int kMaxDims = 8;
  int ndim = 0;
  int64_t dims[kMaxDims] = {};

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t numel() const;  ///< product of dims; 1 for ndim == 0
  int64_t operator[](int i) const { return dims[i]; }
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  ///< "[2, 3]"
};

/// Non-owning view of a dense row-major tensor.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;
  Device device;

  TensorView() = default;
  TensorView(void* d, DType t, Shape s, Device dev = Device::cpu())
      : data(d), dtype(t), shape(s), device(dev) {}
  /// Convenience for read-only inputs: tpnorm never writes through a view documented [in].
  TensorView(const void* d, DType t, Shape s, Device dev = Device::cpu())
      : data(const_cast<void*>(d)), dtype(t), shape(s), device(dev) {}

  bool present() const { return shape.ndim > 0; }  ///< false for the absent default view
  int64_t numel() const { return present() ? shape.numel() : 0; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

/// float32 views of host arrays, the common case in tests and examples.
inline TensorView view(float* p, Shape s) { return {p, DType::F32, s}; }
inline TensorView view(const float* p, Shape s) { return {p, DType::F32, s}; }

}  // namespace tpnorm
