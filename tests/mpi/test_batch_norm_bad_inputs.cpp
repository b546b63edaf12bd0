// Bad inputs of a training SyncBatchNorm forward at 2, 3 and 4 ranks: the same tpnorm::Error on
// every rank, in strict and folded mode, naming the argument or field and the rank, with y, the
// running statistics, num_batches_tracked and the saved statistics untouched. (A global count
// of 1 and channels differing are in test_batch_norm_agreement.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "expect_error.h"
#include "harness.h"
#include "mpi_world.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr float kSentinel = -7.f;

// [N=3, C=4, 2] on this rank; `bend` may change the options, the dtype or a view first.
struct Call {
  int64_t N = 3, C = 4, S = 2;
  DType dt = DType::F32;
  DType gamma_dt = DType::F32, beta_dt = DType::F32;  // used when affine
  bool affine = false;
  BatchNormOptions o;
  std::vector<float> x = normal(5, world_rank(), N* C* S);
  Buffer y = Buffer(DType::F32, std::vector<float>(N* C* S, kSentinel));
  std::vector<float> rm = std::vector<float>(C, kSentinel), rv = rm, sm = rm, si = rm;
  int64_t tracked = 5;
  bool null_x = false;
  void run(Communicator& c) {
    Buffer xb(dt, x), g(gamma_dt, std::vector<float>(C, 1.f)), b(beta_dt, std::vector<float>(C));
    y = Buffer(dt, std::vector<float>(N * C * S, kSentinel));
    const Shape s{N, C, S}, ch{C};
    sync_batch_norm_forward(c, null_x ? TensorView(static_cast<void*>(nullptr), dt, s) : xb.view(s),
                            affine ? g.view(ch) : TensorView{}, affine ? b.view(ch) : TensorView{},
                            view(rm.data(), ch), view(rv.data(), ch), &tracked, y.view(s),
                            view(sm.data(), ch), view(si.data(), ch), o);
  }
  bool untouched() const {
    for (const auto* v : {&rm, &rv, &sm, &si})
      for (float f : *v)
        if (f != kSentinel) return false;
    for (float f : y.floats())
      if (f != kSentinel) return false;
    return tracked == 5;
  }
};

void expect_fails(const std::function<void(Call&)>& bend, ErrorCode code, const std::string& part) {
  for (int64_t mode : {int64_t{-1}, kHeaderFirst, int64_t{0}}) {
    auto c = mpi_world(mode);
    Call call;
    bend(call);
    const std::string msg = error_of([&] { call.run(*c); }, code);
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
    EXPECT_TRUE(call.untouched()) << msg;
  }
}

const bool kLast = true;
bool on(bool last) { return world_rank() == (last ? world_size() - 1 : 0); }

TEST(BatchNormBadInputs, EpsZeroNanInfOnOneRank) {
  for (double eps : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()})
    expect_fails(
        [&](Call& c) {
          if (on(kLast)) c.o.eps = eps;
        },
        ErrorCode::kInvalidArgument,
        "sync_batch_norm_forward failed: rank " + std::to_string(world_size() - 1) +
            ": argument 'eps'");
}

TEST(BatchNormBadInputs, NullDataWithElements) {
  expect_fails([](Call& c) { c.null_x = on(!kLast); }, ErrorCode::kInvalidArgument,
               "rank 0: argument 'x' is null");
}

TEST(BatchNormBadInputs, DtypeEpsOrMomentumDifferingAcrossRanks) {
  expect_fails(
      [](Call& c) {
        if (on(!kLast)) c.dt = DType::F16;
      },
      ErrorCode::kMismatch, "ranks disagree on 'dtype'");
  expect_fails(
      [](Call& c) {
        if (on(kLast)) c.o.eps = 1e-3;
      },
      ErrorCode::kMismatch, "ranks disagree on 'eps'");
  expect_fails(
      [](Call& c) {
        if (on(kLast)) c.o.momentum = 0.2;
      },
      ErrorCode::kMismatch, "ranks disagree on 'momentum'");
}

// Parameters are x's dtype or float32 (mixed precision); anything else, gamma and beta apart, or
// ranks choosing differently, fails on every rank.
TEST(BatchNormBadInputs, ParamDtypeNeitherXsNorFp32OrDifferingAcrossRanks) {
  expect_fails(
      [](Call& c) {
        c.affine = true, c.dt = DType::BF16;
        if (on(kLast)) c.gamma_dt = c.beta_dt = DType::F16;
      },
      ErrorCode::kInvalidArgument, "argument 'gamma' has dtype fp16, expected x's (bf16) or fp32");
  expect_fails([](Call& c) { c.affine = true, c.dt = DType::F16, c.beta_dt = DType::F16; },
               ErrorCode::kInvalidArgument, "argument 'beta' has dtype fp16, expected fp32");
  expect_fails(
      [](Call& c) {
        c.affine = true, c.dt = DType::BF16;
        if (on(!kLast)) c.gamma_dt = c.beta_dt = DType::BF16;
      },
      ErrorCode::kMismatch, "ranks disagree on 'param dtype'");
}

}  // namespace
