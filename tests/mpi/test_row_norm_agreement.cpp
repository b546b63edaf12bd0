// A bad argument or a disagreement on one rank becomes the same tpnorm::Error on every rank,
// never a hang, and leaves the outputs untouched.
#include <gtest/gtest.h>

#include <string>

#include "expect_error.h"
#include "harness.h"
#include "mpi_world.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

struct Rows {
  int64_t R = 6, h = 4;
  std::vector<float> x = normal(9, world_rank(), 24), y = std::vector<float>(24, -7.f),
                     mean = std::vector<float>(6, -7.f), rstd = std::vector<float>(6, -7.f);
  bool untouched() const {
    for (float v : y)
      if (v != -7.f) return false;
    for (float v : mean)
      if (v != -7.f) return false;
    for (float v : rstd)
      if (v != -7.f) return false;
    return true;
  }
};

TEST(RowNormAgreement, BadEpsOnOneRankFailsEveryRank) {
  for (int64_t mode : {int64_t{-1}, kHeaderFirst, int64_t{0}}) {
    auto comm = mpi_world(mode);
    Rows t;
    NormOptions opt;
    if (world_rank() == world_size() - 1) opt.eps = -1.0;
    const Shape s{t.R, t.h}, r{t.R};
    const std::string msg = error_of(
        [&] {
          layer_norm_forward(*comm, view(t.x.data(), s), {}, {}, view(t.y.data(), s),
                             view(t.mean.data(), r), view(t.rstd.data(), r), opt);
        },
        ErrorCode::kInvalidArgument);
    EXPECT_NE(msg.find("rank " + std::to_string(world_size() - 1) + ": argument 'eps'"),
              std::string::npos)
        << msg;
    EXPECT_TRUE(t.untouched());
  }
}

TEST(RowNormAgreement, RowsDifferingAcrossRanksIsAMismatch) {
  // Sizes differ: the size-checked sum (the header inside) or the pre-check (header first)
  // must catch it before any payload is used.
  // Folded calls too: their sum is size-checked at these sizes.
  for (int64_t mode : {int64_t{-1}, kHeaderFirst, int64_t{0}}) {
    auto comm = mpi_world(mode);
    Rows t;
    const int64_t R = world_rank() == 0 ? 5 : 6;
    const Shape s{R, t.h}, r{R};
    const std::string msg = error_of(
        [&] {
          rms_norm_forward(*comm, view(t.x.data(), s), {}, view(t.y.data(), s),
                           view(t.rstd.data(), r));
        },
        ErrorCode::kMismatch);
    EXPECT_NE(msg.find("disagree on 'rows'"), std::string::npos) << msg;
    EXPECT_TRUE(t.untouched());
  }
}

TEST(RowNormAgreement, EpsDifferingAcrossRanksIsCaughtInTheFoldedFingerprint) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm->set_strict_calls(0);  // one collective: the fingerprint rides with the payload
  Rows t;
  NormOptions opt;
  opt.eps = world_rank() == 0 ? 1e-5 : 1e-6;
  const Shape s{t.R, t.h}, r{t.R};
  comm->reset_counters();
  const std::string msg = error_of(
      [&] {
        layer_norm_forward(*comm, view(t.x.data(), s), {}, {}, view(t.y.data(), s),
                           view(t.mean.data(), r), view(t.rstd.data(), r), opt);
      },
      ErrorCode::kMismatch);
  EXPECT_NE(msg.find("disagree on 'eps'"), std::string::npos) << msg;
  EXPECT_TRUE(t.untouched());
  // One payload collective, then one diagnostic collective on the error path.
  EXPECT_EQ(comm->counters().calls, 2u);
}

TEST(RowNormAgreement, NullDataWithElementsFailsEveryRank) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  Rows t;
  const Shape s{t.R, t.h}, r{t.R};
  const float* x = world_rank() == 0 ? nullptr : t.x.data();
  const std::string msg = error_of(
      [&] {
        layer_norm_forward(*comm, view(x, s), {}, {}, view(t.y.data(), s), view(t.mean.data(), r),
                           view(t.rstd.data(), r));
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("rank 0: argument 'x' is null"), std::string::npos) << msg;
  EXPECT_TRUE(t.untouched());
}

}  // namespace
