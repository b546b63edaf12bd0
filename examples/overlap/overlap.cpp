// overlap — does the split-phase API (tpnorm/split.h) hide the statistics exchange, and how far
// is a sharded LayerNorm step from its local cost? Run at P ranks, one thread each:
//
//   ./launch/tpnorm run -n 2 build/examples/overlap/overlap [--rows 4096 --cols 2048]
//       [--work-cols 256] [-n 15]
//
// 1. "step": a whole sharded LayerNorm step (forward + backward, x [rows, cols] per rank) on
//    the MPI communicator, against the local kernels on the same per-rank shape run on every
//    rank at once, each on a single-process communicator (so both share the memory bandwidth
//    the same way), plus two bare all-reduces of the step's payloads (header + statistics).
//    Prints ratio = step / (local + bare); the goal is <= 1.15.
// 2. "overlap": the forward of a tensor-parallel block, an RMSNorm of the residual stream
//    (hidden-sharded) and an independent matmul (the next micro-batch's input projection,
//    [rows, cols] x [cols, work_cols] on this rank), run (a) blocking: norm, then matmul, and
//    (b) split: start the norm, matmul, finish. Prints both times and the exposed
//    communication: the time finish() waited for the all-reduce (measured by a communicator
//    that forwards to the MPI one and times its waits), against the bare all-reduce of the same
//    payload; the goal is <= 10 %. Also a bare MPI_Allreduce of that payload (what MPI itself
//    costs), and which path the communicator's small sums took (shared memory or messages,
//    TPNORM_SHM=0), and a floor: adding two local copies of the payload written before the
//    matmul, timed after it (what any reduction done in finish() costs once the matmul has
//    pushed its data out of the caches, with no communication at all). With shared-memory sums
//    finish() does no reduction: the communicator's progress thread added the sum during the
//    matmul, and the wait only reads a completion word in the communicator
//    (docs/split-phase.md), so the exposed time can be below this floor.
// Times: per iteration the slowest rank's, median over iterations (each after a barrier).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"
#include "tpnorm/split.h"

using namespace tpnorm;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double slowest(double t) {
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Forwards every sum to `inner` (non-blocking ones too) and adds the time spent waiting for
// started sums to waited(): what a split call's finish() leaves exposed.
class WaitTimer final : public Communicator {
 public:
  explicit WaitTimer(Communicator& inner) : inner_(inner) { set_strict_calls(-1); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Device device() const override { return inner_.device(); }
  size_t size_checked_sum_bytes() const override { return inner_.size_checked_sum_bytes(); }
  double waited() const { return waited_; }
  void reset() { waited_ = 0; }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, DType dtype) override {
    inner_.all_reduce_sum(buf, count, dtype);
  }
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, DType dtype) override {
    started_[id] = inner_.start_all_reduce_sum(buf, count, dtype);
  }
  void do_progress_in_background() override { inner_.progress_in_background(); }
  // Times the inner wait only: this wrapper's own bookkeeping is not the library's.
  void do_wait(uint64_t id) override {
    const auto it = started_.find(id);
    Request r = std::move(it->second);
    const double t = now();
    inner_.wait(r);
    waited_ += now() - t;
    started_.erase(it);
  }

 private:
  Communicator& inner_;
  std::unordered_map<uint64_t, Request> started_;
  double waited_ = 0;
};

// out[r, j] = sum_c a[r, c] * w[c, j]: the independent work (a plain loop, not blocked: all of
// w, [cols, work_cols] floats, 2 MiB by default, is re-read from cache for every row of a).
// noinline: one copy of the loop for the three timings. Inlined, GCC 12 compiled the three call
// sites differently and one of them (which one changed with unrelated edits) ran 1.4-1.8x slower
// than the others on an AVX2 core, so "matmul alone" could exceed "blocking" (norm + matmul).
__attribute__((noinline)) void matmul(const std::vector<float>& a, const std::vector<float>& w,
                                      std::vector<float>& out, int64_t rows, int64_t cols,
                                      int64_t k) {
  std::fill(out.begin(), out.end(), 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = &out[r * k];
    for (int64_t c = 0; c < cols; ++c) {
      const float av = a[r * cols + c];
      const float* wr = &w[c * k];
      for (int64_t j = 0; j < k; ++j) o[j] += av * wr[j];
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int64_t rows = 4096, cols = 2048, work_cols = 256;
  int iters = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--rows")
      rows = v;
    else if (k == "--cols")
      cols = v;
    else if (k == "--work-cols")
      work_cols = v;
    else if (k == "-n")
      iters = static_cast<int>(v);
  }
  {
    auto world = make_mpi_communicator(MPI_COMM_WORLD);
    auto single = make_single_communicator();
    const int rank = world->rank(), P = world->size();
    const size_t n = static_cast<size_t>(rows * cols);
    std::vector<float> x(n), dy(n), y(n), dx(n), g(cols, 1.f), b(cols, 0.f), dg(cols), db(cols);
    std::vector<float> mean(rows), rstd(rows);
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>((i * 2654435761u + rank) % 1000) * 1e-3f - 0.5f;
      dy[i] = static_cast<float>((i * 40503u) % 997) * 1e-3f - 0.5f;
    }
    const Shape s{rows, cols}, p{cols}, r{rows};
    auto step = [&](Communicator& c) {
      layer_norm_forward(c, view(x.data(), s), view(g.data(), p), view(b.data(), p),
                         view(y.data(), s), view(mean.data(), r), view(rstd.data(), r));
      layer_norm_backward(c, view(dy.data(), s), view(x.data(), s), view(g.data(), p),
                          view(mean.data(), r), view(rstd.data(), r), view(dx.data(), s),
                          view(dg.data(), p), view(db.data(), p));
    };
    // The payloads of the step's two calls, as the communicator counts them.
    world->reset_counters();
    step(*world);
    const size_t step_values = world->counters().bytes_sent / sizeof(double);
    std::vector<double> bare_buf(step_values);

    std::vector<double> t_step, t_local, t_bare;
    for (int it = 0; it < iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t = now();
      step(*world);
      t_step.push_back(slowest(now() - t));
      MPI_Barrier(MPI_COMM_WORLD);
      t = now();
      step(*single);  // every rank at once, on its own
      t_local.push_back(slowest(now() - t));
      MPI_Barrier(MPI_COMM_WORLD);
      t = now();
      world->all_reduce_sum(bare_buf.data(), 2 * rows + 10, DType::F64);
      world->all_reduce_sum(bare_buf.data(), step_values - (2 * rows + 10), DType::F64);
      t_bare.push_back(slowest(now() - t));
    }
    const double ms = 1e3, step_ms = median(t_step) * ms, local_ms = median(t_local) * ms,
                 bare_ms = median(t_bare) * ms;
    if (rank == 0)
      std::printf(
          "step     P=%d x [%lld, %lld] per rank, fp32, forward+backward: sharded %.3f ms; "
          "local (single-process communicators, all ranks at once) %.3f ms + bare "
          "all-reduces %.3f ms; ratio %.2f (goal <= 1.15)\n",
          P, (long long)rows, (long long)cols, step_ms, local_ms, bare_ms,
          step_ms / (local_ms + bare_ms));

    // 2. overlap: RMSNorm of the residual stream + an independent matmul.
    WaitTimer timed(*world);
    std::vector<float> w(static_cast<size_t>(cols * work_cols)), out(rows * work_cols), x2 = dy;
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 7) * 0.01f;
    std::vector<double> t_block, t_split, t_work, t_exposed, t_bare1, t_mpi1, t_floor;
    std::vector<double> fa(rows + 10), fb(rows + 10), fo(rows + 10);
    std::vector<float> cut(rows * work_cols);
    for (int it = 0; it < iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t = now();
      rms_norm_forward(*world, view(x.data(), s), view(g.data(), p), view(y.data(), s),
                       view(rstd.data(), r));
      matmul(x2, w, out, rows, cols, work_cols);
      t_block.push_back(slowest(now() - t));

      MPI_Barrier(MPI_COMM_WORLD);
      timed.reset();
      t = now();
      PendingCall c = rms_norm_forward_start(timed, view(x.data(), s), view(g.data(), p),
                                             view(y.data(), s), view(rstd.data(), r));
      matmul(x2, w, out, rows, cols, work_cols);
      timed.reset();  // only finish()'s waits (start waited for the call header's sum)
      c.finish();
      t_split.push_back(slowest(now() - t));
      t_exposed.push_back(slowest(timed.waited()));

      MPI_Barrier(MPI_COMM_WORLD);
      for (size_t i = 0; i < fa.size(); ++i) fa[i] = fb[i] = static_cast<double>(i + it);
      t = now();
      matmul(x2, w, cut, rows, cols, work_cols);
      const double t_mm = now() - t;
      t = now();
      for (size_t i = 0; i < fo.size(); ++i) fo[i] = fa[i] + fb[i];
      const double t_add = now() - t;
      t_work.push_back(slowest(t_mm));
      t_floor.push_back(slowest(t_add + fo[it % fo.size()] * 0));
      MPI_Barrier(MPI_COMM_WORLD);
      t = now();
      world->all_reduce_sum(bare_buf.data(), rows + 10, DType::F64);
      t_bare1.push_back(slowest(now() - t));
      MPI_Barrier(MPI_COMM_WORLD);
      t = now();
      MPI_Allreduce(MPI_IN_PLACE, bare_buf.data(), static_cast<int>(rows + 10), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
      t_mpi1.push_back(slowest(now() - t));
    }
    const double us = 1e6, exposed = median(t_exposed) * us, bare1 = median(t_bare1) * us,
                 mpi1 = median(t_mpi1) * us, floor = median(t_floor) * us;
    const bool shm = mpi_shared_memory_sums(*world) > 0;
    if (rank == 0) {
      std::printf(
          "overlap  P=%d RMSNorm [%lld, %lld] + matmul [%lld, %lld] x [%lld, %lld]: "
          "blocking %.3f ms, split %.3f ms (matmul alone %.3f ms)\n",
          P, (long long)rows, (long long)cols, (long long)rows, (long long)cols, (long long)cols,
          (long long)work_cols, median(t_block) * ms, median(t_split) * ms, median(t_work) * ms);
      std::printf(
          "overlap  exposed communication in finish() %.1f us vs bare all-reduce of the "
          "payload %.1f us: %.0f %% (goal <= 10 %%); small sums via %s\n",
          exposed, bare1, bare1 > 0 ? 100 * exposed / bare1 : 0.0,
          shm ? "shared memory" : "MPI messages");
      std::printf(
          "overlap  bare MPI_Allreduce of the payload %.1f us: exposed %.0f %% of it; floor "
          "(two local copies of the payload added after the matmul) %.1f us\n",
          mpi1, mpi1 > 0 ? 100 * exposed / mpi1 : 0.0, floor);
    }
  }
  MPI_Finalize();
  return 0;
}
