// Host tests (no GPU needed) of the kernels' byte accounting (tpnorm/cuda_traffic.h) against
// numbers worked by hand from the kernels' code for small shapes: which kernels a call
// launches, in order, and the bytes each reads and writes (each distinct byte once per
// kernel; the call header has 10 float64 values with agreement checked).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tpnorm/cuda_traffic.h"

using namespace tpnorm;

namespace {

struct Want {
  std::string kernel;
  int64_t read, written;
};

void expect_kernels(const Traffic& t, const std::vector<Want>& want) {
  ASSERT_EQ(t.kernels.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t.kernels[i].kernel, want[i].kernel) << "kernel " << i;
    EXPECT_EQ(t.kernels[i].read, want[i].read) << want[i].kernel << " reads";
    EXPECT_EQ(t.kernels[i].written, want[i].written) << want[i].kernel << " writes";
  }
}

TEST(GpuTraffic, LayerNormForwardFp32) {
  // 4 x 1024 fp32: x is 16384 B; payload 4 rows x {S1, S2} x 8 B = 64; header 80.
  RowTrafficArgs a;
  a.rows = 4;
  a.h = 1024;
  const Traffic t = row_forward_traffic(a);
  // The partial kernel writes the payload and the header (no header kernel).
  expect_kernels(t, {{"row partial_fwd", 16384, 64 + 80},
                     // x + gamma, beta (2 x 4096) + header + payload; y + mean, rstd (2 x 16)
                     {"row apply_fwd", 16384 + 8192 + 80 + 64, 16384 + 32}});
  EXPECT_EQ(t.read(), 41104);
  EXPECT_EQ(t.written(), 16560);
  EXPECT_EQ(t.total(), 57664);  // x twice + y (3 N s = 49152) + 8512 of the rest
}

TEST(GpuTraffic, RmsNormBackwardBf16WithDgamma) {
  // 16 x 100 bf16: dy, x, dx 3200 B each; gamma 200; rstd 16 x 4 = 64; payload 16 x 8 = 128.
  // The partial's column sums: row_bwd_parts(16, 100) = 2 blocks (a warp per row, 8 rows per
  // block; min(2, 128)) x 2 x 100 floats = 1600 B, written by the partial, read by the final.
  // RMSNorm has no dbeta. No column pass re-reads dy and x: 5 N s (16000) + small terms.
  RowTrafficArgs a;
  a.rows = 16;
  a.h = 100;
  a.elem = 2;
  a.centered = false;
  a.beta = false;
  const Traffic t = row_backward_traffic(a);
  expect_kernels(t, {{"row partial_bwd", 6400 + 200 + 64, 128 + 1600 + 80},
                     {"row apply_bwd", 6400 + 200 + 64 + 80 + 128, 3200},
                     {"row dgamma_final", 1600 + 80, 200}});
  EXPECT_EQ(t.read(), 15216);
  EXPECT_EQ(t.written(), 5208);
}

TEST(GpuTraffic, LayerNormBackwardLargeIsFiveNsPlusScratch) {
  // 16384 x 8192 bf16 (N s = 268435456 B): 256 column-sum blocks x 2 x 8192 floats = 16 MiB
  // of scratch, written once and read once; saved mean/rstd fp32 (2 x 65536 B); payload
  // 16384 x 2 x 8 = 262144; gamma 16384; dgamma, dbeta 16384 each.
  RowTrafficArgs a;
  a.rows = 16384;
  a.h = 8192;
  a.elem = 2;
  const Traffic t = row_backward_traffic(a);
  const int64_t ns = 268435456, part = 256 * 2 * 8192 * 4, small = 16384 + 131072;
  expect_kernels(t, {{"row partial_bwd", 2 * ns + small, 262144 + part + 80},
                     {"row apply_bwd", 2 * ns + small + 80 + 262144, ns},
                     {"row dgamma_final", part + 80, 2 * 16384}});
  EXPECT_EQ(t.total(), 5 * ns + 2 * part + 2 * small + 2 * 262144 + 3 * 80 + 2 * 16384);
  EXPECT_LT(static_cast<double>(t.total()), 5.14 * ns);  // 16 MiB x 2 is 0.125 N s
}

TEST(GpuTraffic, LayerNormBackwardWithoutParamsHasNoColumnPass) {
  RowTrafficArgs a;
  a.rows = 8;
  a.h = 64;
  a.dgamma = a.dbeta = false;
  const Traffic t = row_backward_traffic(a);
  ASSERT_EQ(t.kernels.size(), 2u);  // partial (with the header), apply
  // dy and x read twice, dx written once: 5 N s with N s = 2048, plus mean/rstd, gamma, stats.
  EXPECT_EQ(t.total(), 5 * 2048 + 2 * (256 + 64) + 128 + 80 + 80 + 128);
}

TEST(GpuTraffic, SyncBatchNormForwardNchwFp32) {
  // [2, 3, 40] fp32: x 960 B; plan: planes, vec 4, one split (240 elements < 8192) ->
  // partials 1 x 2 x 3 floats = 24 B; pivots 3 floats = 12 B (written by the sums kernel, read
  // by combine); payload 3 x {S1, S2} x 8 = 48.
  BnTrafficArgs a;
  a.outer = 2;
  a.c = 3;
  a.inner = 40;
  const Traffic t = bn_forward_traffic(a);
  expect_kernels(t, {{"bn sums_planes", 960, 24 + 12},
                     {"bn combine", 24 + 12, 48},
                     {"call header", 0, 80},
                     // header + payload + gamma, beta (24) + running (24); consts 48 +
                     // saved 24 + running 24
                     {"bn fwd_consts", 80 + 48 + 24 + 24, 48 + 24 + 24},
                     {"bn apply_fwd", 960 + 48 + 80, 960}});
  EXPECT_EQ(t.read(), 2260);
  EXPECT_EQ(t.written(), 1220);
}

TEST(GpuTraffic, SyncBatchNormBackwardChannelsLastBf16) {
  // n = 2, 3 x 5 spatial, 4 channels, channels-last: [30, 4, 1]; dy, x, dx 240 B each; plan:
  // rows, vec 4, one split -> partials 1 x 2 x 4 floats = 32 B; mean/invstd 16 B each.
  BnTrafficArgs a;
  a.outer = 30;
  a.c = 4;
  a.inner = 1;
  a.channels_last = true;
  a.elem = 2;
  const Traffic t = bn_backward_traffic(a);
  expect_kernels(t, {{"bn sums_rows", 480 + 16, 32},
                     {"bn combine", 32, 64 + 64},
                     {"call header", 0, 80},
                     {"bn bwd_consts", 80 + 64 + 8 + 32, 80},
                     {"bn apply_bwd", 480 + 80 + 80, 240},
                     {"bn param_grads", 80 + 64 + 16, 16}});
  EXPECT_EQ(t.read(), 1512);
  EXPECT_EQ(t.written(), 576);
}

TEST(GpuTraffic, SyncBatchNormBenchmarkShapeSplits) {
  // 32 x 64 x 56 x 56 bf16 NCHW: 32 splits (plan.h; host_test_gpu_bn_plan works it out), so
  // 32 x 2 x 64 floats of partials = 16384 B; x = 12845056 B; 3 N s + small terms.
  BnTrafficArgs a;
  a.outer = 32;
  a.c = 64;
  a.inner = 56 * 56;
  a.elem = 2;
  const Traffic t = bn_forward_traffic(a);
  ASSERT_EQ(t.kernels.size(), 5u);
  EXPECT_EQ(t.kernels[0].written, 16384 + 256);
  EXPECT_EQ(t.kernels[1].read, 16384 + 256);
  const int64_t ns = 12845056;
  EXPECT_EQ(t.total() - 3 * ns, (16384 + 256) * 2 + 1024 + 80 + (80 + 1024 + 256 + 512) +
                                    (1024 + 512 + 512) + (1024 + 80));
}

TEST(GpuTraffic, SyncBatchNormEvalMovesTwoNs) {
  // [2, 3, 40]: forward from running statistics (fp32: x 960 B), no sums, no header.
  BnTrafficArgs a;
  a.outer = 2;
  a.c = 3;
  a.inner = 40;
  a.training = false;
  expect_kernels(bn_forward_traffic(a),
                 {{"bn fwd_consts", 24 + 24, 48 + 24}, {"bn apply_fwd", 960 + 48, 960}});
  // bf16 backward without parameter gradients: no partial pass, dx from dy alone (480 B each).
  a.elem = 2;
  a.dgamma = a.dbeta = false;
  expect_kernels(bn_backward_traffic(a),
                 {{"bn bwd_consts", 6 + 24, 60}, {"bn apply_bwd", 480 + 60, 480}});
  // with dbeta: the sums for this rank's local sums, no payload, no header.
  a.dbeta = true;
  expect_kernels(bn_backward_traffic(a), {{"bn sums_planes", 960 + 12, 24},
                                          {"bn combine", 24, 48},
                                          {"bn bwd_consts", 6 + 24, 60},
                                          {"bn apply_bwd", 480 + 60, 480},
                                          {"bn param_grads", 24, 6}});
}

TEST(GpuTraffic, EmptyShapesLaunchOnlyTheHeader) {
  RowTrafficArgs r;
  r.rows = 0;
  r.h = 16;
  r.dgamma = r.dbeta = false;
  ASSERT_EQ(row_forward_traffic(r).kernels.size(), 1u);  // no partial: the header kernel
  EXPECT_EQ(std::string(row_forward_traffic(r).kernels[0].kernel), "call header");
  EXPECT_EQ(row_backward_traffic(r).total(), 80);
  BnTrafficArgs b;
  b.outer = 4;
  b.c = 8;
  b.inner = 0;  // a zero-size spatial dim: no sums kernel, no apply
  const Traffic t = bn_forward_traffic(b);
  for (const KernelBytes& k : t.kernels) {
    EXPECT_NE(std::string(k.kernel), "bn sums_planes");
    EXPECT_NE(std::string(k.kernel), "bn apply_fwd");
  }
}

// ---- composite calls: the kernels they add, worked by hand; the row kernels they reuse must
// be exactly the row accounting's (whatever it says), in the right place.

void expect_same(const std::vector<KernelBytes>& got, size_t from,
                 const std::vector<KernelBytes>& want) {
  ASSERT_GE(got.size(), from + want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(std::string(got[from + i].kernel), want[i].kernel) << "kernel " << from + i;
    EXPECT_EQ(got[from + i].read, want[i].read) << want[i].kernel;
    EXPECT_EQ(got[from + i].written, want[i].written) << want[i].kernel;
  }
}

TEST(GpuTraffic, FusedResidualAddsOnePassEachWay) {
  // 4 x 1024 fp32: N s = 16384. Forward: residual add reads x and f, writes h (3 N s more).
  RowTrafficArgs a;
  a.rows = 4;
  a.h = 1024;
  const Traffic f = fused_forward_traffic(a), row = row_forward_traffic(a);
  ASSERT_EQ(f.kernels.size(), row.kernels.size() + 1);
  EXPECT_EQ(std::string(f.kernels[0].kernel), "residual add");
  EXPECT_EQ(f.kernels[0].read, 2 * 16384);
  EXPECT_EQ(f.kernels[0].written, 16384);
  expect_same(f.kernels, 1, row.kernels);
  EXPECT_EQ(f.total(), row.total() + 3 * 16384);
  // 16 x 100 bf16 backward (N s = 3200): the epilogue reads df (+ dh_extra), writes df and dx.
  a.rows = 16;
  a.h = 100;
  a.elem = 2;
  const Traffic rb = row_backward_traffic(a);
  for (bool extra : {true, false}) {
    const Traffic b = fused_backward_traffic(a, extra);
    ASSERT_EQ(b.kernels.size(), rb.kernels.size() + 1);
    expect_same(b.kernels, 0, rb.kernels);
    EXPECT_EQ(std::string(b.kernels.back().kernel), "residual epilogue");
    EXPECT_EQ(b.kernels.back().read, extra ? 6400 : 3200);
    EXPECT_EQ(b.kernels.back().written, 6400);
  }
  a.rows = 0;  // nothing to add
  EXPECT_EQ(fused_forward_traffic(a).total(), row_forward_traffic(a).total());
}

TEST(GpuTraffic, BatchedSharesOneHeaderAndWritesTheCounts) {
  // Two items, float64 wire: "write values" writes K = 2 counts (16 B), every partial, ONE
  // header (80 B, by the header kernel: a single call's partial writes its own header, a
  // batched item's does not), every apply: the single calls' sum less one header plus the
  // counts.
  RowTrafficArgs a, b;
  a.rows = 2;
  a.h = 8;
  b.rows = 3;
  b.h = 16;
  b.elem = 2;
  b.centered = false;
  b.beta = false;
  for (bool forward : {true, false}) {
    const auto row = forward ? row_forward_traffic : row_backward_traffic;
    const Traffic t = forward ? batched_forward_traffic({a, b}) : batched_backward_traffic({a, b});
    const Traffic ta = row(a), tb = row(b);
    // each single call: partial (+ header), apply(s); batched: counts, partials, header, applies
    ASSERT_EQ(t.kernels.size(), ta.kernels.size() + tb.kernels.size() + 2);
    EXPECT_EQ(std::string(t.kernels[0].kernel), "write values");
    EXPECT_EQ(t.kernels[0].written, 16);
    EXPECT_EQ(t.total(), ta.total() + tb.total() - 80 + 16);
    // partials of a then b (without the header's 80 B), one header, applies of a then b
    std::vector<KernelBytes> want;
    for (bool after : {false, true}) {
      for (const Traffic* r : {&ta, &tb}) {
        ASSERT_EQ(std::string(r->kernels[0].kernel).find("partial"), 4u);  // "row partial_*"
        if (!after)
          want.push_back({r->kernels[0].kernel, r->kernels[0].read, r->kernels[0].written - 80});
        if (after) want.insert(want.end(), r->kernels.begin() + 1, r->kernels.end());
      }
      if (!after) want.push_back({"call header", 0, 80});
    }
    expect_same(t.kernels, 1, want);
  }
  EXPECT_TRUE(batched_forward_traffic({}).kernels.empty());
}

// n = 2, 3 local channels of 8 (c0 = 2), groups of cpg = 2 (4 groups), spatial 10: local
// channels 2, 3, 4 touch groups 1 and 2 -> 4 of the 8 (sample, group) slots; 6 planes.
GroupTrafficArgs group_case(int64_t elem) {
  GroupTrafficArgs g;
  g.n = 2;
  g.c_local = 3;
  g.spatial = 10;
  g.c0 = 2;
  g.groups = 4;
  g.cpg = 2;
  g.elem = elem;
  return g;
}
RowTrafficArgs planes_of(const GroupTrafficArgs& g) {
  RowTrafficArgs r;
  r.rows = 6;
  r.h = 10;
  r.elem = g.elem;
  r.gamma = r.beta = r.dgamma = r.dbeta = false;
  return r;
}

TEST(GpuTraffic, GroupNormForwardFp32) {
  // x 240 B; plane sums 6 x 2 x 8 = 96; payload 8 slots x 2 x 8 = 128; slot constants a
  // float4 each (8 x 16); saved mean, rstd 8 x 4 each; gamma, beta 3 x 4 each; the apply reads
  // 4 slots' constants.
  const GroupTrafficArgs g = group_case(4);
  const Traffic t = group_forward_traffic(g);
  const Traffic rows = row_forward_traffic(planes_of(g));
  // row partial_fwd over the planes, without the header a single row call's partial writes
  expect_same(t.kernels, 0, {{"row partial_fwd", rows.kernels[0].read, 96}});
  EXPECT_EQ(rows.kernels[0].written, 96 + 80);
  expect_kernels(Traffic{std::vector<KernelBytes>(t.kernels.begin() + 1, t.kernels.end())},
                 {{"group fold", 96, 128},
                  {"call header", 0, 80},
                  {"group slot_stats", 80 + 128, 128 + 64},
                  {"group apply_fwd", 240 + 24 + 64 + 80, 240}});
}

TEST(GpuTraffic, GroupNormBackwardBf16) {
  // dy, x, dx 120 B each; saved mean, rstd 4 B a slot (4 slots read by expand), 4 B a plane
  // expanded; gamma 3 x 2; plane sums 96; payload 128; dparams 2 x 3 x 8 = 48; slot constants
  // two float4 a slot (8 x 32), 4 slots read by the apply.
  const GroupTrafficArgs g = group_case(2);
  const Traffic t = group_backward_traffic(g);
  const Traffic rows = row_backward_traffic(planes_of(g));
  expect_kernels(Traffic{{t.kernels[0]}}, {{"group expand", 32, 48}});
  // row partial_bwd over the planes, without the header a single row call's partial writes
  expect_same(t.kernels, 1,
              {{"row partial_bwd", rows.kernels[0].read, rows.kernels[0].written - 80}});
  expect_kernels(Traffic{std::vector<KernelBytes>(t.kernels.begin() + 2, t.kernels.end())},
                 {{"group fold", 96 + 6, 128},
                  {"group channel_sums", 96, 48},
                  {"call header", 0, 80},
                  // all 8 slots' constants (2 float4) from mean, rstd and the payload
                  {"group bwd_consts", 80 + 64 + 128, 256},
                  {"group apply_bwd", 240 + 6 + 4 * 32 + 80, 120},
                  {"group param_grads", 80 + 48, 12}});
}

}  // namespace
