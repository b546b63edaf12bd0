// plan.h — the launch geometry of the CUDA kernels, chosen on the host from the shape and the
// pointers before anything is launched. Plain C++ (no CUDA types), so that host unit tests
// (tests/gpu/host_test_gpu_plans.cpp) check every decision here without a GPU.
//
// Row norms (kernels/cuda/row_norm.cu): see "row norms" below.
//
// SyncBatchNorm (kernels/cuda/batch_norm.cu): see the section below.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <type_traits>

#include "common/host_device.h"

namespace tpnorm::kernels::cuda {

// ---- row norms --------------------------------------------------------------------------
//
// Every row kernel walks its rows grid-stride in "row groups": a warp per row when h <= 1024,
// else the whole block per row; blocks of 256 threads either way (8 rows at a time per block
// with a warp per row). Vector width `vec` = the widest power of two that divides both
// 16 / sizeof(T) and h (flashinfer's gcd(16 / sizeof(T), h)) and to whose vec * sizeof(T)
// bytes every pointer is aligned: then every row of every operand starts aligned too (row r
// starts r * h elements in, a multiple of vec), and no row needs a scalar head or tail.
// Uneven tensor-parallel splits keep wide loads: h = 1000 in fp16 -> vec 8, h = 1030 ->
// vec 2; only odd h or a pointer off by one element falls back to vec 1. (A scalar head and
// tail per row would give odd h 16-byte loads for its body, but then a column's place in a
// thread's registers would change from row to row, and the backward keeps its dgamma / dbeta
// column sums in registers across rows.)
//
// A thread handles `per_thread` elements of a row at a time (a "chunk" of tpr * per_thread
// columns): np = per_thread / vec vector loads per operand, a compile-time count, all issued
// before the math uses any of them; the last chunk is predicated (pack i < packs). per_thread
// is 8 for rows of at most 8 elements per thread (one chunk, few idle registers), else
// min(32, 8 vec): at most 8 loads per operand (scalar rows: 8 elements; more spilled in ptxas
// -v at sm_90) and at most 32 elements, because the backward partial keeps two float column
// sums per element in registers (64) next to its x, dy and gamma packs, which 256-thread
// blocks afford (255 registers per thread at most). Rows wider than one chunk loop over chunks.
//
// Grid: the kernels are grid-stride, so any grid is correct; the launcher takes the smaller of
// `blocks` (every row group its own block) and what the device keeps resident at once (the
// occupancy query of that kernel instance x SMs, see row_grid). Block size is fixed at 256:
// enough warps per block to hide the block reduction's barriers behind the other blocks on
// the SM, and the launch bound the register budget above assumes.
//
// The backward partial with parameter gradients runs on exactly `bwd_parts` blocks (a
// function of the shape only, so dgamma / dbeta sum in the same order on every device): each
// block keeps per-column sums of dy * xhat and dy over the rows it owns and writes one
// [2, h] float slice of scratch; dgamma_final adds the slices in block order.

inline constexpr int kRowThreads = 256;
inline constexpr int kRowSmallPerThread = 8, kRowPerThread = 32, kRowMaxLoads = 8;
/// Elements per thread per chunk for rows wider than 8 per thread, at vector width vec.
inline constexpr int row_wide_per_thread(int vec) {
  return vec * kRowMaxLoads < kRowPerThread ? vec * kRowMaxLoads : kRowPerThread;
}
/// Widest row the kernels index with 32-bit in-row offsets.
inline constexpr int64_t kRowMaxWidth = int64_t{1} << 30;

struct RowPlan {
  int tpr = 32;               ///< threads per row: 32 (a warp) or kRowThreads (the block)
  int threads = kRowThreads;  ///< block size
  int64_t blocks = 0;         ///< one block per row group (0: nothing to launch)
  int vec = 1;                ///< elements per vector access (1, 2, 4, 8; at most 16 bytes)
  int per_thread = 8;         ///< elements per thread per chunk (8 or row_wide_per_thread(vec))
  int np = 8;                 ///< vector loads per thread per chunk: per_thread / vec
  int64_t packs = 0;          ///< vector packs per row: h / vec
  int64_t chunks = 1;         ///< chunks per row: ceil(packs / (tpr * np)), at least 1
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

/// Rows per launch are limited by the grid (2^31 - 1 blocks of 8 rows): far beyond any tensor
/// that fits in memory with h >= 1, but checked rather than wrapped.
inline RowPlan plan_rows(int64_t rows, int64_t h, size_t elem,
                         std::initializer_list<const void*> ptrs) {
  RowPlan p;
  p.vec = row_vector_width(h, elem, ptrs);
  p.tpr = h <= 1024 ? 32 : kRowThreads;
  p.threads = kRowThreads;
  const int64_t per_block = p.threads / p.tpr;
  p.blocks = rows > 0 ? (rows + per_block - 1) / per_block : 0;
  if (p.blocks > INT32_MAX) throw std::length_error("tpnorm: too many rows for one CUDA launch");
  if (h > kRowMaxWidth) throw std::length_error("tpnorm: rows wider than 2^30 elements on CUDA");
  const int64_t hh = std::max<int64_t>(h, 0);
  p.per_thread =
      hh <= int64_t{p.tpr} * kRowSmallPerThread ? kRowSmallPerThread : row_wide_per_thread(p.vec);
  p.np = p.per_thread / p.vec;
  p.packs = hh / p.vec;
  const int64_t step = int64_t{p.tpr} * p.np;
  p.chunks = std::max<int64_t>(1, (p.packs + step - 1) / step);
  return p;
}

/// The grid of a row kernel: every row group its own block, or fewer when the device keeps
/// fewer resident at once (`resident`: blocks per SM x SMs; <= 0: unknown, no limit).
inline int64_t row_grid(const RowPlan& p, int64_t resident) {
  return resident > 0 ? std::min(p.blocks, resident) : p.blocks;
}

/// Blocks of the backward partial when it writes dgamma / dbeta column sums: about one per
/// kBwdPartRows rows, at least kBwdMinParts (so that a mid-size call still spreads over the
/// SMs of a large GPU) and at most kBwdMaxParts (the [parts, 2, h] float scratch is written and
/// re-read once: at 16384 rows that is 1/64 of a row's bytes per block, ~3 % of dy and x in
/// bf16), and never more blocks than row groups. 0 for no rows.
inline constexpr int64_t kBwdPartRows = 32, kBwdMinParts = 128, kBwdMaxParts = 256;
/// (It never throws, unlike plan_rows: the op sizes its scratch with it before the partial,
/// where a throw would keep this rank out of the collective.)
inline int64_t row_bwd_parts(int64_t rows, int64_t h) {
  if (rows <= 0) return 0;
  const int64_t per_block = h <= 1024 ? kRowThreads / 32 : 1;  // plan_rows' row groups
  const int64_t blocks = (rows + per_block - 1) / per_block;
  const int64_t want =
      std::clamp<int64_t>((rows + kBwdPartRows - 1) / kBwdPartRows, kBwdMinParts, kBwdMaxParts);
  return std::min(blocks, want);
}

/// Device scratch of the dgamma / dbeta column sums: [row_bwd_parts, 2, h] floats.
inline size_t row_bwd_scratch_bytes(int64_t rows, int64_t h) {
  return static_cast<size_t>(row_bwd_parts(rows, h) * 2 * std::max<int64_t>(h, 0)) * sizeof(float);
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

// The gated RMSNorm (rms_norm_gated.cu). Its partials run over the (row, group) slots of the
// groups this rank holds a channel of only; its dweight sums over the rows in 2-D tiles: each
// block sums one tile of channels over one tile of rows, then one pass adds each channel's tile
// partials in tile order (deterministic, as the row norms' dgamma).
struct GatedHeld {
  int64_t first = 0, count = 0;  ///< the groups [first, first + count) this rank holds
};
inline GatedHeld gated_held(int64_t c0, int64_t c_local, int64_t group_size, int64_t groups) {
  if (c_local <= 0 || group_size <= 0 || groups <= 0) return {};
  const int64_t first = c0 / group_size, last = (c0 + c_local - 1) / group_size;
  return {first, std::min(last, groups - 1) - first + 1};
}
inline constexpr int64_t kGatedDwRows = 64;       ///< rows a dweight tile sums at the least
inline constexpr int64_t kGatedDwMaxTiles = 128;  ///< row tiles at most (the partials' scratch)
/// Row tiles of the dweight sums: enough to fill the device at a few hundred channels, each of
/// at least kGatedDwRows rows.
inline int64_t gated_dw_row_tiles(int64_t rows) {
  return std::max<int64_t>(1, std::min(kGatedDwMaxTiles, (rows + kGatedDwRows - 1) / kGatedDwRows));
}

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
  int64_t dq = 0;     ///< kBnThreads / vpp: plane step (without a wrap)
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

/// planes_only: the planes walk even when inner == 1 (GroupNorm's applies, whose constants
/// change with the plane).
inline BnPlan plan_channels(int64_t outer, int64_t c, int64_t inner, size_t elem,
                            std::initializer_list<const void*> ptrs = {},
                            bool planes_only = false) {
  BnPlan p;
  p.has_values = outer > 0 && c > 0 && inner > 0;
  if (!p.has_values) return p;
  const int64_t max_splits = bn_max_splits(outer, c, inner);
  p.rows = inner == 1 && !planes_only;
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
    p.dq = kBnThreads / p.vpp;
    p.jump = p.dq * c * p.vpp + p.dv;
    p.wrap = (c - 1) * p.vpp;
    p.blocks_x = c;
  }
  p.per = (work + max_splits - 1) / max_splits;
  p.splits = (work + p.per - 1) / p.per;
  return p;
}

/// f(std::integral_constant<int, V>{}) for a plan's vector width: the launchers' one switch
/// from the run-time width to the kernels' compile-time V. Only widths of at most 16 bytes of
/// D are instantiated (no plan picks a wider one).
template <class D, class F>
void with_vec(int vec, F&& f) {
  constexpr int kMax = static_cast<int>(16 / sizeof(D));
  if constexpr (kMax >= 8)
    if (vec == 8) return f(std::integral_constant<int, 8>{});
  if constexpr (kMax >= 4)
    if (vec == 4) return f(std::integral_constant<int, 4>{});
  if (vec == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

/// A thread's walk over its units in the planes walk: the vector index `at` (in vectors of
/// the whole tensor) of unit u = u0 + t + k * kBnThreads, kept with additions only. Shared by
/// the kernels and the host test that checks it against the direct formula.
struct BnWalk {
  int64_t at = 0;     ///< vector index of the current unit
  int64_t pos = 0;    ///< its vector position within the plane
  int64_t plane = 0;  ///< its plane (the outer index)
  int64_t left = 0;   ///< units left for this thread, the current one included

  /// Thread t of split sp of channel ch.
  TPNORM_HD static BnWalk start(const BnPlan& p, int64_t c, int64_t ch, int64_t sp, int64_t t) {
    BnWalk w;
    const int64_t u0 = sp * p.per + t;
    const int64_t u1 = p.units < (sp + 1) * p.per ? p.units : (sp + 1) * p.per;
    if (u0 >= u1) return w;
    w.left = (u1 - u0 + kBnThreads - 1) / kBnThreads;  // once per thread, not per element
    const int64_t o = u0 / p.vpp;
    w.plane = o;
    w.pos = u0 - o * p.vpp;
    w.at = (o * c + ch) * p.vpp + w.pos;
    return w;
  }
  TPNORM_HD void next(const BnPlan& p) {
    at += p.jump;
    pos += p.dv;
    plane += p.dq;
    if (pos >= p.vpp) {
      pos -= p.vpp;
      at += p.wrap;
      ++plane;
    }
    --left;
  }
};

}  // namespace tpnorm::kernels::cuda
