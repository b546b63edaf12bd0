// storage.h — host buffers of any tpnorm storage dtype for tests: values are made in float,
// rounded once to the dtype, and read back as float. The reference then sees exactly the
// rounded inputs the op sees.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/half.h"
#include "tpnorm/tensor.h"

namespace tpnorm_test {

class Buffer {
 public:
  Buffer() = default;
  Buffer(tpnorm::DType t, const std::vector<float>& v) : dtype_(t), n_(v.size()) {
    bytes_.resize(n_ * tpnorm::dtype_size(t));
    for (size_t i = 0; i < n_; ++i) set(i, v[i]);
  }
  Buffer(tpnorm::DType t, size_t n) : Buffer(t, std::vector<float>(n, 0.f)) {}

  void set(size_t i, float f) {
    using namespace tpnorm;
    switch (dtype_) {
      case DType::F16: { f16 h = from_float<f16>(f); std::memcpy(&bytes_[2 * i], &h, 2); break; }
      case DType::BF16: { bf16 h = from_float<bf16>(f); std::memcpy(&bytes_[2 * i], &h, 2); break; }
      case DType::F64: { double d = f; std::memcpy(&bytes_[8 * i], &d, 8); break; }
      default: std::memcpy(&bytes_[4 * i], &f, 4);
    }
  }
  float get(size_t i) const {
    using namespace tpnorm;
    switch (dtype_) {
      case DType::F16: { f16 h; std::memcpy(&h, &bytes_[2 * i], 2); return to_float(h); }
      case DType::BF16: { bf16 h; std::memcpy(&h, &bytes_[2 * i], 2); return to_float(h); }
      case DType::F64: { double d; std::memcpy(&d, &bytes_[8 * i], 8); return static_cast<float>(d); }
      default: { float f; std::memcpy(&f, &bytes_[4 * i], 4); return f; }
    }
  }
  std::vector<float> floats() const {
    std::vector<float> v(n_);
    for (size_t i = 0; i < n_; ++i) v[i] = get(i);
    return v;
  }
  tpnorm::TensorView view(tpnorm::Shape s) { return {bytes_.data(), dtype_, s}; }
  size_t size() const { return n_; }
  tpnorm::DType dtype() const { return dtype_; }

 private:
  tpnorm::DType dtype_ = tpnorm::DType::F32;
  size_t n_ = 0;
  std::vector<unsigned char> bytes_;
};

/// Relative tolerance of one rounding to the storage dtype (outputs are rounded once).
inline double storage_rtol(tpnorm::DType t) {
  switch (t) {
    case tpnorm::DType::F16: return 1e-3;
    case tpnorm::DType::BF16: return 8e-3;
    default: return 1e-5;
  }
}

}  // namespace tpnorm_test
