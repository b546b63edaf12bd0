// Single-process SyncBatchNorm: the worked example of the seed notes, accuracy when
// |mean| >> std, the traffic of one call, and PyTorch's rules for degenerate batches.
// Tolerances: fp32 outputs 1e-5 abs + 1e-5 rel unless stated.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "batch_norm_reference.h"
#include "harness.h"
#include "tpnorm/batch_norm.h"

using namespace tpnorm;
using tpnorm_test::count_wrong;

namespace {

// 4 images of 1 channel, 2x2 pixels (the notes' numbers): mean 5.0, variance 88/16 = 5.5,
// x-hat of the value 1 = -4/sqrt(5.5) = -1.706.
TEST(BatchNormWorkedExample, FourImagesOneChannel) {
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<float> y(16), mean(1), invstd(1), rm{0.f}, rv{1.f};
  int64_t tracked = 0;
  auto comm = make_single_communicator();
  const Shape s{4, 1, 2, 2}, c{1};
  sync_batch_norm_forward(*comm, view(x.data(), s), {}, {}, view(rm.data(), c), view(rv.data(), c),
                          &tracked, view(y.data(), s), view(mean.data(), c),
                          view(invstd.data(), c));
  EXPECT_FLOAT_EQ(mean[0], 5.0f);
  EXPECT_NEAR(1.0 / (invstd[0] * invstd[0]) - 1e-5, 5.5, 1e-5);
  EXPECT_NEAR(y[0], -1.706, 5e-4);  // the notes round to 3 decimals
  EXPECT_NEAR(y[0], -4.0 / std::sqrt(5.5 + 1e-5), 1e-6);
  EXPECT_NEAR(y[15], 4.0 / std::sqrt(5.5 + 1e-5), 1e-6);
  // PyTorch: running_var uses the unbiased variance 88/15; momentum 0.1.
  EXPECT_NEAR(rm[0], 0.5, 1e-7);
  EXPECT_NEAR(rv[0], 0.9 + 0.1 * 88.0 / 15.0, 1e-6);
  EXPECT_EQ(tracked, 1);
}

// (1, 2, 3) * 1e4 + N(0,1): the default (robust) statistics keep the variance; float64 saved
// statistics keep x - mean for the outputs. Channels-last with 3 channels of different offsets.
TEST(BatchNormRobust, LargeMeanSmallStd) {
  const int64_t n = 6, c = 3, inner = 2000;  // enough values for accumulation error to show
  std::vector<float> x = tpnorm_test::normal(3, 0, n * c * inner);
  for (int64_t i = 0; i < n * c * inner; ++i)
    x[i] += 1e4f * static_cast<float>((i / inner) % c + 1);
  const auto ref = tpnorm_test::batch_norm_reference(x, n, c, inner, {}, {}, 1e-5);
  const auto xcl = tpnorm_test::to_channels_last(x, n, c, inner);
  std::vector<float> y(x.size());
  std::vector<double> mean(c), invstd(c);
  auto comm = make_single_communicator();
  BatchNormOptions opt;
  opt.layout = Layout::kChannelsLast;
  const Shape s{n, inner, c};
  sync_batch_norm_forward(*comm, view(xcl.data(), s), {}, {}, {}, {}, nullptr, view(y.data(), s),
                          {mean.data(), DType::F64, {c}}, {invstd.data(), DType::F64, {c}}, opt);
  std::vector<double> want_is(c);
  for (int64_t ch = 0; ch < c; ++ch) want_is[ch] = 1 / std::sqrt(ref.var[ch] + 1e-5);
  std::vector<float> invf(invstd.begin(), invstd.end());
  EXPECT_EQ(count_wrong("invstd", invf, want_is, 0, 1e-6), 0);
  EXPECT_EQ(count_wrong("y", tpnorm_test::from_channels_last(y, n, c, inner), ref.y, 1e-4, 1e-4),
            0);
}

// Channels-last past the last-level cache (streaming stores), 67 channels: vectors of
// consecutive channels run across row boundaries. Forward and backward against the reference.
TEST(BatchNormLarge, ChannelsLastStreamingPath) {
  const int64_t n = 64, c = 67, inner = 1024;  // 17.6 MB a tensor
  const std::vector<float> x = tpnorm_test::normal(5, 0, n * c * inner, 1.0, 2.0);
  const std::vector<float> dy = tpnorm_test::normal(5, 1, n * c * inner);
  const std::vector<float> gamma = tpnorm_test::normal(5, 2, c, 1.0, 0.3);
  const std::vector<float> beta = tpnorm_test::normal(5, 3, c);
  const auto ref = tpnorm_test::batch_norm_reference(x, n, c, inner, gamma, beta, 1e-5, dy);
  const auto xcl = tpnorm_test::to_channels_last(x, n, c, inner);
  const auto dycl = tpnorm_test::to_channels_last(dy, n, c, inner);
  std::vector<float> y(x.size()), dx(x.size()), mean(c), invstd(c), dg(c), db(c);
  auto comm = make_single_communicator();
  BatchNormOptions opt;
  opt.layout = Layout::kChannelsLast;
  const Shape s{n, inner, c}, cs{c};
  sync_batch_norm_forward(*comm, view(xcl.data(), s), view(gamma.data(), cs), view(beta.data(), cs),
                          {}, {}, nullptr, view(y.data(), s), view(mean.data(), cs),
                          view(invstd.data(), cs), opt);
  sync_batch_norm_backward(*comm, view(dycl.data(), s), view(xcl.data(), s), view(gamma.data(), cs),
                           view(mean.data(), cs), view(invstd.data(), cs), view(dx.data(), s),
                           view(dg.data(), cs), view(db.data(), cs), opt);
  EXPECT_EQ(count_wrong("y", tpnorm_test::from_channels_last(y, n, c, inner), ref.y, 1e-5, 1e-5),
            0);
  EXPECT_EQ(count_wrong("dx", tpnorm_test::from_channels_last(dx, n, c, inner), ref.dx, 1e-5, 1e-4),
            0);
  EXPECT_EQ(count_wrong("dbeta", db, ref.dbeta, 1e-5 * n * inner, 1e-5), 0);
}

// One collective per training call, with (2C + header) float64 (robust) or float32 (naive)
// values; eval sends nothing.
TEST(BatchNormTraffic, OneCollectivePerTrainingCallNoneInEval) {
  auto comm = make_single_communicator();
  comm->set_strict_calls(0);
  const int64_t n = 4, c = 5;
  std::vector<float> x = tpnorm_test::normal(1, 0, n * c * 3), y(x.size()), dx(x.size());
  std::vector<float> rm(c, 0.f), rv(c, 1.f), sm(c), si(c);
  const Shape s{n, c, 3}, cs{c};
  for (Stats mode : {Stats::kRobust, Stats::kNaive})
    for (bool training : {true, false}) {
      BatchNormOptions opt;
      opt.training = training;
      opt.stats = mode;
      const uint64_t vsize = mode == Stats::kRobust ? 8 : 4;
      comm->reset_counters();
      sync_batch_norm_forward(*comm, view(x.data(), s), {}, {}, view(rm.data(), cs),
                              view(rv.data(), cs), nullptr, view(y.data(), s), view(sm.data(), cs),
                              view(si.data(), cs), opt);
      sync_batch_norm_backward(*comm, view(x.data(), s), view(x.data(), s), {}, view(sm.data(), cs),
                               view(si.data(), cs), view(dx.data(), s), {}, {}, opt);
      EXPECT_EQ(comm->counters().calls, training ? 2u : 0u);
      EXPECT_EQ(comm->counters().bytes_sent, training ? 2u * (2 * c + 10) * vsize : 0u);
    }
}

// A training call with one value per channel is an error (as PyTorch); nothing is written.
TEST(BatchNormErrors, OneValuePerChannelInTrainingLeavesStateUntouched) {
  auto comm = make_single_communicator();
  std::vector<float> x{1.f, 2.f}, y{7.f, 7.f}, rm{3.f, 3.f}, rv{4.f, 4.f};
  int64_t tracked = 5;
  const Shape s{1, 2}, c{2};
  try {
    sync_batch_norm_forward(*comm, view(x.data(), s), {}, {}, view(rm.data(), c),
                            view(rv.data(), c), &tracked, view(y.data(), s), {}, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("more than 1 value per channel"), std::string::npos);
  }
  EXPECT_EQ(y, (std::vector<float>{7.f, 7.f}));
  EXPECT_EQ(rm, (std::vector<float>{3.f, 3.f}));
  EXPECT_EQ(rv, (std::vector<float>{4.f, 4.f}));
  EXPECT_EQ(tracked, 5);
  // Eval uses the running statistics, so one sample is fine there.
  BatchNormOptions eval;
  eval.training = false;
  sync_batch_norm_forward(*comm, view(x.data(), s), {}, {}, view(rm.data(), c), view(rv.data(), c),
                          &tracked, view(y.data(), s), {}, {}, eval);
  EXPECT_NEAR(y[0], (1 - 3) / std::sqrt(4 + 1e-5), 1e-6);
  EXPECT_EQ(tracked, 5);
}

TEST(BatchNormErrors, CumulativeMomentumNeedsTheCounter) {
  auto comm = make_single_communicator();
  std::vector<float> x(8, 1.f), y(8), rm(2), rv(2, 1.f);
  BatchNormOptions opt;
  opt.momentum = BatchNormOptions::cumulative();
  EXPECT_THROW(
      sync_batch_norm_forward(*comm, view(x.data(), {4, 2}), {}, {}, view(rm.data(), {2}),
                              view(rv.data(), {2}), nullptr, view(y.data(), {4, 2}), {}, {}, opt),
      Error);
}

// The naive mode's float32 count stops being exact at 2^24 values per channel: refused, with
// outputs untouched. (fp16 zeros keep the input at 32 MB.)
TEST(BatchNormErrors, NaiveModeRefusesCountsFrom2To24) {
  auto comm = make_single_communicator();
  const int64_t n = int64_t{1} << 24;
  std::vector<uint16_t> x(n, 0), y(n, 0x3c00);  // 0.0 and 1.0 in fp16
  BatchNormOptions opt;
  opt.stats = Stats::kNaive;
  const Shape s{n, 1};
  EXPECT_THROW(sync_batch_norm_forward(*comm, {x.data(), DType::F16, s}, {}, {}, {}, {}, nullptr,
                                       {y.data(), DType::F16, s}, {}, {}, opt),
               Error);
  EXPECT_EQ(y[0], 0x3c00);
  EXPECT_EQ(y[n - 1], 0x3c00);
  opt.stats = Stats::kRobust;  // the float64 count is exact: the same call succeeds
  sync_batch_norm_forward(*comm, {x.data(), DType::F16, s}, {}, {}, {}, {}, nullptr,
                          {y.data(), DType::F16, s}, {}, {}, opt);
  EXPECT_EQ(y[0], 0);
}

}  // namespace
