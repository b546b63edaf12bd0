// The slice table's verdict (src/common/slice_tiling.h, src/ops/slices.cpp): the ranks' slices
// tile [0, total) exactly, in any order, empty slices anywhere; a gap or an overlap is named. The
// device kernel that marks an untiled call (kernels/cuda/call_header.cu) runs the same function.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/slice_tiling.h"
#include "ops/slices.h"

namespace {

using tpnorm::detail::slice_table_problem;

// (offset, count) by rank, as the summed table holds them.
bool tiles(const std::vector<double>& t, int64_t total) {
  return tpnorm::detail::slices_tile([&](int i) { return t[static_cast<size_t>(i)]; },
                                     static_cast<int>(t.size() / 2), total);
}

TEST(SliceTable, TilingsInAnyOrderPass) {
  EXPECT_TRUE(tiles({0, 6, 6, 6}, 12));
  EXPECT_TRUE(tiles({6, 6, 0, 6}, 12));            // reversed
  EXPECT_TRUE(tiles({0, 1, 1, 2, 3, 9}, 12));      // uneven
  EXPECT_TRUE(tiles({5, 0, 0, 12, 0, 0}, 12));     // empty slices anywhere
  EXPECT_TRUE(tiles({0, 0, 0, 0}, 0));             // nothing to hold
  EXPECT_EQ(slice_table_problem({3, 9, 0, 3}, 2, 12, "channel"), "");
}

TEST(SliceTable, OverlapsAndGapsFailAndAreNamed) {
  // Every rank at offset 0 with half the channels: the counts add up, the slices overlap.
  EXPECT_FALSE(tiles({0, 6, 0, 6}, 12));
  const std::string overlap = slice_table_problem({0, 6, 0, 6}, 2, 12, "channel");
  EXPECT_NE(overlap.find("channel 0 is held by more than one rank"), std::string::npos) << overlap;
  EXPECT_NE(overlap.find("0: [0, 6), 1: [0, 6)"), std::string::npos) << overlap;
  // A gap with the counts adding up: [0, 4) and [8, 16) of 12 lie partly outside.
  EXPECT_FALSE(tiles({0, 4, 8, 8}, 12));
  // A gap: [0, 4) and [8, 12) of 12.
  EXPECT_FALSE(tiles({0, 4, 8, 4}, 12));
  const std::string gap = slice_table_problem({0, 4, 8, 4}, 2, 12, "channel");
  EXPECT_NE(gap.find("channels [4, 8) are held by no rank"), std::string::npos) << gap;
  // Too few in all, and a negative count.
  EXPECT_FALSE(tiles({0, 4, 4, 4}, 12));
  EXPECT_FALSE(tiles({0, 14, 12, -2}, 12));
  // An overlap in the middle of three, the counts adding up: [0, 5), [4, 8), [9, 12).
  EXPECT_FALSE(tiles({0, 5, 4, 4, 9, 3}, 12));
}

}  // namespace
