// micro_row_norm.cpp — LayerNorm and RMSNorm, forward and backward, through the public ops on a
// single-process communicator (so the numbers include validation and the one PackedCall).
// "LayerNorm-exact" / "RMSNorm-exact": the same calls in Stats::kExact (robust otherwise).
#include <memory>
#include <vector>

#include "micro.h"
#include "tpnorm/norm.h"

namespace {

using tpnorm::Shape;
using tpnorm::view;

struct Buffers {
  int64_t rows, h;
  tpnorm::Stats stats = tpnorm::Stats::kRobust;
  std::vector<float> x, dy, out, gamma, beta, dgamma, dbeta, mean, rstd;
  std::unique_ptr<tpnorm::Communicator> comm = tpnorm::make_single_communicator();
  Buffers(int64_t r, int64_t c)
      : rows(r),
        h(c),
        out(r * c),
        gamma(c, 1.25f),
        beta(c, 0.5f),
        dgamma(c),
        dbeta(c),
        mean(r),
        rstd(r) {
    tpnorm_perf::fill_inputs(r * c, x, dy);
  }
  Shape xs() const { return Shape{rows, h}; }
  tpnorm::NormOptions opt(int threads) const {
    tpnorm::NormOptions o;
    o.num_threads = threads;
    o.stats = stats;
    return o;
  }
};

void add_row_norm(bool centered, int64_t rows, int64_t h,
                  tpnorm::Stats stats = tpnorm::Stats::kRobust) {
  const std::string op = std::string(centered ? "LayerNorm" : "RMSNorm") +
                         (stats == tpnorm::Stats::kExact ? "-exact" : "");
  const std::string shape = std::to_string(rows) + "x" + std::to_string(h);
  const int64_t n = rows * h * static_cast<int64_t>(sizeof(float));
  tpnorm_perf::add_op(op, "forward", shape, 2 * n, [=]() -> tpnorm_perf::Call {
    auto b = std::make_shared<Buffers>(rows, h);
    b->stats = stats;
    return [b, centered](int t) {
      const Shape s = b->xs(), hs{b->h}, rs{b->rows};
      if (centered)
        tpnorm::layer_norm_forward(*b->comm, view(b->x.data(), s), view(b->gamma.data(), hs),
                                   view(b->beta.data(), hs), view(b->out.data(), s),
                                   view(b->mean.data(), rs), view(b->rstd.data(), rs), b->opt(t));
      else
        tpnorm::rms_norm_forward(*b->comm, view(b->x.data(), s), view(b->gamma.data(), hs),
                                 view(b->out.data(), s), view(b->rstd.data(), rs), b->opt(t));
    };
  });
  tpnorm_perf::add_op(op, "backward", shape, 3 * n, [=]() -> tpnorm_perf::Call {
    auto b = std::make_shared<Buffers>(rows, h);
    b->stats = stats;
    for (int64_t r = 0; r < rows; ++r) b->mean[r] = 3.5f, b->rstd[r] = 3.4f;
    return [b, centered](int t) {
      const Shape s = b->xs(), hs{b->h}, rs{b->rows};
      if (centered)
        tpnorm::layer_norm_backward(
            *b->comm, view(b->dy.data(), s), view(b->x.data(), s), view(b->gamma.data(), hs),
            view(b->mean.data(), rs), view(b->rstd.data(), rs), view(b->out.data(), s),
            view(b->dgamma.data(), hs), view(b->dbeta.data(), hs), b->opt(t));
      else
        tpnorm::rms_norm_backward(*b->comm, view(b->dy.data(), s), view(b->x.data(), s),
                                  view(b->gamma.data(), hs), view(b->rstd.data(), rs),
                                  view(b->out.data(), s), view(b->dgamma.data(), hs), b->opt(t));
    };
  });
}

void register_all() {
  for (bool centered : {true, false}) {
    add_row_norm(centered, 16384, 4096);
    add_row_norm(centered, 65536, 1024);
    add_row_norm(centered, 4096, 512);
    add_row_norm(centered, 16384, 4096, tpnorm::Stats::kExact);
    add_row_norm(centered, 4096, 512, tpnorm::Stats::kExact);
  }
}
const bool registered = tpnorm_perf::on_load(register_all);

}  // namespace
