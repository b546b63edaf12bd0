// micro_batch_norm.cpp — SyncBatchNorm (training, running statistics on), forward and backward,
// at [32, 64, 56, 56] NCHW and channels-last, through the public ops on a single-process
// communicator; and both statistics modes against each other (micro.h, add_mode_pair).
// Bytes moved: channels-last reads x for the channel sums and again for the apply (after the
// collective) and writes y, 3 tensors against the minimum 2; the backward reads x and dy twice
// and writes dx, 5 against 3 (unless the second read finds them in the cache: x is 25.7 MB here,
// the L3 32 MiB). NCHW on this single-process communicator takes the one-rank fused path when a
// channel's planes fit in the core's L2 (401 KB of x, 803 KB of x and dy here; the library's
// rule, kernels/cpu/batch_norm.h bn_fuses, restated below from the same sysfs file): the apply
// re-reads them from L2, so it moves the minimum; otherwise 3 and 5 tensors as channels-last.
#include <cstdio>
#include <memory>
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

// The per-core L2 (sysfs, else 1 MiB), as the library reads it.
int64_t l2_bytes() {
  long v = 0;
  char unit = 0;
  if (std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index2/size", "r")) {
    if (std::fscanf(f, "%ld%c", &v, &unit) < 1) v = 0;
    std::fclose(f);
  }
  return v > 0 ? v * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1) : int64_t{1} << 20;
}

// kRobust rows for the main table; with `modes` also the op in both modes (the exact-vs-robust
// table).
void add_batch_norm(tpnorm::Layout layout) {
  constexpr int64_t n = 32, c = 64, hw = 56;
  const bool nchw = layout == tpnorm::Layout::kNCHW;
  const Shape xs = nchw ? Shape{n, c, hw, hw} : Shape{n, hw, hw, c};
  const std::string shape = nchw ? "32x64x56x56" : "32x56x56x64";
  const int64_t bytes = xs.numel() * static_cast<int64_t>(sizeof(float));
  for (bool bwd : {false, true}) {
    const char* pass = bwd ? "backward" : "forward";
    const auto run = bwd ? backward : forward;
    // Moved: the channel sums read x (and dy), the apply after the collective reads them again
    // from memory, unless the fused path re-reads a channel from L2.
    const int64_t channel_bytes = n * hw * hw * static_cast<int64_t>(sizeof(float)) * (bwd ? 2 : 1);
    const bool fused = nchw && channel_bytes <= l2_bytes();
    tpnorm_perf::add_op(
        "SyncBN", pass, shape, (bwd ? 3 : 2) * bytes,
        [=]() -> tpnorm_perf::Call {
          auto b = std::make_shared<Buffers>(xs, c, layout);
          return [b, run](int t) { run(*b, t, tpnorm::Stats::kRobust); };
        },
        (fused ? (bwd ? 3 : 2) : (bwd ? 5 : 3)) * bytes);
    tpnorm_perf::add_mode_pair("SyncBN", pass, shape, (bwd ? 3 : 2) * bytes,
                               [=]() -> tpnorm_perf::ModePair {
                                 auto b = std::make_shared<Buffers>(xs, c, layout);
                                 return {[b, run](int t) { run(*b, t, tpnorm::Stats::kRobust); },
                                         [b, run](int t) { run(*b, t, tpnorm::Stats::kExact); },
                                         [b] { return b->comm->counters().bytes_sent; }};
                               });
  }
}

void register_all() {
  add_batch_norm(tpnorm::Layout::kNCHW);
  add_batch_norm(tpnorm::Layout::kChannelsLast);
}
const bool registered = tpnorm_perf::on_load(register_all);

}  // namespace
