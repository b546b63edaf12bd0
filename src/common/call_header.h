// call_header.h — the layout of the header that leads every call's packed buffer, in one place
// for the host (ops/packed_call.cpp writes and checks it) and the device (the CUDA apply
// kernels check the summed header on device). constexpr only, no includes beyond <cstdint>, so
// a .cu file can use it as it is.
//
// Values, in the call's wire type W (double or float), all summed by the call's one collective:
//   [kErrorIndex]                 number of ranks whose local validation failed (0 or 1 each)
//   [kCountIndex]                 this rank's element count per statistic set (summed: global)
//   [chunk_index(i)], [+1]        fingerprint chunk c_i and c_i^2, i < kChunks (agreement only):
//                                 all P ranks sent the same c_i iff P * sum(c^2) == sum(c)^2
//   [header_values(agreement) ..) the op's payload
#pragma once

#include <cstdint>

namespace tpnorm::detail::call_header {

inline constexpr int kErrorIndex = 0;
inline constexpr int kCountIndex = 1;
/// Values without the fingerprint (check_agreement off and not strict).
inline constexpr int kBaseValues = 2;
/// Fingerprint chunks; chunk i holds bits [kChunkStride * i, + chunk_bits) of the 64-bit hash.
inline constexpr int kChunks = 4;
inline constexpr int kChunkStride = 16;
/// Values with the fingerprint.
inline constexpr int kFullValues = kBaseValues + 2 * kChunks;

inline constexpr int header_values(bool agreement) { return agreement ? kFullValues : kBaseValues; }
/// Index of chunk i's value; its square follows it.
inline constexpr int chunk_index(int i) { return kBaseValues + 2 * i; }

/// Widest chunk (at most kChunkStride bits) whose square, summed over `ranks`, stays an exact
/// integer in a wire type of `mantissa` bits (53 for double, 24 for float).
inline constexpr int chunk_bits(int mantissa, int ranks) {
  int lg = 0;
  while ((int64_t{1} << lg) < ranks) ++lg;
  const int b = (mantissa - lg) / 2;
  return b > kChunkStride ? kChunkStride : (b < 1 ? 1 : b);
}

/// The fingerprint hash: 64-bit FNV-1a over the op name, the wire dtype and each agreement
/// field's name and value.
inline constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
inline constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
inline constexpr uint64_t fnv1a_byte(uint64_t h, unsigned char c) { return (h ^ c) * kFnvPrime; }

/// Float32 wire counts are exact only below 2^24 (Stats::kNaive).
inline constexpr double kFloatCountLimit = 16777216.0;

}  // namespace tpnorm::detail::call_header
