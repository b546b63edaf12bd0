// Host tests (no GPU needed) of SyncBatchNorm's launch plan and walks (kernels/cuda/plan.h):
// the vector width for C or spatial sizes that are not multiples of 8 and for misaligned
// pointers, the plan of the GPU benchmark's SyncBatchNorm shapes worked by hand, and the two
// walks replayed thread by thread exactly as the kernels run them (BnWalk is the kernels' own
// code): every vector of every channel visited exactly once, by a block of its own channel, no
// split empty.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/cuda/plan.h"

using namespace tpnorm::kernels::cuda;

namespace {

alignas(64) unsigned char g_mem[256];

TEST(GpuBnPlan, VectorWidthFollowsTheShapeAndThePointers) {
  // planes: vec divides inner; rows (inner 1): vec divides c.
  EXPECT_EQ(plan_channels(32, 64, 3136, 2).vec, 8);  // 56 x 56 bf16: 16-byte accesses
  EXPECT_EQ(plan_channels(32, 64, 3136, 4).vec, 4);  // fp32: 16 bytes too
  EXPECT_EQ(plan_channels(32, 64, 196, 2).vec, 4);   // 14 x 14: 196 = 4 x 49
  EXPECT_EQ(plan_channels(32, 64, 49, 2).vec, 1);    // 7 x 7: scalar
  EXPECT_EQ(plan_channels(100, 64, 1, 2).vec, 8);    // channels-last, 8 channels per thread
  EXPECT_EQ(plan_channels(100, 12, 1, 2).vec, 4);    // C = 12: 4 channels per thread
  EXPECT_EQ(plan_channels(100, 3, 1, 4).vec, 1);     // C = 3
  EXPECT_EQ(plan_channels(100, 64, 1, 4).vec, 4);    // fp32: 4 channels (16 bytes)
  // A pointer 2 bytes off a 16-byte boundary narrows a bf16 tensor to scalar accesses.
  EXPECT_EQ(plan_channels(100, 64, 1, 2, {g_mem, g_mem + 2}).vec, 1);
  EXPECT_EQ(plan_channels(100, 64, 1, 2, {g_mem, g_mem + 8}).vec, 4);
  EXPECT_EQ(plan_channels(100, 64, 1, 2, {g_mem, nullptr}).vec, 8);  // null: not read
}

// The GPU benchmark's SyncBatchNorm shapes (bench/gpu), bf16, worked by hand from plan.h.
TEST(GpuBnPlan, BenchmarkShapesByHand) {
  // NCHW 32 x 64 x 56 x 56: max splits min(ceil(2048 / 64) = 32, ceil(32 * 3136 * 64 / 8192)
  // = 784, 100352) = 32; vec 8, vpp 392, units 12544, per 392, 32 splits; 256 units a step
  // never leave a plane (dv = 256 < 392): jump 256, wrap 63 x 392.
  const BnPlan n = plan_channels(32, 64, 3136, 2);
  EXPECT_FALSE(n.rows);
  EXPECT_EQ(bn_max_splits(32, 64, 3136), 32);
  EXPECT_EQ(n.vpp, 392);
  EXPECT_EQ(n.units, 12544);
  EXPECT_EQ(n.per, 392);
  EXPECT_EQ(n.splits, 32);
  EXPECT_EQ(n.blocks_x, 64);
  EXPECT_EQ(n.dv, 256);
  EXPECT_EQ(n.jump, 256);
  EXPECT_EQ(n.wrap, 63 * 392);
  // channels-last [100352, 64, 1]: max splits min(2048 / ceil(64 / 256) = 2048, 784, 100352)
  // = 784; vec 8: 8 vector columns -> tile 8 x 32, one tile; per = ceil(100352 / 784) = 128.
  const BnPlan c = plan_channels(100352, 64, 1, 2);
  EXPECT_TRUE(c.rows);
  EXPECT_EQ(c.groups, 8);
  EXPECT_EQ(c.tile_x, 8);
  EXPECT_EQ(c.tile_y, 32);
  EXPECT_EQ(c.blocks_x, 1);
  EXPECT_EQ(c.per, 128);
  EXPECT_EQ(c.splits, 784);
}

// Every planes-walk thread of every block, as sums_planes / apply_planes run it.
void replay_planes(int64_t outer, int64_t c, int64_t inner, size_t elem) {
  const BnPlan p = plan_channels(outer, c, inner, elem, {}, inner == 1);
  ASSERT_FALSE(p.rows);
  ASSERT_EQ(p.vpp * p.vec, inner);
  ASSERT_LE(p.splits, bn_max_splits(outer, c, inner));
  std::vector<int> seen(static_cast<size_t>(outer * c * p.vpp), 0);
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t sp = 0; sp < p.splits; ++sp) {
      int64_t in_split = 0;
      for (int64_t t = 0; t < kBnThreads; ++t) {
        BnWalk w = BnWalk::start(p, c, ch, sp, t);
        for (int64_t u = sp * p.per + t; w.left > 0; u += kBnThreads, w.next(p)) {
          ASSERT_LT(u, std::min(p.units, (sp + 1) * p.per)) << "walked past its split";
          // the direct formula: unit u of channel ch is plane u / vpp, vector u % vpp
          ASSERT_EQ(w.at, (u / p.vpp * c + ch) * p.vpp + u % p.vpp)
              << outer << "x" << c << "x" << inner << " ch " << ch << " unit " << u;
          ASSERT_EQ(w.plane, u / p.vpp) << "unit " << u;
          ++seen[static_cast<size_t>(w.at)];
          ++in_split;
        }
      }
      EXPECT_GT(in_split, 0) << "an empty split";
    }
  for (size_t i = 0; i < seen.size(); ++i)
    ASSERT_EQ(seen[i], 1) << outer << "x" << c << "x" << inner << ": vector " << i;
}

TEST(GpuBnPlan, PlanesWalkVisitsEveryVectorOnce) {
  replay_planes(3, 5, 40, 4);     // vpp 10 < 256: several wraps per step
  replay_planes(2, 3, 1000, 2);   // vpp 125 with vec 8
  replay_planes(4, 2, 600, 4);    // vpp 150: one wrap per step at most
  replay_planes(1, 3, 2050, 2);   // one plane, vpp 1025 > 256: no wrap in a step
  replay_planes(9, 7, 3, 4);      // inner 3: scalar, 85 planes a step
  replay_planes(300, 1, 2, 2);    // inner 2, vpp 1: 256 planes a step
  replay_planes(40, 2, 1000, 4);  // 10 splits of 1000 units, vpp 250: jump 506
  replay_planes(37, 4, 196, 2);   // 14 x 14, vec 4
  replay_planes(700, 3, 1, 2);    // planes_only with inner 1 (GroupNorm on [n, c])
}

// Every rows-walk thread, as sums_rows / apply_rows run it: (row, vector column) exactly once.
void replay_rows(int64_t outer, int64_t c, size_t elem) {
  const BnPlan p = plan_channels(outer, c, 1, elem);
  ASSERT_TRUE(p.rows);
  ASSERT_EQ(p.groups * p.vec, c);
  ASSERT_EQ(p.tile_x * p.tile_y, kBnThreads);
  ASSERT_GE(p.blocks_x * p.tile_x, p.groups);
  ASSERT_LE(p.vec * elem, 16u);
  std::vector<int> seen(static_cast<size_t>(outer * p.groups), 0);
  for (int64_t bx = 0; bx < p.blocks_x; ++bx)
    for (int64_t sp = 0; sp < p.splits; ++sp)
      for (int ty = 0; ty < p.tile_y; ++ty)
        for (int tx = 0; tx < p.tile_x; ++tx) {
          const int64_t gi = bx * p.tile_x + tx;
          if (gi >= p.groups) continue;
          const int64_t r1 = std::min(outer, (sp + 1) * p.per), step = p.tile_y * p.groups;
          int64_t r = sp * p.per + ty, at = r * p.groups + gi;
          for (; r < r1; r += p.tile_y, at += step) {
            ASSERT_EQ(at, r * p.groups + gi);
            ++seen[static_cast<size_t>(at)];
          }
        }
  for (size_t i = 0; i < seen.size(); ++i)
    ASSERT_EQ(seen[i], 1) << outer << "x" << c << ": vector " << i;
  // The block's channel positions: tile position t is channel bx * tile_x * vec + t.
  EXPECT_GE(p.tile_x * p.vec, std::min<int64_t>(c, 32 * p.vec));
}

TEST(GpuBnPlan, RowsWalkVisitsEveryRowOnce) {
  replay_rows(1000, 3, 4);    // C = 3: scalar, tile 4 x 64
  replay_rows(513, 12, 2);    // C = 12: vec 4, 3 columns in a 4-wide tile
  replay_rows(100, 520, 2);   // 65 columns: three tiles, the last with one column
  replay_rows(70000, 64, 2);  // many splits
  replay_rows(7, 1, 4);       // one channel
}

TEST(GpuBnPlan, MaxSplitsBoundTheGrid) {
  EXPECT_EQ(bn_max_splits(0, 4, 4), 0);
  EXPECT_EQ(bn_max_splits(1, 1, 1), 1);
  EXPECT_LE(bn_max_splits(int64_t{1} << 40, 1, 1), 65535);
  EXPECT_LE(bn_max_splits(1, 1, int64_t{1} << 40), 65535);
  for (int64_t outer : {1, 5, 64, 100000})
    for (int64_t c : {1, 3, 64, 1000})
      for (int64_t inner : {1, 3, 49, 3136})
        for (size_t elem : {2u, 4u}) {
          const BnPlan p = plan_channels(outer, c, inner, elem);
          EXPECT_LE(p.splits, bn_max_splits(outer, c, inner));
          EXPECT_GE(p.splits, 1);
        }
}

}  // namespace
