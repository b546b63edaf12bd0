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
// SyncBatchNorm (kernels/cuda/batch_norm.cu): see the section below.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>

#include "common/host_device.h"

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
//
// Both layouts are [outer, c, inner]. Two walks, both in 256-thread blocks that own ONE channel
// or one tile of channels, so the per-channel constants (pivot, mean, scale, ...) sit in
// registers and no element's channel is ever computed by a division:
//
// planes (inner > 1, NCHW): grid (c, splits). A channel's values are `outer` planes of `inner`
//   contiguous elements, cut into vectors of `vec` elements (vec divides inner, so every plane
//   and every vector is aligned); the channel's outer * vpp vectors ("units", vpp = inner / vec)
//   are split into `splits` contiguous ranges of `per` units, one block each. Thread t walks the
//   units t, t + 256, ... of its range with running counters (BnWalk): the next unit's vector
//   index is the current one + `jump`, + `wrap` more when the plane position passes vpp.
// rows (inner == 1: channels-last [n * spatial, c], or [n, c]): grid (tiles, splits). Each
//   thread owns `vec` consecutive channels (one access of up to 16 bytes: 8 channels of a
//   16-bit type, 4 of fp32) of `tile_x` vector columns x `tile_y` rows of a block; a split is
//   `per` consecutive rows, the thread reads rows ty, ty + tile_y, ...
//
// vec is the widest of 16 / elem, 8, 4, 2, 1 that divides inner (planes) or c (rows) and to
// whose bytes every pointer is aligned; a shape or pointer that allows none gets vec = 1 (scalar
// accesses, still kBnLoads of them in flight per thread). The number of splits depends on the
// shape only (bn_max_splits), so the scratch of the per-split partial sums can be sized before
// the pointers are known; a plan may use fewer.
// A tensor without elements (a zero dim anywhere, e.g. a zero-size spatial dim [4, 8, 0, 5])
// gets splits = 0: no kernel reads x, whose pointer may be null.

inline constexpr int kBnThreads = 256;  ///< every SyncBatchNorm element kernel's block
inline constexpr int kBnLoads = 4;      ///< independent accesses in flight per thread and tensor
inline constexpr int64_t kBnMinElemsPerBlock = 8192, kBnTargetBlocks = 2048;

/// An upper bound on a plan's splits, from the shape alone: about kBnTargetBlocks blocks, each
/// with at least kBnMinElemsPerBlock elements, at most 65535 (the grid's y limit).
inline int64_t bn_max_splits(int64_t outer, int64_t c, int64_t inner) {
  if (outer <= 0 || c <= 0 || inner <= 0) return 0;
  const int64_t per_channel = outer * inner;  // elements of one channel
  // planes: c blocks per split; rows: at least ceil(c / 256) tiles per split (256 = 32 vector
  // columns of at most 8 channels)
  const int64_t per_split = inner > 1 ? c : (c + 255) / 256;
  int64_t s = (kBnTargetBlocks + per_split - 1) / per_split;
  s = std::min(s, (per_channel * c + kBnMinElemsPerBlock - 1) / kBnMinElemsPerBlock);
  s = std::min(s, inner > 1 ? per_channel : outer);  // at least one unit / row per split
  return std::clamp<int64_t>(s, 1, 65535);
}

struct BnPlan {
  bool has_values = false;  ///< this rank holds elements: only then is x read (the pivot)
  bool rows = false;        ///< the rows walk (inner == 1), else planes
  int vec = 1;              ///< elements per access
  int64_t splits = 0;       ///< grid y; 0: no element kernel at all (no element)
  int64_t per = 0;          ///< units (planes) or rows (rows) per split
  int64_t blocks_x = 0;     ///< grid x: c (planes) or channel tiles (rows)
  // planes
  int64_t vpp = 0;    ///< vectors per plane (inner / vec)
  int64_t units = 0;  ///< vectors per channel (outer * vpp)
  int64_t dv = 0;     ///< kBnThreads % vpp: plane position step
  int64_t jump = 0;   ///< vector-index step for kBnThreads units without a wrap
  int64_t wrap = 0;   ///< the extra step when the plane position wraps
  // rows
  int64_t groups = 0;  ///< vectors per row (c / vec)
  int tile_x = 0, tile_y = 0;
};

/// The widest access of at most 16 bytes that divides n elements and every pointer's alignment.
inline int bn_vector_width(int64_t n, size_t elem, std::initializer_list<const void*> ptrs) {
  return row_vector_width(n, elem, ptrs);
}

inline BnPlan plan_channels(int64_t outer, int64_t c, int64_t inner, size_t elem,
                            std::initializer_list<const void*> ptrs = {}) {
  BnPlan p;
  p.has_values = outer > 0 && c > 0 && inner > 0;
  if (!p.has_values) return p;
  const int64_t max_splits = bn_max_splits(outer, c, inner);
  p.rows = inner == 1;
  p.vec = bn_vector_width(p.rows ? c : inner, elem, ptrs);
  const int64_t work = p.rows ? outer : outer * (inner / p.vec);
  if (p.rows) {
    p.groups = c / p.vec;
    int tx = 1;
    while (tx < 32 && tx < p.groups) tx *= 2;
    p.tile_x = tx;
    p.tile_y = kBnThreads / tx;
    p.blocks_x = (p.groups + tx - 1) / tx;
  } else {
    p.vpp = inner / p.vec;
    p.units = work;
    p.dv = kBnThreads % p.vpp;
    p.jump = (kBnThreads / p.vpp) * c * p.vpp + p.dv;
    p.wrap = (c - 1) * p.vpp;
    p.blocks_x = c;
  }
  p.per = (work + max_splits - 1) / max_splits;
  p.splits = (work + p.per - 1) / p.per;
  return p;
}

/// A thread's walk over its units in the planes walk: the vector index `at` (in vectors of
/// the whole tensor) of unit u = u0 + t + k * kBnThreads, kept with additions only. Shared by
/// the kernels and the host test that checks it against the direct formula.
struct BnWalk {
  int64_t at = 0;    ///< vector index of the current unit
  int64_t pos = 0;   ///< its vector position within the plane
  int64_t left = 0;  ///< units left for this thread, the current one included

  /// Thread t of split sp of channel ch.
  TPNORM_HD static BnWalk start(const BnPlan& p, int64_t c, int64_t ch, int64_t sp, int64_t t) {
    BnWalk w;
    const int64_t u0 = sp * p.per + t;
    const int64_t u1 = p.units < (sp + 1) * p.per ? p.units : (sp + 1) * p.per;
    if (u0 >= u1) return w;
    w.left = (u1 - u0 + kBnThreads - 1) / kBnThreads;  // once per thread, not per element
    const int64_t o = u0 / p.vpp;
    w.pos = u0 - o * p.vpp;
    w.at = (o * c + ch) * p.vpp + w.pos;
    return w;
  }
  TPNORM_HD void next(const BnPlan& p) {
    at += p.jump;
    pos += p.dv;
    if (pos >= p.vpp) {
      pos -= p.vpp;
      at += p.wrap;
    }
    --left;
  }
};

}  // namespace tpnorm::kernels::cuda
