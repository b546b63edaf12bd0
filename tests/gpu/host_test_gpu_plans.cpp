// Host tests (no GPU needed) of the launch plans of the CUDA kernels (kernels/cuda/plan.h):
// the row kernels' vector width for uneven tensor-parallel widths (gcd(16 / sizeof(T), h),
// halved for misaligned pointers), their geometry (loads per thread, chunks, grid, the
// backward's column-sum blocks), and SyncBatchNorm's split plan, which must launch nothing
// that reads x when the tensor has no element (a zero-size spatial dim).
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "kernels/cuda/plan.h"

using namespace tpnorm::kernels::cuda;

namespace {

// 64-byte aligned storage to derive aligned and misaligned pointers from.
alignas(64) unsigned char g_mem[256];

TEST(GpuPlanRows, VectorWidthIsGcdOfPackAndWidth) {
  struct Row {
    int64_t h;
    size_t elem;
    int want;
  };
  const Row rows[] = {
      {1024, 4, 4}, {1000, 4, 4}, {1030, 4, 2}, {1025, 4, 1}, {7, 4, 1},    {8, 4, 4},
      {1, 4, 1},    {2, 4, 2},    {1536, 4, 4}, {8192, 4, 4}, {1000, 2, 8}, {1030, 2, 2},
      {1025, 2, 1}, {1536, 2, 8}, {12, 2, 4},   {4, 2, 4},    {6, 2, 2},    {0, 2, 8},
  };
  for (const Row& r : rows)
    EXPECT_EQ(row_vector_width(r.h, r.elem, {g_mem, g_mem + 64}), r.want)
        << "h " << r.h << ", " << r.elem << "-byte elements";
}

TEST(GpuPlanRows, VectorWidthHalvesForMisalignedPointers) {
  // fp16, h = 1000 (gcd 8): a pointer 8-byte aligned allows 4, 4-byte 2, one element off 1.
  EXPECT_EQ(row_vector_width(1000, 2, {g_mem, g_mem + 8}), 4);
  EXPECT_EQ(row_vector_width(1000, 2, {g_mem + 4, g_mem}), 2);
  EXPECT_EQ(row_vector_width(1000, 2, {g_mem, g_mem + 2}), 1);
  // fp32 one element off; null pointers (absent gamma / beta) do not count.
  EXPECT_EQ(row_vector_width(1024, 4, {g_mem + 4}), 1);
  EXPECT_EQ(row_vector_width(1024, 4, {g_mem, nullptr, nullptr}), 4);
}

TEST(GpuPlanRows, EveryRowStartIsAlignedToTheChosenWidth) {
  for (size_t elem : {size_t{2}, size_t{4}})
    for (int64_t h : {1, 7, 8, 512, 1000, 1024, 1025, 1030, 1536, 2048, 8192})
      for (int off : {0, 1, 2, 4, 8}) {
        const unsigned char* p = g_mem + off * elem;
        const int v = row_vector_width(h, elem, {p});
        ASSERT_EQ(h % v, 0) << h;
        for (int64_t r = 0; r < 5; ++r)
          ASSERT_EQ(reinterpret_cast<uintptr_t>(p + r * h * elem) % (v * elem), 0u)
              << "h " << h << " elem " << elem << " offset " << off << " row " << r;
      }
}

TEST(GpuPlanRows, WarpPerRowUpTo1024ThenBlockPerRow) {
  RowPlan p = plan_rows(9, 1024, 4, {g_mem});
  EXPECT_EQ(p.tpr, 32);
  EXPECT_EQ(p.threads, 256);
  EXPECT_EQ(p.blocks, 2);  // 8 rows per block
  p = plan_rows(4097, 1025, 2, {g_mem});
  EXPECT_EQ(p.tpr, 256);
  EXPECT_EQ(p.threads, 256);
  EXPECT_EQ(p.blocks, 4097);
  EXPECT_EQ(plan_rows(0, 64, 4, {g_mem}).blocks, 0);
  // Past 2^31 elements (2^21 + 1 rows of 1024): 64-bit rows, a grid well inside the limit.
  p = plan_rows((int64_t{1} << 21) + 1, 1024, 2, {g_mem});
  EXPECT_EQ(p.blocks, (int64_t{1} << 18) + 1);
  EXPECT_THROW(plan_rows(int64_t{1} << 40, 1, 4, {g_mem}), std::length_error);
  // In-row offsets are 32-bit: wider rows are refused, not wrapped.
  EXPECT_NO_THROW(plan_rows(1, kRowMaxWidth, 2, {g_mem}));
  EXPECT_THROW(plan_rows(1, kRowMaxWidth + 1, 2, {g_mem}), std::length_error);
}

// The loads per thread (np) are the kernels' compile-time count: worked by hand per shape.
TEST(GpuPlanRows, LoadsPerThreadAndChunks) {
  struct Row {
    int64_t h;
    size_t elem;
    int tpr, vec, per_thread, np;
    int64_t packs, chunks;
  };
  const Row rows[] = {
      // h <= 8 per thread of the row: 8 elements, one chunk
      {1, 4, 32, 1, 8, 8, 1, 1},
      {40, 2, 32, 8, 8, 1, 5, 1},
      {256, 4, 32, 4, 8, 2, 64, 1},
      {1536, 2, 256, 8, 8, 1, 192, 1},  // block per row, 1536 <= 256 x 8
      {2048, 4, 256, 4, 8, 2, 512, 1},
      // wider: min(32, 8 vec) elements
      {1024, 4, 32, 4, 32, 8, 256, 1},     // fp32 1024: 8 x 16-byte loads, one chunk
      {1024, 2, 32, 8, 32, 4, 128, 1},     // bf16 1024: 4 x 16-byte loads
      {8192, 2, 256, 8, 32, 4, 1024, 1},   // bf16 8192: 4 x 16 bytes per thread
      {8192, 4, 256, 4, 32, 8, 2048, 1},   // fp32 8192: 8 x 16 bytes per thread
      {1030, 2, 256, 2, 8, 4, 515, 1},     // vec 2, 1030 <= 256 x 8: 8 elements in 4 loads
      {2050, 2, 256, 2, 16, 8, 1025, 1},   // vec 2, wider: 16 elements in 8 loads
      {1025, 4, 256, 1, 8, 8, 1025, 1},    // block per row, h <= 256 x 8: scalar, one chunk
      {541, 4, 32, 1, 8, 8, 541, 3},       // warp per row, scalar: 256 columns per chunk
      {8193, 4, 256, 1, 8, 8, 8193, 5},    // scalar: 2048 columns per chunk
      {16384, 2, 256, 8, 32, 4, 2048, 2},  // bf16 16384: two chunks of 8192
      {0, 4, 32, 4, 8, 2, 0, 1},           // no column: one (empty) chunk still runs
  };
  for (const Row& r : rows) {
    const RowPlan p = plan_rows(3, r.h, r.elem, {g_mem});
    EXPECT_EQ(p.tpr, r.tpr) << "h " << r.h;
    EXPECT_EQ(p.vec, r.vec) << "h " << r.h;
    EXPECT_EQ(p.per_thread, r.per_thread) << "h " << r.h;
    EXPECT_EQ(p.np, r.np) << "h " << r.h;
    EXPECT_EQ(p.packs, r.packs) << "h " << r.h;
    EXPECT_EQ(p.chunks, r.chunks) << "h " << r.h;
    // The chunks cover the row, the last one not empty; at most 8 loads, 32 elements.
    EXPECT_GE(p.chunks * p.tpr * p.np, p.packs) << "h " << r.h;
    if (p.packs > 0) {
      EXPECT_LT((p.chunks - 1) * p.tpr * p.np, p.packs) << "h " << r.h;
    }
    EXPECT_LE(p.np, kRowMaxLoads);
    EXPECT_LE(p.per_thread, kRowPerThread);
    EXPECT_EQ(p.np * p.vec, p.per_thread);
  }
}

TEST(GpuPlanRows, GridIsTheSmallerOfRowGroupsAndResidentBlocks) {
  const RowPlan p = plan_rows(16384, 1024, 2, {g_mem});  // 2048 blocks of 8 rows
  EXPECT_EQ(row_grid(p, 0), 2048);                       // unknown device: no limit
  EXPECT_EQ(row_grid(p, 132 * 2), 264);
  EXPECT_EQ(row_grid(p, 100000), 2048);
  EXPECT_EQ(row_grid(plan_rows(3, 8192, 2, {g_mem}), 264), 3);
}

// The backward's column-sum blocks: a function of the shape only, never more than the row
// groups, between kBwdMinParts and kBwdMaxParts otherwise; the scratch is [parts, 2, h] floats.
TEST(GpuPlanRows, BackwardColumnSumBlocks) {
  EXPECT_EQ(row_bwd_parts(0, 64), 0);
  EXPECT_EQ(row_bwd_parts(1, 1), 1);           // one row: one block
  EXPECT_EQ(row_bwd_parts(300, 40), 38);       // warp per row: 38 blocks of 8 rows < 128
  EXPECT_EQ(row_bwd_parts(4, 8192), 4);        // block per row: 4 rows, 4 blocks
  EXPECT_EQ(row_bwd_parts(2048, 1024), 128);   // 2048 / 32 = 64, raised to 128
  EXPECT_EQ(row_bwd_parts(6000, 4096), 188);   // 6000 / 32 = 187.5
  EXPECT_EQ(row_bwd_parts(16384, 8192), 256);  // capped
  EXPECT_EQ(row_bwd_parts(16384, 1024), 256);
  EXPECT_EQ(row_bwd_scratch_bytes(300, 40), size_t{38 * 2 * 40 * 4});
  EXPECT_EQ(row_bwd_scratch_bytes(0, 40), 0u);
  EXPECT_EQ(row_bwd_scratch_bytes(5, 0), 0u);
  // Sized before the partial: no throw where plan_rows refuses the row (it throws there).
  EXPECT_EQ(row_bwd_parts(3, kRowMaxWidth + 1), 3);
  for (int64_t rows : {1, 7, 8, 9, 300, 4097, 100000})
    for (int64_t h : {1, 33, 1000, 1025, 8192}) {
      const int64_t parts = row_bwd_parts(rows, h);
      EXPECT_GE(parts, 1);
      EXPECT_LE(parts, plan_rows(rows, h, 4, {}).blocks) << "a block without a row";
      EXPECT_LE(parts, kBwdMaxParts);
    }
}

// A chunked device backward (ops/cuda/row_chunks_cuda.h) adds every chunk's column sums into
// chunk 0's slices and sizes the scratch as the unchunked call's: both need the blocks never
// to shrink as rows grow (chunk 0 has the most rows, the whole call more still).
TEST(GpuPlanRows, BackwardColumnSumBlocksNeverShrinkWithRows) {
  for (int64_t h : {1, 40, 1024, 1025, 8193}) {
    int64_t prev = 0;
    for (int64_t rows = 0; rows <= 20000; ++rows) {
      const int64_t parts = row_bwd_parts(rows, h);
      ASSERT_GE(parts, prev) << "rows " << rows << " h " << h;
      prev = parts;
    }
  }
  // The test cases of gpu_mpi_test_gpu_chunked_mpi: the last chunk has fewer blocks.
  EXPECT_EQ(row_bwd_parts(64, 1025), 64);
  EXPECT_EQ(row_bwd_parts(300 - 4 * 64, 1025), 44);
  EXPECT_EQ(row_bwd_parts(1024, 40), 128);
  EXPECT_EQ(row_bwd_parts(3000 - 2 * 1024, 40), 119);
}

// [4, 8, 0, 5] is outer 4, c 8, inner 0 in NCHW and outer 0, c 5, inner 1 channels-last:
// either way there is no element and x may be null, so nothing may be launched that reads it.
TEST(GpuPlanChannels, NoElementMeansNoSumsKernelAndNoPivotRead) {
  for (auto [outer, c, inner] :
       std::vector<std::array<int64_t, 3>>{{4, 8, 0}, {0, 5, 1}, {0, 8, 0}, {0, 3, 7}, {4, 0, 5}}) {
    const BnPlan p = plan_channels(outer, c, inner, 2);
    EXPECT_EQ(p.splits, 0) << outer << "x" << c << "x" << inner;
    EXPECT_FALSE(p.has_values) << outer << "x" << c << "x" << inner;
  }
}

TEST(GpuPlanChannels, SplitsCoverTheOuterDimension) {
  for (int64_t outer : {1, 3, 8, 9, 64, 1000, 4096})
    for (int64_t c : {1, 3, 32, 33, 67, 2048})
      for (int64_t inner : {1, 5, 31, 32, 64, 4096}) {
        const BnPlan p = plan_channels(outer, c, inner, 2);
        ASSERT_TRUE(p.has_values);
        EXPECT_EQ(p.rows, inner == 1);
        ASSERT_GT(p.splits, 0);
        const int64_t work = p.rows ? outer : p.units;  // rows, or vectors of a channel
        EXPECT_GE(p.splits * p.per, work);
        EXPECT_LT((p.splits - 1) * p.per, work) << "an empty split";
        EXPECT_LE(p.splits, 65535) << "grid y limit";
      }
}

// The gated RMSNorm's partials visit only the groups a rank holds a channel of (a group may
// span ranks), and its dweight sums cut the rows into tiles of at least kGatedDwRows.
TEST(GpuPlanGated, HeldGroupsAreTheOnesTheSliceTouches) {
  // 8 groups of 4 channels; a rank holding [6, 13) touches groups 1, 2 and 3.
  GatedHeld h = gated_held(6, 7, 4, 8);
  EXPECT_EQ(h.first, 1);
  EXPECT_EQ(h.count, 3);
  h = gated_held(0, 32, 4, 8);  // every channel: every group
  EXPECT_EQ(h.first, 0);
  EXPECT_EQ(h.count, 8);
  h = gated_held(8, 4, 4, 8);  // one whole group
  EXPECT_EQ(h.first, 2);
  EXPECT_EQ(h.count, 1);
  EXPECT_EQ(gated_held(5, 0, 4, 8).count, 0);  // a rank with no channel
  EXPECT_EQ(gated_held(3, 2, 32, 1).count, 1);  // one group of all channels
}

TEST(GpuPlanGated, DweightRowTiles) {
  EXPECT_EQ(gated_dw_row_tiles(1), 1);
  EXPECT_EQ(gated_dw_row_tiles(kGatedDwRows), 1);
  EXPECT_EQ(gated_dw_row_tiles(kGatedDwRows + 1), 2);
  EXPECT_EQ(gated_dw_row_tiles(32768), kGatedDwMaxTiles);  // 32K rows: 128 tiles of 256 rows
  EXPECT_EQ(gated_dw_row_tiles(0), 1);
}

}  // namespace
