// The chunk rule (src/ops/chunking.h): when a call is cut into row chunks, how many, and how
// TPNORM_CHUNK's values are read. Pure arithmetic, no communication.
#include <gtest/gtest.h>

#include "ops/chunking.h"

namespace ck = tpnorm::detail::chunking;

namespace {

ck::Rule rule() {
  ck::Rule r;
  r.chunk_bytes = 4 << 20;
  r.min_chunks = 4;
  r.max_chunks = 64;
  r.align_rows = 16;
  return r;
}

ck::Shape shape(int64_t rows, int64_t cols_per_rank, int ranks, int64_t reread) {
  return {rows, cols_per_rank * ranks, ranks, reread};
}

TEST(ChunkRule, ParsesTheEnvironment) {
  EXPECT_EQ(ck::parse(nullptr).mode, ck::Mode::kAuto);
  EXPECT_EQ(ck::parse("").mode, ck::Mode::kAuto);
  EXPECT_EQ(ck::parse("auto").mode, ck::Mode::kAuto);
  EXPECT_EQ(ck::parse("off").mode, ck::Mode::kOff);
  EXPECT_EQ(ck::parse("0").mode, ck::Mode::kOff);
  EXPECT_EQ(ck::parse("on").mode, ck::Mode::kOn);
  EXPECT_EQ(ck::parse("on").rows, 0);
  EXPECT_EQ(ck::parse("48").mode, ck::Mode::kOn);
  EXPECT_EQ(ck::parse("48").rows, 48);
  EXPECT_EQ(ck::parse("-3").mode, ck::Mode::kAuto);
  EXPECT_EQ(ck::parse("12x").mode, ck::Mode::kAuto);
}

TEST(ChunkRule, SmallCallsAndOneRankAreNeverChunked) {
  const ck::Request a;
  // 16 MiB of re-read input per rank = 4 chunks of 4 MiB: the threshold.
  EXPECT_EQ(ck::plan(shape(1024, 4095, 2, 4), rule(), a).chunks, 1);
  EXPECT_GT(ck::plan(shape(1024, 4096, 2, 4), rule(), a).chunks, 1);
  // Decode-sized calls, and any call at one rank.
  EXPECT_EQ(ck::plan(shape(8, 8192, 2, 4), rule(), a).chunks, 1);
  EXPECT_EQ(ck::plan(shape(16384, 4096, 1, 4), rule(), a).chunks, 1);
  // One row, or off.
  EXPECT_EQ(ck::plan(shape(1, 1 << 24, 2, 4), rule(), {ck::Mode::kOn, 0}).chunks, 1);
  EXPECT_EQ(ck::plan(shape(16384, 4096, 2, 8), rule(), {ck::Mode::kOff, 0}).chunks, 1);
}

TEST(ChunkRule, ChunksAreAlignedBoundedAndCoverTheRows) {
  const ck::Request a;
  // 4096 x 2048 float32 per rank forward: 32 MiB -> 8 chunks of 512 rows.
  ck::Plan p = ck::plan(shape(4096, 2048, 2, 4), rule(), a);
  EXPECT_EQ(p.chunks, 8);
  EXPECT_EQ(p.chunk_rows, 512);
  // Backward (x and dy): 64 MiB -> 16 chunks.
  EXPECT_EQ(ck::plan(shape(4096, 2048, 2, 8), rule(), a).chunks, 16);
  // 16384 x 4096 backward: 512 MiB would be 128 chunks; at most 64.
  p = ck::plan(shape(16384, 4096, 2, 8), rule(), a);
  EXPECT_EQ(p.chunks, 64);
  EXPECT_EQ(p.chunk_rows, 256);
  // Uneven rows: aligned chunk rows, the last chunk shorter, every row covered once.
  p = ck::plan(shape(1000, 8192, 4, 8), rule(), a);
  EXPECT_EQ(p.chunk_rows % 16, 0);
  EXPECT_EQ(p.end(p.chunks - 1, 1000), 1000);
  EXPECT_LT(p.begin(p.chunks - 1), 1000);
  EXPECT_GE(p.begin(p.chunks - 1) + p.chunk_rows, 1000);
  // Too few rows for aligned chunks: auto keeps one chunk.
  EXPECT_EQ(ck::plan(shape(10, 1 << 22, 2, 4), rule(), a).chunks, 1);
}

TEST(ChunkRule, ColumnsAreTheGlobalCountSpreadOverTheRanks) {
  // A rank with no column plans from the global count like the others: the same plan whether
  // the 8192 columns sit 4096 + 4096 or 8192 + 0.
  const ck::Shape even{4096, 8192, 2, 4};
  EXPECT_EQ(ck::plan(even, rule(), {}).chunks, ck::plan(even, rule(), {}).chunks);
  EXPECT_EQ(ck::plan(even, rule(), {}).chunks, 16);
}

TEST(ChunkRule, ForcedChunks) {
  // A number: chunks of that many rows, the last one shorter.
  ck::Plan p = ck::plan(shape(37, 5, 3, 4), rule(), {ck::Mode::kOn, 16});
  EXPECT_EQ(p.chunks, 3);
  EXPECT_EQ(p.end(2, 37) - p.begin(2), 5);
  EXPECT_EQ(ck::plan(shape(10, 5, 2, 4), rule(), {ck::Mode::kOn, 64}).chunks, 1);
  // "on": the rule's chunks, at least two, even for a small call or at one rank.
  EXPECT_EQ(ck::plan(shape(64, 8, 1, 4), rule(), {ck::Mode::kOn, 0}).chunks, 2);
  EXPECT_EQ(ck::plan(shape(2, 8, 2, 4), rule(), {ck::Mode::kOn, 0}).chunks, 2);
  EXPECT_EQ(ck::plan(shape(4096, 2048, 2, 4), rule(), {ck::Mode::kOn, 0}).chunks, 8);
}

TEST(ChunkRule, HostRuleIsHalfAnL2AndAutoChunksLargeCalls) {
  // 1 MiB L2 per core: chunks of 512 KiB of re-read input; a 512 KiB L2 keeps whole-L2 chunks;
  // never below 256 KiB; 2 MiB: 1 MiB.
  const ck::Rule host = ck::host_rule(1 << 20);
  EXPECT_EQ(host.chunk_bytes, 512 << 10);
  EXPECT_EQ(host.min_chunks, 8);
  EXPECT_EQ(ck::host_rule(512 << 10).chunk_bytes, 512 << 10);
  EXPECT_EQ(ck::host_rule(512 << 10).min_chunks, 4);
  EXPECT_EQ(ck::host_rule(0).chunk_bytes, 256 << 10);
  EXPECT_EQ(ck::host_rule(2 << 20).chunk_bytes, 1 << 20);
  EXPECT_TRUE(host.auto_chunks);
  // 4096 x 2048 float32 per rank at 2 ranks: forward 64 chunks of 64 rows (512 KiB of x),
  // backward 128 of 32 rows (x and dy).
  ck::Plan p = ck::plan(shape(4096, 2048, 2, 4), host, {});
  EXPECT_EQ(p.chunks, 64);
  EXPECT_EQ(p.chunk_rows, 64);
  p = ck::plan(shape(4096, 2048, 2, 8), host, {});
  EXPECT_EQ(p.chunks, 128);
  EXPECT_EQ(p.chunk_rows, 32);
  // 16384 x 4096 backward: 512 MiB per rank = 1024 chunks of 16 rows (at most 1024).
  EXPECT_EQ(ck::plan(shape(16384, 4096, 2, 8), host, {}).chunks, 1024);
  EXPECT_EQ(ck::plan(shape(32768, 4096, 2, 8), host, {}).chunks, 1024);
  // Below 4 L2s (4 MiB) of re-read input per rank, and at one rank: one collective.
  EXPECT_EQ(ck::plan(shape(511, 2048, 2, 4), host, {}).chunks, 1);
  EXPECT_GT(ck::plan(shape(512, 2048, 2, 4), host, {}).chunks, 1);
  EXPECT_EQ(ck::plan(shape(16384, 4096, 1, 8), host, {}).chunks, 1);
  // "on": the same chunks.
  EXPECT_EQ(ck::plan(shape(4096, 2048, 2, 4), host, {ck::Mode::kOn, 0}).chunks, 64);
}

}  // namespace
