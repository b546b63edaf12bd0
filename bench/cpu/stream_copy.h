// stream_copy.h — the memory limit's second copy: float32 past the caches with non-temporal
// (streaming) stores.
//
// An ordinary store to a line not in cache first reads the line (read-for-ownership), so a
// copy larger than the last-level cache moves 1.5x the bytes it counts; streaming stores skip
// that read, as the kernels' large-tensor path does. The benchmark keeps its own copy loop
// (same ISA choice as the kernels: AVX-512, else AVX2, else a plain copy) rather than reaching
// into the library's private kernel headers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tpnorm_perf {

/// Copies n floats with streaming stores; dst and src must not overlap. Any alignment (peels
/// to a 64-byte boundary of dst). End a batch of copies with stream_fence().
inline void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j) dst[j] = src[j];
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#endif
  if (j < n) std::memcpy(dst + j, src + j, static_cast<size_t>(n - j) * sizeof(float));
}

/// Orders the streaming stores before what follows (they are weakly ordered).
inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_sfence();
#endif
}

}  // namespace tpnorm_perf
