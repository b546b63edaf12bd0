// demo_batch_norm.cpp — the SyncBatchNorm part of the demo: a data-parallel conv-net layer with
// uneven per-rank batches (6, 0, 10, 2, ... images; a rank may hold none), channels-last,
// three training steps and one eval step through the SyncBatchNorm module, compared with the
// same module on the concatenated batch in one process.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "tpnorm/sync_batch_norm.h"

using namespace tpnorm;

namespace {

std::vector<float> images(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.5f, 2.0f);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

double max_abs(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

}  // namespace

// Returns 0 when every difference is within tolerance (1e-4), 1 otherwise; same on every rank.
int demo_sync_batch_norm(Communicator& world, int rank, int P) {
  const int64_t C = 64, H = 14, W = 14, per = H * W * C;
  const int64_t pattern[] = {6, 0, 10, 2};
  std::vector<int64_t> n(P);
  int64_t N = 0, b0 = 0;
  for (int p = 0; p < P; ++p) {
    n[p] = pattern[p % 4];
    if (p < rank) b0 += n[p];
    N += n[p];
  }
  BatchNormOptions opt;
  opt.layout = Layout::kChannelsLast;
  auto single = make_single_communicator();
  SyncBatchNorm bn(world, C, DType::F32, opt), ref(*single, C, DType::F32, opt);
  const Shape xs{n[rank], H, W, C}, full{N, H, W, C};
  if (rank == 0) {
    std::printf(
        "\nSyncBatchNorm: %d ranks, x [N, %lld, %lld, %lld] channels-last float32, "
        "images per rank:",
        P, (long long)H, (long long)W, (long long)C);
    for (int p = 0; p < P; ++p) std::printf(" %lld", (long long)n[p]);
    std::printf("\n%-6s %14s %14s %16s\n", "step", "max|diff| y", "max|diff| dx", "bytes/rank");
  }
  double worst = 0;
  for (int step = 0; step < 4; ++step) {
    const bool training = step < 3;
    training ? bn.train() : bn.eval();
    training ? ref.train() : ref.eval();
    const auto X = images(N * per, 10 + step), DY = images(N * per, 20 + step);
    const std::vector<float> x(X.begin() + b0 * per, X.begin() + (b0 + n[rank]) * per),
        dy(DY.begin() + b0 * per, DY.begin() + (b0 + n[rank]) * per);
    std::vector<float> y(x.size()), dx(x.size()), Y(X.size()), DX(X.size());
    world.reset_counters();
    bn.forward(view(x.data(), xs), view(y.data(), xs));
    bn.backward(view(dy.data(), xs), view(x.data(), xs), view(dx.data(), xs));
    const double bytes = static_cast<double>(world.counters().bytes_sent);
    ref.forward(view(X.data(), full), view(Y.data(), full));
    ref.backward(view(DY.data(), full), view(X.data(), full), view(DX.data(), full));
    double d[2] = {max_abs(y.data(), Y.data() + b0 * per, y.size()),
                   max_abs(dx.data(), DX.data() + b0 * per, dx.size())};
    MPI_Allreduce(MPI_IN_PLACE, d, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    worst = std::max({worst, d[0], d[1]});
    if (rank == 0)
      std::printf("%-6s %14.3g %14.3g %16.0f\n", training ? "train" : "eval", d[0], d[1], bytes);
  }
  double stats = std::max(max_abs(bn.running_mean().data(), ref.running_mean().data(), C),
                          max_abs(bn.running_var().data(), ref.running_var().data(), C));
  MPI_Allreduce(MPI_IN_PLACE, &stats, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  worst = std::max(worst, stats);
  if (rank == 0)
    std::printf(
        "running stats max|diff| %.3g; against the module on the concatenated batch in "
        "one process (tolerance 1e-4): %s\n",
        stats, worst < 1e-4 ? "ok" : "FAILED");
  return worst < 1e-4 ? 0 : 1;
}
