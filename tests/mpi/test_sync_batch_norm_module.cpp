// The SyncBatchNorm module equals the functional calls it wraps (exactly: the same code path)
// over two training steps and an eval step, with uneven batches (rank r holds r+1 samples;
// rank 1 of 3+ ranks holds none), and eval sends nothing. The functional calls themselves are
// checked against the float64 reference in test_batch_norm_equiv.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "harness.h"
#include "tpnorm/mpi.h"
#include "tpnorm/sync_batch_norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

TEST(SyncBatchNormModule, MatchesFunctionalCallsAndSwitchesModes) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int me = world_rank();
  const int64_t C = 4, n = (world_size() > 2 && me == 1) ? 0 : me + 1, inner = 6;
  const Shape xs{n, 2, 3, C}, cs{C};  // channels-last
  BatchNormOptions opt;
  opt.layout = Layout::kChannelsLast;
  opt.momentum = BatchNormOptions::cumulative();
  SyncBatchNorm bn(*comm, C, DType::F32, opt);
  std::vector<float> gamma = normal(3, 0, C, 1.0, 0.3), beta = normal(3, 1, C);
  std::copy(gamma.begin(), gamma.end(), static_cast<float*>(bn.weight().data));
  std::copy(beta.begin(), beta.end(), static_cast<float*>(bn.bias().data));

  std::vector<float> rm(C, 0.f), rv(C, 1.f), sm(C), si(C), dg(C), db(C);
  int64_t tracked = 0;
  int64_t wrong = 0;
  uint64_t eval_calls = 1;
  for (int step = 0; step < 3; ++step) {
    const bool training = step < 2;
    training ? bn.train() : bn.eval();
    opt.training = training;
    std::vector<float> x = normal(11, 100 * step + me, n * inner * C, 1.0, 2.0);
    std::vector<float> dy = normal(12, 100 * step + me, x.size());
    std::vector<float> y1(x.size()), y2(x.size()), dx1(x.size()), dx2(x.size());
    comm->reset_counters();
    bn.forward(view(x.data(), xs), view(y1.data(), xs));
    bn.backward(view(dy.data(), xs), view(x.data(), xs), view(dx1.data(), xs));
    if (!training) eval_calls = comm->counters().calls;
    sync_batch_norm_forward(*comm, view(x.data(), xs), view(gamma.data(), cs),
                            view(beta.data(), cs), view(rm.data(), cs), view(rv.data(), cs),
                            &tracked, view(y2.data(), xs), view(sm.data(), cs), view(si.data(), cs),
                            opt);
    sync_batch_norm_backward(*comm, view(dy.data(), xs), view(x.data(), xs), view(gamma.data(), cs),
                             view(sm.data(), cs), view(si.data(), cs), view(dx2.data(), xs),
                             view(dg.data(), cs), view(db.data(), cs), opt);
    auto same = [&](const char* what, const std::vector<float>& a, const float* b) {
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i]) {
          ADD_FAILURE() << what << "[" << i << "] " << a[i] << " vs " << b[i];
          ++wrong;
        }
    };
    same("y", y2, y1.data());
    same("dx", dx2, dx1.data());
    same("grad_weight", dg, static_cast<float*>(bn.grad_weight().data));
    same("grad_bias", db, static_cast<float*>(bn.grad_bias().data));
    same("running_mean", rm, bn.running_mean().data());
    same("running_var", rv, bn.running_var().data());
  }
  if (bn.num_batches_tracked() != 2 || tracked != 2) ++wrong;
  if (eval_calls != 0) ++wrong;
  EXPECT_EQ(sum_over_ranks(wrong), 0);
}

}  // namespace
