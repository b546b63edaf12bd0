// plan.h — the launch geometry of the CUDA kernels, chosen on the host from the shape and the
// pointers before anything is launched. Plain C++ (no CUDA types), so that host unit tests
// (tests/gpu/host_test_gpu_plans.cpp) check every decision here without a GPU.
//
// Row norms (kernels/cuda/row_norm.cu): a warp per row (4 rows per 128-thread block) when
// h <= 1024, else a 256-thread block per row. Vector width V = the widest power of two that
// divides both 16 / sizeof(T) and h (flashinfer's gcd(16 / sizeof(T), h)) and to whose V *
// sizeof(T) bytes every pointer is aligned: then every row of every operand starts aligned
// too (row r starts r * h elements in, a multiple of V), and no row needs a scalar head or
// tail. Uneven tensor-parallel splits keep wide loads: h = 1000 in fp16 -> V = 8, h = 1030
// -> V = 2, only odd h or a pointer off by one element falls back to V = 1.
//
// SyncBatchNorm (kernels/cuda/batch_norm.cu): both layouts are [outer, c, inner]; the
// per-channel sums run in `splits` slices of `per` outer rows, a 256-thread block per
// (channel, split) when inner >= 32 ("wide"), else 32-channel x 8-row tiles ("narrow").
// A tensor without elements (a zero dim anywhere, e.g. a zero-size spatial dim [4, 8, 0, 5])
// gets splits = 0: no kernel reads x, whose pointer may be null.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>

namespace tpnorm::kernels::cuda {

// ---- row norms --------------------------------------------------------------------------

struct RowPlan {
  int tpr = 32;        ///< threads per row: 32 (a warp) or 256 (the block)
  int threads = 128;   ///< block size
  int64_t blocks = 0;  ///< grid size (0: nothing to launch)
  int vec = 1;         ///< elements per vector access (1, 2, 4, 8; at most 16 bytes)
};

/// gcd(16 / elem, h), halved until every non-null pointer is aligned to vec * elem bytes.
inline int row_vector_width(int64_t h, size_t elem, std::initializer_list<const void*> ptrs) {
  int v = static_cast<int>(16 / elem);
  while (v > 1 && h % v != 0) v /= 2;  // 16 / elem is a power of two: this is the gcd
  for (const void* p : ptrs)
    while (v > 1 && p && reinterpret_cast<uintptr_t>(p) % (static_cast<size_t>(v) * elem) != 0)
      v /= 2;
  return v;
}

/// Rows per launch are limited by the grid (2^31 - 1 blocks of 4 rows): far beyond any tensor
/// that fits in memory with h >= 1, but checked rather than wrapped.
inline RowPlan plan_rows(int64_t rows, int64_t h, size_t elem,
                         std::initializer_list<const void*> ptrs) {
  RowPlan p;
  p.vec = row_vector_width(h, elem, ptrs);
  p.tpr = h <= 1024 ? 32 : 256;
  p.threads = p.tpr == 32 ? 128 : 256;
  const int64_t per_block = p.threads / p.tpr;
  p.blocks = rows > 0 ? (rows + per_block - 1) / per_block : 0;
  if (p.blocks > INT32_MAX) throw std::length_error("tpnorm: too many rows for one CUDA launch");
  return p;
}

/// dgamma/dbeta: 32-column x 8-row tiles over row chunks, about 1024 blocks in all, at least
/// 8 rows per chunk; returns the chunk count and sets *rows_per_chunk.
inline constexpr int kDgammaTileCols = 32, kDgammaTileRows = 8;
inline int64_t dgamma_chunks(int64_t rows, int64_t h, int64_t* rows_per_chunk) {
  if (rows <= 0 || h <= 0) return *rows_per_chunk = 0, 0;
  const int64_t tiles = (h + kDgammaTileCols - 1) / kDgammaTileCols;
  int64_t chunks = std::max<int64_t>(1, 1024 / tiles);
  chunks = std::min(chunks, (rows + kDgammaTileRows - 1) / kDgammaTileRows);
  *rows_per_chunk = (rows + chunks - 1) / chunks;
  return (rows + *rows_per_chunk - 1) / *rows_per_chunk;
}

// ---- SyncBatchNorm ----------------------------------------------------------------------

inline constexpr int kBnWide = 256, kBnTileC = 32, kBnTileR = 8;

struct BnPlan {
  bool wide = true;         ///< a block per (channel, split), else 32 x 8 tiles
  int64_t splits = 0;       ///< 0: no sums kernel at all (no element)
  int64_t per = 0;          ///< outer rows per split
  bool has_values = false;  ///< this rank holds elements: only then is x read (the pivot)
};

/// Splits of the outer dimension: about 1024 blocks in all.
inline BnPlan plan_channels(int64_t outer, int64_t c, int64_t inner) {
  BnPlan p;
  p.has_values = outer > 0 && c > 0 && inner > 0;
  if (!p.has_values) return p;
  p.wide = inner >= 32;
  const int64_t blocks_per_split = p.wide ? c : (c + kBnTileC - 1) / kBnTileC;
  const int64_t max_splits = p.wide ? outer : (outer + kBnTileR - 1) / kBnTileR;
  p.splits = std::min(std::max<int64_t>(1, 1024 / blocks_per_split), max_splits);
  p.per = (outer + p.splits - 1) / p.splits;
  p.splits = (outer + p.per - 1) / p.per;
  return p;
}

}  // namespace tpnorm::kernels::cuda
