// chunk_bench.cpp — one sharded LayerNorm / RMSNorm forward and backward at P ranks in several
// chunk modes (TPNORM_CHUNK: off, on = the rule's chunks, auto, or N rows per chunk), against
// the local cost: the same calls on a single-process communicator, every rank at once (the
// one-rank fused path on the per-rank shape; the denominator of the "step" ratio in
// examples/overlap, which also adds the bare all-reduces). All modes are interleaved call by call,
// their order rotated each iteration, so that every mode sees the same machine load. Per call:
// the slowest rank's time after a barrier; printed: medians per mode, the collectives per call,
// the ratio of the step (forward + backward) to the local step, and the bytes of x (and dy) a
// call reads from memory if its chunks stay in cache (chunked: once) or not (twice).
//
//   mpirun -n 2 tpnorm_chunk_bench [--rows R] [--cols C per rank] [--rms] [-n ITERS]
//                                  [--chunk MODE[,MODE...]] [--threads T]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
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

struct Mode {
  explicit Mode(std::string n) : name(std::move(n)) {}
  std::string name;  // "local" or a TPNORM_CHUNK value
  std::vector<double> fwd, bwd, step;
  uint64_t colls_fwd = 0, colls_bwd = 0;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int64_t rows = 4096, cols = 2048;
  int iters = 11, threads = 1;
  bool rms = false;
  std::string chunks = "off,on";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--rows") rows = std::atoll(next());
    else if (a == "--cols") cols = std::atoll(next());
    else if (a == "-n") iters = std::atoi(next());
    else if (a == "--rms") rms = true;
    else if (a == "--chunk") chunks = next();
    else if (a == "--threads") threads = std::atoi(next());
  }
  auto world = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
  auto single = tpnorm::make_single_communicator();
  const int P = world->size(), me = world->rank();
  std::mt19937 gen(1234 + me);
  std::normal_distribution<float> nd(0.5f, 1.5f);
  std::vector<float> x(rows * cols), dy(rows * cols), y(rows * cols), dx(rows * cols);
  for (auto& v : x) v = nd(gen);
  for (auto& v : dy) v = nd(gen);
  std::vector<float> g(cols, 1.1f), b(cols, 0.1f), dg(cols), db(cols), mean(rows), rstd(rows);
  const tpnorm::Shape s{rows, cols}, p{cols}, r{rows};
  tpnorm::NormOptions opt;
  opt.num_threads = threads;
  auto fwd = [&](tpnorm::Communicator& c) {
    if (rms)
      tpnorm::rms_norm_forward(c, tpnorm::view(x.data(), s), tpnorm::view(g.data(), p),
                               tpnorm::view(y.data(), s), tpnorm::view(rstd.data(), r), opt);
    else
      tpnorm::layer_norm_forward(c, tpnorm::view(x.data(), s), tpnorm::view(g.data(), p),
                                 tpnorm::view(b.data(), p), tpnorm::view(y.data(), s),
                                 tpnorm::view(mean.data(), r), tpnorm::view(rstd.data(), r), opt);
  };
  auto bwd = [&](tpnorm::Communicator& c) {
    if (rms)
      tpnorm::rms_norm_backward(c, tpnorm::view(dy.data(), s), tpnorm::view(x.data(), s),
                                tpnorm::view(g.data(), p), tpnorm::view(rstd.data(), r),
                                tpnorm::view(dx.data(), s), tpnorm::view(dg.data(), p), opt);
    else
      tpnorm::layer_norm_backward(c, tpnorm::view(dy.data(), s), tpnorm::view(x.data(), s),
                                  tpnorm::view(g.data(), p), tpnorm::view(mean.data(), r),
                                  tpnorm::view(rstd.data(), r), tpnorm::view(dx.data(), s),
                                  tpnorm::view(dg.data(), p), tpnorm::view(db.data(), p), opt);
  };
  std::vector<Mode> modes{Mode("local")};
  {
    std::stringstream ss(chunks);
    for (std::string m; std::getline(ss, m, ',');)
      if (!m.empty()) modes.emplace_back(m);
  }
  // The slowest rank's time of one call; the collectives it made on the world communicator.
  auto timed = [&](const Mode& m, auto&& call, uint64_t* colls) {
    const bool local = m.name == "local";
    setenv("TPNORM_CHUNK", local ? "off" : m.name.c_str(), 1);
    world->reset_counters();
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = now_us();
    call(local ? *single : *world);
    double t = now_us() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *colls = world->counters().calls;
    return t;
  };
  const size_t nm = modes.size();
  for (int it = -1; it < iters; ++it) {  // iteration -1: warm-up
    for (size_t i = 0; i < nm; ++i) {
      Mode& m = modes[(i + static_cast<size_t>(it + 1)) % nm];  // rotated each iteration
      const double f = timed(m, fwd, &m.colls_fwd), bw = timed(m, bwd, &m.colls_bwd);
      if (it < 0) continue;
      m.fwd.push_back(f), m.bwd.push_back(bw), m.step.push_back(f + bw);
    }
  }
  if (me == 0) {
    const double mib = 1.0 / (1 << 20), xb = rows * cols * 4.0 * mib;
    std::printf("# tpnorm_chunk_bench: %s, %d ranks, %lldx%lld fp32 per rank, %d thread(s), "
                "%d calls each, modes interleaved; medians of the slowest rank (us); local = "
                "single-process communicators, every rank at once\n",
                rms ? "rmsnorm" : "layernorm", P, static_cast<long long>(rows),
                static_cast<long long>(cols), threads, iters);
    std::printf("# MiB of x (and dy) read from memory per step: %.0f unchunked (twice), %.0f "
                "chunked if each chunk stays in cache, %.0f local\n",
                6 * xb, 3 * xb, 3 * xb);
    std::printf("%-8s %9s %9s %11s %11s %11s %10s\n", "mode", "colls_fwd", "colls_bwd",
                "forward", "backward", "step", "step/local");
    const double local = median(modes[0].step);
    for (const Mode& m : modes)
      std::printf("%-8s %9llu %9llu %11.1f %11.1f %11.1f %10.3f\n", m.name.c_str(),
                  static_cast<unsigned long long>(m.colls_fwd),
                  static_cast<unsigned long long>(m.colls_bwd), median(m.fwd), median(m.bwd),
                  median(m.step), median(m.step) / local);
  }
  world.reset();
  single.reset();
  MPI_Finalize();
  return 0;
}
