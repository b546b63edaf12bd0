// half.h — float16 / bfloat16 storage types for the CPU path.
//
// Storage only: kernels load them into float, accumulate in float/double and round back once
// per output element (round to nearest even, NaN preserved). Layout-compatible with
// __half / __nv_bfloat16 (a uint16_t), so the same host buffers feed the CUDA kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace tpnorm {

struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(float v) { return v; }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
inline float to_float(f16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  uint32_t exp = (v.bits >> 10) & 0x1fu;
  uint32_t man = v.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    return bits_float(sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man << 13));
  }
  return bits_float(sign | (exp + 112u) << 23 | (man << 13));
}

template <class T>
T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline double from_float<double>(float f) {
  return f;
}
template <>
inline bf16 from_float<bf16>(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
template <>
inline f16 from_float<f16>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};   // nan
  if (a >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal or zero in half: scale by 2^24 and round
    const float r = bits_float(a) * 16777216.0f;
    const uint32_t m = static_cast<uint32_t>(r);
    const float frac = r - static_cast<float>(m);
    uint32_t q = m + ((frac > 0.5f || (frac == 0.5f && (m & 1u))) ? 1u : 0u);
    return {static_cast<uint16_t>(sign | q)};
  }
  const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return {static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

}  // namespace tpnorm
