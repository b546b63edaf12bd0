// Host tests (no GPU needed) of the launch plans of the CUDA kernels (kernels/cuda/plan.h):
// the row kernels' vector width for uneven tensor-parallel widths (gcd(16 / sizeof(T), h),
// halved for misaligned pointers), their geometry, and SyncBatchNorm's split plan, which must
// launch nothing that reads x when the tensor has no element (a zero-size spatial dim).
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
  RowPlan p = plan_rows(5, 1024, 4, {g_mem});
  EXPECT_EQ(p.tpr, 32);
  EXPECT_EQ(p.threads, 128);
  EXPECT_EQ(p.blocks, 2);  // 4 rows per block
  p = plan_rows(4097, 1025, 2, {g_mem});
  EXPECT_EQ(p.tpr, 256);
  EXPECT_EQ(p.threads, 256);
  EXPECT_EQ(p.blocks, 4097);
  EXPECT_EQ(plan_rows(0, 64, 4, {g_mem}).blocks, 0);
  // Past 2^31 elements (2^21 + 1 rows of 1024): 64-bit rows, a grid well inside the limit.
  p = plan_rows((int64_t{1} << 21) + 1, 1024, 2, {g_mem});
  EXPECT_EQ(p.blocks, (int64_t{1} << 19) + 1);
  EXPECT_THROW(plan_rows(int64_t{1} << 40, 1, 4, {g_mem}), std::length_error);
}

TEST(GpuPlanRows, DgammaChunksCoverEveryRowOnce) {
  for (int64_t rows : {1, 7, 8, 9, 300, 4097})
    for (int64_t h : {1, 33, 1000, 8192}) {
      int64_t rpc = 0;
      const int64_t chunks = dgamma_chunks(rows, h, &rpc);
      ASSERT_GT(chunks, 0);
      EXPECT_GE(chunks * rpc, rows);
      EXPECT_LT((chunks - 1) * rpc, rows) << "an empty chunk";
      EXPECT_LE(chunks, 1024);
    }
  int64_t rpc = 5;
  EXPECT_EQ(dgamma_chunks(0, 10, &rpc), 0);
  EXPECT_EQ(rpc, 0);
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

}  // namespace
