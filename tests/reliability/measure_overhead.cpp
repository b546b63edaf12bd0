// measure_overhead.cpp — what the reliability machinery costs per call (a measurement, not a
// test: nothing here asserts a time). Run at 2 or more ranks:
//   ./launch/tpnorm run -n 2 build/tests/reliability/measure_overhead
// 1. watchdog: a raw blocking MPI_Allreduce of 12 doubles vs the communicator's all_reduce_sum
//    (MPI_Iallreduce polled with MPI_Test against the TPNORM_TIMEOUT deadline), same payload,
//    and with the watchdog off (set_timeout(0): the blocking MPI_Allreduce);
// 2. fingerprint: layer_norm_forward on 1 row x 8 columns (a latency-bound call) with the
//    fingerprint folded into the collective, without it (check_agreement off), in strict mode
//    (the MPI default: every call checked, here inside the call's one size-checked sum), and
//    strict with the header's own collective first (what a call too large for a size-checked
//    sum does; forced here by the tests' HeaderFirstCommunicator wrapper).
// Modes alternate in blocks of 500 calls; printed: the fastest and the median block, in
// microseconds per call as seen by rank 0. On a shared, oversubscribed machine the fastest
// block is the better estimate of the intrinsic cost (the median carries the neighbours' load).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "mpi_world.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  {
    auto comm = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
    MPI_Comm raw;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    std::vector<double> buf(12, 1.0);
    const int64_t R = 1, h = 8;
    std::vector<float> x(R * h, 1.f), y(R * h), mean(R), rstd(R);
    auto first = tpnorm_test::mpi_world(tpnorm_test::kHeaderFirst);
    auto ln = [&](bool check, int64_t strict) {
      tpnorm::Communicator& c = strict == tpnorm_test::kHeaderFirst ? *first : *comm;
      if (&c == comm.get()) comm->set_strict_calls(strict < 0 ? -1 : 0);
      tpnorm::NormOptions o;
      o.check_agreement = check;
      tpnorm::layer_norm_forward(c, tpnorm::view(x.data(), {R, h}), {}, {},
                                 tpnorm::view(y.data(), {R, h}), tpnorm::view(mean.data(), {R}),
                                 tpnorm::view(rstd.data(), {R}), o);
    };
    auto off = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
    off->set_timeout(0);
    const char* names[] = {"MPI_Allreduce, blocking (12 doubles)",
                           "all_reduce_sum, watchdog polling (12 doubles)",
                           "all_reduce_sum, watchdog off (12 doubles)",
                           "layer_norm_forward 1x8, no fingerprint (2+2 values)",
                           "layer_norm_forward 1x8, fingerprint folded (10+2 values)",
                           "layer_norm_forward 1x8, strict (default): header in the one sum",
                           "layer_norm_forward 1x8, strict: header collective + payload"};
    std::vector<std::function<void()>> modes = {
        [&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), 12, MPI_DOUBLE, MPI_SUM, raw); },
        [&] { comm->all_reduce_sum(buf.data(), 12, tpnorm::DType::F64); },
        [&] { off->all_reduce_sum(buf.data(), 12, tpnorm::DType::F64); },
        [&] { ln(false, 0); },
        [&] { ln(true, 0); },
        [&] { ln(true, -1); },
        [&] { ln(true, tpnorm_test::kHeaderFirst); }};
    constexpr int kBlocks = 40, kCalls = 500;
    std::vector<std::vector<double>> blocks(modes.size());
    for (int b = 0; b < kBlocks; ++b)
      for (size_t m = 0; m < modes.size(); ++m) {
        MPI_Barrier(raw);
        const double t0 = MPI_Wtime();
        for (int i = 0; i < kCalls; ++i) modes[m]();
        blocks[m].push_back((MPI_Wtime() - t0) / kCalls * 1e6);
      }
    if (rank == 0)
      for (size_t m = 0; m < modes.size(); ++m)
        std::printf("%-60s min %8.2f  median %8.2f us/call\n", names[m],
                    *std::min_element(blocks[m].begin(), blocks[m].end()), median(blocks[m]));
    MPI_Comm_free(&raw);
  }
  MPI_Finalize();
  return 0;
}
