// stream_store.h — copying float32 past the caches with non-temporal (streaming) stores.
//
// An ordinary store to a line not in cache first reads the line (read-for-ownership), so a
// kernel that writes a tensor larger than the last-level cache moves 1.5x the bytes it counts.
// Streaming stores skip that read. The benchmark's memory limit uses this copy; the kernels
// stream from registers (write_row in loops.h). Without AVX2/AVX-512 it is a plain copy.
// Callers end a batch of streaming stores with stream_fence() (simd.h).
#pragma once

#include <cstdint>

#include "kernels/cpu/simd.h"

namespace tpnorm::kernels::cpu {

/// Copies n floats; dst and src must not overlap. Any alignment (peels to a 64-byte boundary).
inline void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t j = 0;
  for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & 63) != 0; ++j) dst[j] = src[j];
  for (; j + vf::L <= n; j += vf::L) vstream(dst + j, vload(src + j));
  for (; j < n; ++j) dst[j] = src[j];
}

}  // namespace tpnorm::kernels::cpu
