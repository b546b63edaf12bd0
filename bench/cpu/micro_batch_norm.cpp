// micro_batch_norm.cpp — SyncBatchNorm (training, running statistics on), forward and backward,
// at [32, 64, 56, 56] NCHW and channels-last and [32, 32, 112, 112] NCHW, through the public ops
// on a single-process communicator; and both statistics modes against each other (micro.h,
// add_mode_pair).
// Bytes moved: channels-last reads x for the channel sums and again for the apply (after the
// collective) and writes y, 3 tensors against the minimum 2; the backward reads x and dy twice
// and writes dx, 5 against 3 (unless the second read finds them in the cache: x is 25.7 MB here,
// the L3 32 MiB). NCHW on this single-process communicator takes the one-rank fused path when a
// channel's planes fit in the core's L2 plus an eighth of the last-level cache at the table's 1
// and 2 threads (401 KB of x, 803 KB of x and dy here; the library's rule, kernels/cpu/
// batch_norm.h bn_fused_channel_bytes, restated below from the same sysfs files): the apply
// re-reads them from cache, so it moves the minimum; otherwise 3 and 5 tensors as channels-last.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "micro.h"
#include "tpnorm/batch_norm.h"

namespace {

using tpnorm::Shape;
using tpnorm::view;

struct Buffers {
  Shape xs;
  tpnorm_perf::Floats x, dy, out, gamma, beta, dgamma, dbeta, run_mean, run_var, mean, invstd;
  std::unique_ptr<tpnorm::Communicator> comm = tpnorm::make_single_communicator();
  tpnorm::BatchNormOptions opt;
  Buffers(Shape s, int64_t c, tpnorm::Layout layout)
      : xs(s),
        out(s.numel()),
        gamma(c, 1.25f),
        beta(c, 0.5f),
        dgamma(c),
        dbeta(c),
        run_mean(c, 0.0f),
        run_var(c, 1.0f),
        mean(c, 3.5f),
        invstd(c, 3.4f) {
    tpnorm_perf::fill_inputs(s.numel(), x, dy);
    opt.layout = layout;
  }
};

void forward(Buffers& b, int t, tpnorm::Stats stats) {
  const Shape cs{static_cast<int64_t>(b.gamma.size())};
  b.opt.num_threads = t;
  b.opt.stats = stats;
  tpnorm::sync_batch_norm_forward(*b.comm, view(b.x.data(), b.xs), view(b.gamma.data(), cs),
                                  view(b.beta.data(), cs), view(b.run_mean.data(), cs),
                                  view(b.run_var.data(), cs), nullptr, view(b.out.data(), b.xs),
                                  view(b.mean.data(), cs), view(b.invstd.data(), cs), b.opt);
}

void backward(Buffers& b, int t, tpnorm::Stats stats) {
  const Shape cs{static_cast<int64_t>(b.gamma.size())};
  b.opt.num_threads = t;
  b.opt.stats = stats;
  tpnorm::sync_batch_norm_backward(*b.comm, view(b.dy.data(), b.xs), view(b.x.data(), b.xs),
                                   view(b.gamma.data(), cs), view(b.mean.data(), cs),
                                   view(b.invstd.data(), cs), view(b.out.data(), b.xs),
                                   view(b.dgamma.data(), cs), view(b.dbeta.data(), cs), b.opt);
}

// Cache `index` of cpu0 in bytes (sysfs), else `fallback`, as the library reads it.
int64_t cache_bytes(int index, int64_t fallback) {
  long v = 0;
  char unit = 0;
  const std::string path =
      "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size";
  if (std::FILE* f = std::fopen(path.c_str(), "r")) {
    if (std::fscanf(f, "%ld%c", &v, &unit) < 1) v = 0;
    std::fclose(f);
  }
  return v > 0 ? v * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1) : fallback;
}

// The fused path's channel budget at 1 or 2 threads: L2 + LLC / 8 (bn_fused_channel_bytes).
int64_t fused_channel_bytes() {
  return cache_bytes(2, int64_t{1} << 20) + cache_bytes(3, int64_t{32} << 20) / 8;
}

// kRobust rows for the main table; with `modes` also the op in both modes (the exact-vs-robust
// table).
void add_batch_norm(tpnorm::Layout layout, int64_t n, int64_t c, int64_t hw, bool modes) {
  const bool nchw = layout == tpnorm::Layout::kNCHW;
  const Shape xs = nchw ? Shape{n, c, hw, hw} : Shape{n, hw, hw, c};
  std::string shape = std::to_string(xs[0]);
  for (int i = 1; i < 4; ++i) shape += "x" + std::to_string(xs[i]);
  const int64_t bytes = xs.numel() * static_cast<int64_t>(sizeof(float));
  for (bool bwd : {false, true}) {
    const char* pass = bwd ? "backward" : "forward";
    const auto run = bwd ? backward : forward;
    // Moved: the channel sums read x (and dy), the apply after the collective reads them again
    // from memory, unless the fused path re-reads a channel from cache.
    const int64_t channel_bytes = n * hw * hw * static_cast<int64_t>(sizeof(float)) * (bwd ? 2 : 1);
    const bool fused = nchw && channel_bytes <= fused_channel_bytes();
    tpnorm_perf::add_op(
        "SyncBN", pass, shape, (bwd ? 3 : 2) * bytes,
        [=]() -> tpnorm_perf::Call {
          auto b = std::make_shared<Buffers>(xs, c, layout);
          return [b, run](int t) { run(*b, t, tpnorm::Stats::kRobust); };
        },
        (fused ? (bwd ? 3 : 2) : (bwd ? 5 : 3)) * bytes);
    if (!modes) continue;
    tpnorm_perf::add_mode_pair("SyncBN", pass, shape, (bwd ? 3 : 2) * bytes,
                               [=]() -> tpnorm_perf::ModePair {
                                 auto b = std::make_shared<Buffers>(xs, c, layout);
                                 return {[b, run](int t) { run(*b, t, tpnorm::Stats::kRobust); },
                                         [b, run](int t) { run(*b, t, tpnorm::Stats::kExact); },
                                         [b] { return b->comm->counters().bytes_sent; }};
                               });
  }
}

// [32, 64, 56, 56] in both layouts (and both statistics modes); NCHW [32, 32, 112, 112] too, a
// channel of 3.2 MB of x and dy: larger than a core's L2, within the fused path's budget.
void register_all() {
  add_batch_norm(tpnorm::Layout::kNCHW, 32, 64, 56, true);
  add_batch_norm(tpnorm::Layout::kChannelsLast, 32, 64, 56, true);
  add_batch_norm(tpnorm::Layout::kNCHW, 32, 32, 112, false);
}
const bool registered = tpnorm_perf::on_load(register_all);

}  // namespace
