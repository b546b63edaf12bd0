// storage.h — host buffers of any tpnorm storage dtype for tests and the benchmark: values are
// made in float, rounded once to the dtype, and read back as float. The reference then sees
// exactly the rounded inputs the op sees. The fp16 / bf16 conversions are written here, not
// taken from the library, so a rounding bug there cannot hide by being on both sides.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tpnorm/tensor.h"

namespace tpnorm_test {

/// float -> IEEE binary16 bits, round to nearest even; overflow to inf, NaN stays a quiet NaN.
/// (F. Giesen's float_to_half_fast3_rtne: the subnormal range rounds by one float addition.)
inline uint16_t float_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= 0x47800000u) {  // >= 2^16 (after rounding, everything from 65520 up is inf) or NaN
    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {               // below 2^-14: a half subnormal or zero
    const uint32_t magic_bits = 0x3f000000u;  // 0.5: aligns the half's last mantissa bit
    float magic, v;
    std::memcpy(&magic, &magic_bits, 4);
    std::memcpy(&v, &u, 4);
    v += magic;
    std::memcpy(&u, &v, 4);
    o = static_cast<uint16_t>(u - magic_bits);
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;  // rebias the exponent (15 - 127) and round to nearest even
    o = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

/// IEEE binary16 bits -> float (exact).
inline float f16_bits_to_float(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const float s = (h & 0x8000u) ? -1.f : 1.f;
  if (e == 0x1f) return m ? std::nanf("") : s * INFINITY;
  if (e == 0) return s * std::ldexp(static_cast<float>(m), -24);
  return s * std::ldexp(static_cast<float>(m | 0x400), e - 25);
}

/// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class Buffer {
 public:
  Buffer() = default;
  Buffer(tpnorm::DType t, const std::vector<float>& v) : dtype_(t), n_(v.size()) {
    bytes_.resize(n_ * tpnorm::dtype_size(t));
    for (size_t i = 0; i < n_; ++i) set(i, v[i]);
  }
  Buffer(tpnorm::DType t, size_t n) : Buffer(t, std::vector<float>(n, 0.f)) {}

  void set(size_t i, float f) {
    using tpnorm::DType;
    switch (dtype_) {
      case DType::F16: {
        uint16_t h = float_to_f16_bits(f);
        std::memcpy(&bytes_[2 * i], &h, 2);
        break;
      }
      case DType::BF16: {
        uint16_t h = float_to_bf16_bits(f);
        std::memcpy(&bytes_[2 * i], &h, 2);
        break;
      }
      case DType::F64: {
        double d = f;
        std::memcpy(&bytes_[8 * i], &d, 8);
        break;
      }
      default:
        std::memcpy(&bytes_[4 * i], &f, 4);
    }
  }
  float get(size_t i) const {
    using tpnorm::DType;
    switch (dtype_) {
      case DType::F16: {
        uint16_t h;
        std::memcpy(&h, &bytes_[2 * i], 2);
        return f16_bits_to_float(h);
      }
      case DType::BF16: {
        uint16_t h;
        std::memcpy(&h, &bytes_[2 * i], 2);
        return bf16_bits_to_float(h);
      }
      case DType::F64: {
        double d;
        std::memcpy(&d, &bytes_[8 * i], 8);
        return static_cast<float>(d);
      }
      default: {
        float f;
        std::memcpy(&f, &bytes_[4 * i], 4);
        return f;
      }
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
    case tpnorm::DType::F16:
      return 1e-3;
    case tpnorm::DType::BF16:
      return 8e-3;
    default:
      return 1e-5;
  }
}

}  // namespace tpnorm_test
