// stream_store.h — copying float32 past the caches with non-temporal (streaming) stores.
//
// An ordinary store to a line not in cache first reads the line (read-for-ownership), so a
// kernel that writes a tensor larger than the last-level cache moves 1.5x the bytes it counts.
// Streaming stores skip that read; kernels stage a row in L1 and copy it out with
// stream_copy(), and the benchmark's memory limit uses the same loop. Without AVX2/AVX-512 it
// falls back to memcpy. Callers end a batch of streaming stores with stream_fence().
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tpnorm::kernels::cpu {

/// Copies n floats; dst and src must not overlap. Any alignment (peels to a 64-byte boundary).
inline void stream_copy(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
  int64_t j = 0;
  while (j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0) {
    dst[j] = src[j];
    ++j;
  }
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
#else
  for (; j + 8 <= n; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
#endif
  for (; j < n; ++j) dst[j] = src[j];
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
#endif
}

/// Orders earlier streaming stores before later loads/stores (e.g. before another thread reads).
inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_sfence();
#endif
}

}  // namespace tpnorm::kernels::cpu
