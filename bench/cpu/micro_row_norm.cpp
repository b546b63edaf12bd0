// micro_row_norm.cpp — LayerNorm and RMSNorm, forward and backward, through the public ops on a
// single-process communicator (so the numbers include validation and the one PackedCall).
// add_row_norm_modes: the same calls in Stats::kRobust against Stats::kExact (micro.h).
#include <memory>
#include <vector>

#include "micro.h"
#include "tpnorm/norm.h"

namespace {

using tpnorm::Shape;
using tpnorm::view;

struct Buffers {
  int64_t rows, h;
  tpnorm_perf::Floats x, dy, out, gamma, beta, dgamma, dbeta, mean, rstd;
  std::unique_ptr<tpnorm::Communicator> comm = tpnorm::make_single_communicator();
  Buffers(int64_t r, int64_t c, bool backward)
      : rows(r),
        h(c),
        out(r * c),
        gamma(c, 1.25f),
        beta(c, 0.5f),
        dgamma(c),
        dbeta(c),
        mean(r, backward ? 3.5f : 0.0f),
        rstd(r, backward ? 3.4f : 0.0f) {
    tpnorm_perf::fill_inputs(r * c, x, dy);
  }
  Shape xs() const { return Shape{rows, h}; }
  static tpnorm::NormOptions opt(int threads, tpnorm::Stats stats) {
    tpnorm::NormOptions o;
    o.num_threads = threads;
    o.stats = stats;
    return o;
  }

  void forward(bool centered, int t, tpnorm::Stats stats) {
    const Shape s = xs(), hs{h}, rs{rows};
    if (centered)
      tpnorm::layer_norm_forward(*comm, view(x.data(), s), view(gamma.data(), hs),
                                 view(beta.data(), hs), view(out.data(), s), view(mean.data(), rs),
                                 view(rstd.data(), rs), opt(t, stats));
    else
      tpnorm::rms_norm_forward(*comm, view(x.data(), s), view(gamma.data(), hs),
                               view(out.data(), s), view(rstd.data(), rs), opt(t, stats));
  }
  void backward(bool centered, int t, tpnorm::Stats stats) {
    const Shape s = xs(), hs{h}, rs{rows};
    if (centered)
      tpnorm::layer_norm_backward(*comm, view(dy.data(), s), view(x.data(), s),
                                  view(gamma.data(), hs), view(mean.data(), rs),
                                  view(rstd.data(), rs), view(out.data(), s),
                                  view(dgamma.data(), hs), view(dbeta.data(), hs), opt(t, stats));
    else
      tpnorm::rms_norm_backward(*comm, view(dy.data(), s), view(x.data(), s),
                                view(gamma.data(), hs), view(rstd.data(), rs), view(out.data(), s),
                                view(dgamma.data(), hs), opt(t, stats));
  }
  void pass(bool backward, bool centered, int t, tpnorm::Stats stats) {
    backward ? this->backward(centered, t, stats) : forward(centered, t, stats);
  }
};

const char* op_name(bool centered) { return centered ? "LayerNorm" : "RMSNorm"; }
// Forward reads x and writes y; backward reads x and dy and writes dx.
int64_t traffic(bool backward, int64_t rows, int64_t h) {
  return (backward ? 3 : 2) * rows * h * static_cast<int64_t>(sizeof(float));
}

void add_row_norm(bool centered, int64_t rows, int64_t h) {
  const std::string shape = std::to_string(rows) + "x" + std::to_string(h);
  for (bool backward : {false, true})
    tpnorm_perf::add_op(op_name(centered), backward ? "backward" : "forward", shape,
                        traffic(backward, rows, h), [=]() -> tpnorm_perf::Call {
                          auto b = std::make_shared<Buffers>(rows, h, backward);
                          return [b, backward, centered](int t) {
                            b->pass(backward, centered, t, tpnorm::Stats::kRobust);
                          };
                        });
}

// The op in both modes (the exact-vs-robust table).
void add_row_norm_modes(bool centered, int64_t rows, int64_t h) {
  const std::string shape = std::to_string(rows) + "x" + std::to_string(h);
  for (bool backward : {false, true})
    tpnorm_perf::add_mode_pair(op_name(centered), backward ? "backward" : "forward", shape,
                               traffic(backward, rows, h), [=]() -> tpnorm_perf::ModePair {
                                 auto b = std::make_shared<Buffers>(rows, h, backward);
                                 auto call = [b, backward,
                                              centered](tpnorm::Stats stats) -> tpnorm_perf::Call {
                                   return [=](int t) { b->pass(backward, centered, t, stats); };
                                 };
                                 return {call(tpnorm::Stats::kRobust), call(tpnorm::Stats::kExact),
                                         [b] { return b->comm->counters().bytes_sent; }};
                               });
}

void register_all() {
  for (bool centered : {true, false}) {
    add_row_norm(centered, 16384, 4096);
    add_row_norm(centered, 65536, 1024);
    add_row_norm(centered, 4096, 512);
    add_row_norm_modes(centered, 16384, 4096);
    add_row_norm_modes(centered, 4096, 512);
  }
}
const bool registered = tpnorm_perf::on_load(register_all);

}  // namespace
