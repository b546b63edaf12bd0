// chunk_bench.cpp — one sharded LayerNorm / RMSNorm forward and backward at P ranks, unchunked
// (TPNORM_CHUNK=off) and chunked (TPNORM_CHUNK=on: the rule's chunk size, or a row count),
// interleaved call by call so that both see the same machine load. Per call: the slowest rank's
// time after a barrier; printed: medians, the ratio, the collectives per call, and the bytes of
// x (and dy) each call reads from memory if the chunks stay in cache (chunked: once) or not
// (unchunked: twice, the partial's read and the apply's).
//
//   mpirun -n 2 tpnorm_chunk_bench [--rows R] [--cols C per rank] [--rms] [-n ITERS]
//                                  [--chunk on|ROWS] [--threads T]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

namespace {

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int64_t rows = 4096, cols = 2048;
  int iters = 11, threads = 1;
  bool rms = false;
  std::string chunk = "on";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--rows") rows = std::atoll(next());
    else if (a == "--cols") cols = std::atoll(next());
    else if (a == "-n") iters = std::atoi(next());
    else if (a == "--rms") rms = true;
    else if (a == "--chunk") chunk = next();
    else if (a == "--threads") threads = std::atoi(next());
  }
  auto comm = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
  const int P = comm->size(), me = comm->rank();
  std::mt19937 gen(1234 + me);
  std::normal_distribution<float> nd(0.5f, 1.5f);
  std::vector<float> x(rows * cols), dy(rows * cols), y(rows * cols), dx(rows * cols);
  for (auto& v : x) v = nd(gen);
  for (auto& v : dy) v = nd(gen);
  std::vector<float> g(cols, 1.1f), b(cols, 0.1f), dg(cols), db(cols), mean(rows), rstd(rows);
  const tpnorm::Shape s{rows, cols}, p{cols}, r{rows};
  tpnorm::NormOptions opt;
  opt.num_threads = threads;
  auto fwd = [&] {
    if (rms)
      tpnorm::rms_norm_forward(*comm, tpnorm::view(x.data(), s), tpnorm::view(g.data(), p),
                               tpnorm::view(y.data(), s), tpnorm::view(rstd.data(), r), opt);
    else
      tpnorm::layer_norm_forward(*comm, tpnorm::view(x.data(), s), tpnorm::view(g.data(), p),
                                 tpnorm::view(b.data(), p), tpnorm::view(y.data(), s),
                                 tpnorm::view(mean.data(), r), tpnorm::view(rstd.data(), r), opt);
  };
  auto bwd = [&] {
    if (rms)
      tpnorm::rms_norm_backward(*comm, tpnorm::view(dy.data(), s), tpnorm::view(x.data(), s),
                                tpnorm::view(g.data(), p), tpnorm::view(rstd.data(), r),
                                tpnorm::view(dx.data(), s), tpnorm::view(dg.data(), p), opt);
    else
      tpnorm::layer_norm_backward(*comm, tpnorm::view(dy.data(), s), tpnorm::view(x.data(), s),
                                  tpnorm::view(g.data(), p), tpnorm::view(mean.data(), r),
                                  tpnorm::view(rstd.data(), r), tpnorm::view(dx.data(), s),
                                  tpnorm::view(dg.data(), p), tpnorm::view(db.data(), p), opt);
  };
  // The slowest rank's time of one call, and its collectives.
  auto timed = [&](const char* mode, auto&& call, uint64_t* colls) {
    setenv("TPNORM_CHUNK", mode, 1);
    comm->reset_counters();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = now_us();
    call();
    double t = now_us() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *colls = comm->counters().calls;
    return t;
  };
  std::vector<double> f_off, f_on, b_off, b_on;
  uint64_t cf_off = 0, cf_on = 0, cb_off = 0, cb_on = 0;
  for (int it = -1; it < iters; ++it) {  // iteration -1: warm-up
    const double a = timed("off", fwd, &cf_off), c = timed(chunk.c_str(), fwd, &cf_on);
    const double bo = timed("off", bwd, &cb_off), bc = timed(chunk.c_str(), bwd, &cb_on);
    if (it < 0) continue;
    f_off.push_back(a), f_on.push_back(c), b_off.push_back(bo), b_on.push_back(bc);
  }
  if (me == 0) {
    const double mib = 1.0 / (1 << 20), xb = rows * cols * 4.0 * mib;
    std::printf("# tpnorm_chunk_bench: %s, %d ranks, %lldx%lld fp32 per rank, %d thread(s), "
                "%d calls each, interleaved; medians of the slowest rank (us)\n",
                rms ? "rmsnorm" : "layernorm", P, static_cast<long long>(rows),
                static_cast<long long>(cols), threads, iters);
    std::printf("# MiB read from memory per call: x (and dy) twice unchunked, once chunked if "
                "each chunk stays in cache\n");
    std::printf("%-9s %6s %6s %12s %12s %8s %10s %10s\n", "pass", "colls", "colls", "unchunked",
                "chunked", "ratio", "MiB_unch", "MiB_ch");
    std::printf("%-9s %6llu %6llu %12.1f %12.1f %8.3f %10.0f %10.0f\n", "forward",
                static_cast<unsigned long long>(cf_off), static_cast<unsigned long long>(cf_on),
                median(f_off), median(f_on), median(f_on) / median(f_off), 2 * xb, xb);
    std::printf("%-9s %6llu %6llu %12.1f %12.1f %8.3f %10.0f %10.0f\n", "backward",
                static_cast<unsigned long long>(cb_off), static_cast<unsigned long long>(cb_on),
                median(b_off), median(b_on), median(b_on) / median(b_off), 4 * xb, 2 * xb);
  }
  comm.reset();
  MPI_Finalize();
  return 0;
}
