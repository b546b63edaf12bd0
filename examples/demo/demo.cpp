// demo.cpp — what `./launch/tpnorm demo` runs under mpirun: hidden-sharded LayerNorm and RMSNorm,
// forward and backward, at a realistic shape, compared with the same op on one process; then
// SyncBatchNorm with uneven batches (demo_batch_norm.cpp).
//
// Every rank builds the full [tokens, hidden] input from a seed, keeps its columns, and runs
// the sharded op; it also runs the op on the full input with a single-process communicator and
// prints the largest difference on its columns. Times are medians over iterations of the
// slowest rank (the ranks synchronise before each call).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;

int demo_sync_batch_norm(Communicator& world, int rank, int P);  // demo_batch_norm.cpp

namespace {

struct Args {
  int64_t tokens = 2048, hidden = 4096;
  int iters = 10;
};

std::vector<float> random_vec(size_t n, uint64_t seed, float mean) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(mean, 1.0f);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

std::vector<float> cols(const std::vector<float>& m, int64_t rows, int64_t w, int64_t c0,
                        int64_t n) {
  std::vector<float> o(static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(&m[r * w + c0], n, &o[r * n]);
  return o;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& full, int64_t rows,
                int64_t w, int64_t c0, int64_t n) {
  double m = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c)
      m = std::max(m, static_cast<double>(std::fabs(a[r * n + c] - full[r * w + c0 + c])));
  return m;
}

template <class Fn>
double median_seconds(int iters, Fn&& fn) {
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto a = std::chrono::steady_clock::now();
    fn();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Args a;
  int rank = 0, P = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  // Every rank parses the same argv, so every rank takes the same exit on a bad flag.
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    const long long v = i + 1 < argc ? std::atoll(argv[i + 1]) : 0;
    if ((k != "--tokens" && k != "--hidden" && k != "--iters") || v < 1) {
      if (rank == 0)
        std::fprintf(stderr, "tpnorm_demo: usage: [--tokens N] [--hidden H] [--iters K] "
                             "(positive integers); got '%s'\n", k.c_str());
      MPI_Finalize();
      return 2;
    }
    if (k == "--tokens") a.tokens = v;
    if (k == "--hidden") a.hidden = v;
    if (k == "--iters") a.iters = static_cast<int>(v);
  }
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  auto single = make_single_communicator();

  const int64_t R = a.tokens, H = a.hidden;
  const int64_t c0 = H * rank / P, h = H * (rank + 1) / P - c0;
  const auto X = random_vec(R * H, 1, 0.5f), DY = random_vec(R * H, 2, 0.0f);
  const auto G = random_vec(H, 3, 1.0f), B = random_vec(H, 4, 0.0f);
  const auto x = cols(X, R, H, c0, h), dy = cols(DY, R, H, c0, h), g = cols(G, 1, H, c0, h),
             b = cols(B, 1, H, c0, h);
  if (rank == 0)
    std::printf(
        "tpnorm demo: %d ranks, x [%lld, %lld] float32, hidden sharded %lld..%lld "
        "columns per rank, %d iterations\n",
        P, static_cast<long long>(R), static_cast<long long>(H), static_cast<long long>(H / P),
        static_cast<long long>((H + P - 1) / P), a.iters);
  if (rank == 0)
    std::printf("%-10s %-9s %14s %16s %12s\n", "op", "pass", "max|diff|", "bytes/rank/call",
                "ms/call");

  int failures = 0;
  for (bool centered : {true, false}) {
    const char* name = centered ? "LayerNorm" : "RMSNorm";
    std::vector<float> y(R * h), dx(R * h), dg(h), db(h), mean(R), rstd(R);
    std::vector<float> Y(R * H), DX(R * H), DG(H), DB(H), MEAN(R), RSTD(R);
    auto fwd = [&](Communicator& c, const std::vector<float>& xx, const std::vector<float>& gg,
                   const std::vector<float>& bb, std::vector<float>& yy, std::vector<float>& mm,
                   std::vector<float>& rr, int64_t w) {
      const Shape s{R, w}, p{w}, r{R};
      if (centered)
        layer_norm_forward(c, view(xx.data(), s), view(gg.data(), p), view(bb.data(), p),
                           view(yy.data(), s), view(mm.data(), r), view(rr.data(), r));
      else
        rms_norm_forward(c, view(xx.data(), s), view(gg.data(), p), view(yy.data(), s),
                         view(rr.data(), r));
    };
    auto bwd = [&](Communicator& c, const std::vector<float>& dd, const std::vector<float>& xx,
                   const std::vector<float>& gg, const std::vector<float>& mm,
                   const std::vector<float>& rr, std::vector<float>& dxx, std::vector<float>& dgg,
                   std::vector<float>& dbb, int64_t w) {
      const Shape s{R, w}, p{w}, r{R};
      if (centered)
        layer_norm_backward(c, view(dd.data(), s), view(xx.data(), s), view(gg.data(), p),
                            view(mm.data(), r), view(rr.data(), r), view(dxx.data(), s),
                            view(dgg.data(), p), view(dbb.data(), p));
      else
        rms_norm_backward(c, view(dd.data(), s), view(xx.data(), s), view(gg.data(), p),
                          view(rr.data(), r), view(dxx.data(), s), view(dgg.data(), p));
    };
    world->reset_counters();
    fwd(*world, x, g, b, y, mean, rstd, h);
    const double fwd_bytes = static_cast<double>(world->counters().bytes_sent);
    world->reset_counters();
    bwd(*world, dy, x, g, mean, rstd, dx, dg, db, h);
    const double bwd_bytes = static_cast<double>(world->counters().bytes_sent);
    fwd(*single, X, G, B, Y, MEAN, RSTD, H);
    bwd(*single, DY, X, G, MEAN, RSTD, DX, DG, DB, H);

    double dfwd = max_diff(y, Y, R, H, c0, h), dbwd = max_diff(dx, DX, R, H, c0, h);
    dbwd = std::max(dbwd, max_diff(dg, DG, 1, H, c0, h));
    MPI_Allreduce(MPI_IN_PLACE, &dfwd, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &dbwd, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double tf = median_seconds(a.iters, [&] { fwd(*world, x, g, b, y, mean, rstd, h); });
    const double tb =
        median_seconds(a.iters, [&] { bwd(*world, dy, x, g, mean, rstd, dx, dg, db, h); });
    if (rank == 0) {
      std::printf("%-10s %-9s %14.3g %16.0f %12.3f\n", name, "forward", dfwd, fwd_bytes, tf * 1e3);
      std::printf("%-10s %-9s %14.3g %16.0f %12.3f\n", name, "backward", dbwd, bwd_bytes, tb * 1e3);
    }
    if (!(dfwd < 1e-4 && dbwd < 1e-3)) failures++;
  }
  if (rank == 0)
    std::printf(
        "max|diff| is against the same op on the full input in one process "
        "(tolerance 1e-4 forward, 1e-3 backward): %s\n",
        failures ? "FAILED" : "ok");
  failures += demo_sync_batch_norm(*world, rank, P);
  MPI_Finalize();
  return failures ? 1 : 0;
}
