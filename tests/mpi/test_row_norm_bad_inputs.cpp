// Bad and edge-case inputs of the row norms at 2, 3 and 4 ranks. Errors: the same
// tpnorm::Error on every rank, naming op, argument or field, and ranks, with every output
// (y, saved mean/rstd, dx, dgamma, dbeta) untouched. Valid edge cases (empty shards, every rank
// empty, NaN/Inf in x, zero-variance rows) run and match the float64 reference element-wise.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "expect_error.h"
#include "harness.h"
#include "mpi_world.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr float kSentinel = -7.f;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// One rank's buffers for a forward + backward over [R, h], outputs filled with kSentinel.
struct Bufs {
  int64_t R, h;
  DType dt;
  Buffer x, dy, gamma, beta, y, dx, dgamma, dbeta, mean, rstd;
  Bufs(int64_t rows, int64_t cols, DType t = DType::F32)
      : R(rows),
        h(cols),
        dt(t),
        x(t, normal(9, world_rank(), R * h)),
        dy(t, normal(10, world_rank(), R * h)),
        gamma(t, normal(11, world_rank(), h, 1.0, 0.3)),
        beta(t, normal(12, world_rank(), h)),
        y(t, filled(R * h)),
        dx(t, filled(R * h)),
        dgamma(t, filled(h)),
        dbeta(t, filled(h)),
        mean(DType::F32, filled(R)),
        rstd(DType::F32, filled(R)) {}
  static std::vector<float> filled(int64_t n) { return std::vector<float>(n, kSentinel); }
  Shape s() const { return {R, h}; }
  std::vector<std::vector<float>> outputs() const {
    return {y.floats(), dx.floats(), dgamma.floats(), dbeta.floats(), mean.floats(), rstd.floats()};
  }
  bool untouched() const {
    for (const auto& o : outputs())
      for (float v : o)
        if (v != kSentinel) return false;
    return true;
  }
  void forward(Communicator& c, const NormOptions& o = {}) {
    layer_norm_forward(c, x.view(s()), gamma.view({h}), beta.view({h}), y.view(s()), mean.view({R}),
                       rstd.view({R}), o);
  }
  void backward(Communicator& c, const NormOptions& o = {}) {
    layer_norm_backward(c, dy.view(s()), x.view(s()), gamma.view({h}), mean.view({R}),
                        rstd.view({R}), dx.view(s()), dgamma.view({h}), dbeta.view({h}), o);
  }
};

// Every failure must hold in every agreement mode (mpi_world.h): strict with the header in the
// call's one size-checked sum, strict with the header first, and folded.
const int64_t kModes[] = {-1, kHeaderFirst, 0};

std::unique_ptr<Communicator> world(int64_t mode) { return mpi_world(mode); }

bool has(const std::string& msg, const std::string& part) {
  return msg.find(part) != std::string::npos;
}

TEST(RowNormBadInputs, EpsZeroNanOrInfFailsEveryRankNamingTheRank) {
  const int last = world_size() - 1;
  for (int64_t strict : kModes) {
    for (double eps : {0.0, -1e-5, kNaN, kInf, -kInf}) {
      auto c = world(strict);
      Bufs b(5, 3);
      NormOptions o;
      if (world_rank() == last) o.eps = eps;
      const std::string msg = error_of([&] { b.forward(*c, o); }, ErrorCode::kInvalidArgument);
      EXPECT_TRUE(has(msg, "layer_norm_forward failed: rank " + std::to_string(last) +
                               ": argument 'eps' must be finite and > 0"))
          << msg;
      EXPECT_TRUE(b.untouched());
    }
  }
}

TEST(RowNormBadInputs, DtypeDifferingAcrossRanksIsAMismatch) {
  for (int64_t strict : kModes) {
    auto c = world(strict);
    Bufs b(4, 5, world_rank() == 0 ? DType::BF16 : DType::F32);
    const std::string msg = error_of([&] { b.forward(*c); }, ErrorCode::kMismatch);
    EXPECT_TRUE(has(msg, "layer_norm_forward: ranks disagree on 'dtype'")) << msg;
    EXPECT_TRUE(has(msg, "rank 0")) << msg;
    EXPECT_TRUE(b.untouched());
  }
}

TEST(RowNormBadInputs, EpsDifferingAcrossRanksNamesTheOddRank) {
  for (int64_t strict : kModes) {
    auto c = world(strict);
    Bufs b(4, 5);
    NormOptions o;
    const int odd = world_size() - 1;
    if (world_rank() == odd) o.eps = 1e-3;
    const std::string msg = error_of([&] { b.forward(*c, o); }, ErrorCode::kMismatch);
    EXPECT_TRUE(has(msg, "disagree on 'eps'")) << msg;
    if (world_size() > 2) {
      EXPECT_TRUE(has(msg, "differing from the majority: rank " + std::to_string(odd))) << msg;
    }
    EXPECT_TRUE(b.untouched());
  }
}

TEST(RowNormBadInputs, RowsDifferingInTheBackwardIsAMismatch) {
  auto c = world(-1);  // payload lengths differ: only the pre-check may catch it
  Bufs b(world_rank() == 1 ? 3 : 4, 5);
  const std::string msg = error_of([&] { b.backward(*c); }, ErrorCode::kMismatch);
  EXPECT_TRUE(has(msg, "layer_norm_backward: ranks disagree on 'rows'")) << msg;
  EXPECT_TRUE(has(msg, "differing from the majority: rank 1") || world_size() == 2) << msg;
  EXPECT_TRUE(b.untouched());
}

TEST(RowNormBadInputs, DifferentOpsOnDifferentRanksIsAMismatch) {
  auto c = world(-1);
  Bufs b(4, 5);
  const std::string msg = error_of(
      [&] {
        if (world_rank() == 0)
          rms_norm_forward(*c, b.x.view(b.s()), {}, b.y.view(b.s()), b.rstd.view({b.R}));
        else
          b.forward(*c);
      },
      ErrorCode::kMismatch);
  EXPECT_TRUE(has(msg, "rank 0 called rms_norm_forward, rank 1 called layer_norm_forward")) << msg;
  EXPECT_TRUE(b.untouched());
}

// A null pointer with a non-zero size, for every kind of argument, forward and backward.
TEST(RowNormBadInputs, NullDataWithElementsFailsEveryRank) {
  const int bad = world_size() - 1;
  for (int64_t strict : kModes) {
    for (const char* arg : {"x", "gamma", "y", "mean", "rstd", "dy", "dx", "dbeta"}) {
      auto c = world(strict);
      Bufs b(6, 4);
      const bool bwd =
          std::string(arg) == "dy" || std::string(arg) == "dx" || std::string(arg) == "dbeta";
      if (bwd) b.forward(*c);
      const auto before = b.outputs();  // the forward's results when testing the backward
      const std::string msg = error_of(
          [&] {
            auto v = [&](Buffer& buf, const char* name, Shape s) {
              return world_rank() == bad && std::string(arg) == name
                         ? TensorView(static_cast<void*>(nullptr), buf.dtype(), s)
                         : buf.view(s);
            };
            const Shape s = b.s(), p{b.h}, r{b.R};
            if (!bwd)
              layer_norm_forward(*c, v(b.x, "x", s), v(b.gamma, "gamma", p), b.beta.view(p),
                                 v(b.y, "y", s), v(b.mean, "mean", r), v(b.rstd, "rstd", r));
            else
              layer_norm_backward(*c, v(b.dy, "dy", s), b.x.view(s), b.gamma.view(p),
                                  b.mean.view(r), b.rstd.view(r), v(b.dx, "dx", s),
                                  b.dgamma.view(p), v(b.dbeta, "dbeta", p));
          },
          ErrorCode::kInvalidArgument);
      EXPECT_TRUE(has(msg, "rank " + std::to_string(bad) + ": argument '" + arg + "' is null"))
          << msg;
      EXPECT_EQ(b.outputs(), before) << arg << ": an output was written";
    }
  }
}

// Sizes beyond int32 are counted in int64 (checked at validation, before any memory is touched:
// no test machine holds 2^31 elements per rank), and a shape whose element count overflows
// int64 is an error, not undefined behaviour.
TEST(RowNormBadInputs, ElementCountsBeyondInt32AreCheckedIn64Bits) {
  auto c = world(0);
  const int64_t big = (int64_t{1} << 31) + 5;  // wraps to a negative int32
  float dummy = 0, y[4], rstd[2] = {kSentinel, kSentinel};
  const std::string msg = error_of(
      [&] {
        rms_norm_forward(*c, view(&dummy, {2, big}), view(&dummy, {5}), view(y, {2, big}),
                         view(rstd, {2}));
      },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(has(msg, "argument 'gamma' has 5 elements (shape [5]), expected 2147483653")) << msg;
  EXPECT_EQ(rstd[0], kSentinel);

  const int64_t huge = int64_t{1} << 40;  // huge * huge overflows int64
  const std::string over = error_of(
      [&] {
        rms_norm_forward(*c, view(&dummy, {huge, huge}), {}, view(y, {huge, huge}),
                         view(rstd, {2}));
      },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(has(over,
                  "argument 'x' has a negative dimension or dimensions whose product "
                  "exceeds 2^63"))
      << over;
}

// Forward + backward of LayerNorm and RMSNorm over this rank's columns [c0, c0+h) of full
// [R, H] data, checked element-wise against the float64 reference. Views with no elements get
// a null pointer: valid, and it proves nothing reads them.
int64_t wrong_vs_reference(int64_t R, int64_t H, const Split& sp, const std::vector<float>& x,
                           const std::vector<float>& dy, const std::vector<float>& gamma,
                           const std::vector<float>& beta) {
  const int me = world_rank();
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  auto c = world(-1);
  int64_t wrong = 0;
  for (bool centered : {true, false}) {
    const RowRef ref = row_norm_reference(centered, x, R, H, gamma,
                                          centered ? beta : std::vector<float>{}, 1e-5, dy);
    auto cut = [&](const std::vector<float>& m, int64_t rows) {
      return columns(m, rows, H, c0, h);
    };
    auto cutd = [&](const std::vector<double>& m, int64_t rows) {
      std::vector<double> o(static_cast<size_t>(rows * h));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < h; ++j) o[r * h + j] = m[r * H + c0 + j];
      return o;
    };
    std::vector<float> xs = cut(x, R), dys = cut(dy, R), g = cut(gamma, 1), b = cut(beta, 1);
    std::vector<float> y(R * h), dx(R * h), dg(h), db(h), mean(R), rstd(R);
    auto p = [&](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    const Shape s{R, h}, ps{h}, rs{R};
    if (centered) {
      layer_norm_forward(*c, view(p(xs), s), view(p(g), ps), view(p(b), ps), view(p(y), s),
                         view(p(mean), rs), view(p(rstd), rs));
      layer_norm_backward(*c, view(p(dys), s), view(p(xs), s), view(p(g), ps), view(p(mean), rs),
                          view(p(rstd), rs), view(p(dx), s), view(p(dg), ps), view(p(db), ps));
      wrong += count_wrong("mean", mean, ref.mean, 1e-6, 1e-6);
      wrong += count_wrong("dbeta", db, cutd(ref.dbeta, 1), 1e-5 * R, 1e-5);
    } else {
      rms_norm_forward(*c, view(p(xs), s), view(p(g), ps), view(p(y), s), view(p(rstd), rs));
      rms_norm_backward(*c, view(p(dys), s), view(p(xs), s), view(p(g), ps), view(p(rstd), rs),
                        view(p(dx), s), view(p(dg), ps));
    }
    wrong += count_wrong("y", y, cutd(ref.y, R), 2e-5, 1e-5);
    wrong += count_wrong("rstd", rstd, ref.rstd, 0, 1e-6);
    wrong += count_wrong("dx", dx, cutd(ref.dx, R), 1e-3, 1e-4);
    wrong += count_wrong("dgamma", dg, cutd(ref.dgamma, 1), 1e-5 * R, 1e-5);
  }
  return sum_over_ranks(wrong);
}

TEST(RowNormEdgeInputs, HiddenLocalZeroOnSomeRanksWithNullPointers) {
  const int64_t R = 7, H = 13;
  std::vector<int> w(world_size(), 1);
  w[0] = 0;  // rank 0 and (at 4 ranks) rank 2 hold no column
  if (world_size() == 4) w[2] = 0;
  EXPECT_EQ(wrong_vs_reference(R, H, split_weighted(H, w), normal(1, 0, R * H, 0.5),
                               normal(1, 1, R * H), normal(1, 2, H, 1, 0.2), normal(1, 3, H)),
            0);
}

TEST(RowNormEdgeInputs, EveryRankEmptyIsANoOpThatStillAgrees) {
  for (int64_t strict : kModes) {
    auto c = world(strict);
    c->reset_counters();
    // rows = 0 on every rank, every pointer null: valid, writes nothing, one collective (the
    // header alone fits a size-checked sum, so a strict call checks it inside that one too),
    // two when the header goes first.
    layer_norm_forward(*c, view(static_cast<float*>(nullptr), {0, 16}), {}, {},
                       view(static_cast<float*>(nullptr), {0, 16}), {}, {});
    EXPECT_EQ(c->counters().calls, strict == kHeaderFirst ? 2u : 1u);
    // hidden = 0 on every rank: no element to normalise; saved statistics are mean 0 and
    // rstd 1/sqrt(eps) (the statistics of an empty row), y and dx have nothing to write.
    float mean[3], rstd[3];
    const Shape s{3, 0}, r{3};
    float* none = nullptr;
    layer_norm_forward(*c, view(none, s), {}, {}, view(none, s), view(mean, r), view(rstd, r));
    layer_norm_backward(*c, view(none, s), view(none, s), {}, view(mean, r), view(rstd, r),
                        view(none, s), {}, {});
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(mean[i], 0.f);
      EXPECT_FLOAT_EQ(rstd[i], static_cast<float>(1 / std::sqrt(1e-5)));
    }
  }
}

// NaN and Inf stay in their own row: the other rows match the reference, the poisoned rows
// come out non-finite on every rank (no crash, no error).
TEST(RowNormEdgeInputs, NanAndInfStayInTheirRow) {
  const int64_t R = 6, H = 11;
  const Split sp = split_even(H, world_size());
  std::vector<float> x = normal(3, 0, R * H), dy = normal(3, 1, R * H);
  x[1 * H + 0] = std::numeric_limits<float>::quiet_NaN();     // row 1, on rank 0's shard
  x[4 * H + H - 1] = std::numeric_limits<float>::infinity();  // row 4, on the last rank's shard
  const int me = world_rank();
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  auto c = world(0);
  std::vector<float> xs = columns(x, R, H, c0, h), dys = columns(dy, R, H, c0, h);
  std::vector<float> y(R * h), dx(R * h), mean(R), rstd(R);
  const Shape s{R, h}, r{R};
  layer_norm_forward(*c, view(xs.data(), s), {}, {}, view(y.data(), s), view(mean.data(), r),
                     view(rstd.data(), r));
  layer_norm_backward(*c, view(dys.data(), s), view(xs.data(), s), {}, view(mean.data(), r),
                      view(rstd.data(), r), view(dx.data(), s), {}, {});
  const RowRef ref = row_norm_reference(true, x, R, H, {}, {}, 1e-5, dy);
  int64_t wrong = 0;
  for (int64_t row = 0; row < R; ++row) {
    const bool poisoned = row == 1 || row == 4;
    for (int64_t j = 0; j < h; ++j) {
      const float got[2] = {y[row * h + j], dx[row * h + j]};
      const double want[2] = {ref.y[row * H + c0 + j], ref.dx[row * H + c0 + j]};
      if (poisoned)
        wrong += std::isfinite(got[0]) || std::isfinite(got[1]);
      else
        wrong += count_wrong("y|dx", got, want, 2, 1e-4, 1e-5);
    }
    wrong += poisoned ? std::isfinite(mean[row])
                      : count_wrong("mean", &mean[row], &ref.mean[row], 1, 1e-6, 1e-6);
  }
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

// A row of one constant value c spread over all ranks has variance 0, so y = beta (the robust
// statistics give mean = c exactly, so x - mean = 0 and no rounding noise is amplified by
// rstd = 1/sqrt(eps)); checked against the reference, whatever the split.
TEST(RowNormEdgeInputs, ZeroVarianceRowsGiveBeta) {
  const int64_t R = 5, H = 10;
  std::vector<float> x = normal(4, 0, R * H, 3.0);
  for (int64_t row : {0, 3})
    for (int64_t j = 0; j < H; ++j) x[row * H + j] = 0.1f * static_cast<float>(row + 1);
  std::vector<int> w(world_size(), 1);
  w.back() = 3;  // uneven
  EXPECT_EQ(wrong_vs_reference(R, H, split_weighted(H, w), x, normal(4, 1, R * H),
                               normal(4, 2, H, 1, 0.2), normal(4, 3, H)),
            0);
}

}  // namespace
