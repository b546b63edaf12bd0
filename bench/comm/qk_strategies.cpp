// qk_strategies.cpp — three ways to compute an attention layer's QK-norm under tensor
// parallelism: q_norm = RMSNorm over all heads of q [tokens, H], k_norm = RMSNorm over all heads
// of k [tokens, HK] (HF transformers' OLMo 2, OLMoE, MiniMax-M2), the heads split over P ranks
// (./launch/tpnorm bench --strategies qk --hidden H --kv-hidden HK):
//   qk_tpnorm   both norms in one batched call: ONE all-reduce per pass (tpnorm/batched.h)
//   qk_two      q_norm and k_norm as two calls: two all-reduces per pass
//   qk_gather   all-gather q and k, normalise whole rows locally, keep this rank's columns
//               (vLLM's and SGLang's OLMo 2 / OLMoE); backward all-gathers dq and dk
// Each part is a RowNormCase (RMSNorm, its own seeded data), checked against the float64
// reference as the LayerNorm strategies are.
#include <cmath>

#include "row_norm_case.h"
#include "strategies.h"
#include "timed_communicator.h"

namespace tpnorm_bench {
namespace {

using tpnorm::Communicator;

float* f32(Buffer& b) {
  return static_cast<float*>(b.view(tpnorm::Shape{static_cast<int64_t>(b.size())}).data);
}

BenchConfig with_hidden(BenchConfig c, int64_t hidden) {
  c.hidden = hidden;
  return c;
}

int64_t kv_hidden(const BenchConfig& c) { return c.kv_hidden > 0 ? c.kv_hidden : c.hidden; }

// RMSNorm with the row all-gathered: every rank normalises whole rows, keeps its columns.
class GatherRmsCase : public RowNormCase {
 public:
  GatherRmsCase(const BenchConfig& c, int rank, int size, uint64_t seed)
      : RowNormCase(false, c, rank, size, seed), split_(tpnorm_test::split_even(c.hidden, size)) {}

  void forward(Communicator& comm) override {
    gather(comm, f32(x_), x_all_);
    const float *x = f32(x_), *g = f32(g_);
    float* y = f32(y_);
    for (int64_t r = 0; r < R_; ++r) {
      double ss = 0;
      for_row(x_all_, r, [&](const float* v, int64_t n, int64_t) {
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) ss += double(v[j]) * v[j];
      });
      const double rstd = 1 / std::sqrt(ss / H_ + 1e-5);
      rstd_[r] = static_cast<float>(rstd);
      const float* xr = x + r * h_;
      float* yr = y + r * h_;
#pragma omp simd
      for (int64_t j = 0; j < h_; ++j) yr[j] = static_cast<float>(xr[j] * rstd * g[j]);
    }
  }

  // The whole rows' sum g*dy*xhat from the gathered dy and the forward's gathered x (gamma is
  // whole on every rank, a replicated parameter in this layout).
  void backward(Communicator& comm) override {
    std::vector<float> dy_all;
    gather(comm, f32(dy_), dy_all);
    const float *x = f32(x_), *dy = f32(dy_), *g = f32(g_);
    float *dx = f32(dx_), *dg = f32(dg_);
    std::vector<double> sdg(h_, 0.0);
    for (int64_t r = 0; r < R_; ++r) {
      const double rstd = rstd_[r];
      double b = 0;
      for (size_t p = 0; p < split_.count.size(); ++p) {
        const int64_t hp = split_.count[p], at = R_ * split_.offset[p] + r * hp;
        const float *xr = &x_all_[at], *dyr = &dy_all[at], *gp = &G_[split_.offset[p]];
#pragma omp simd reduction(+ : b)
        for (int64_t j = 0; j < hp; ++j) b += double(gp[j]) * dyr[j] * xr[j] * rstd;
      }
      const double bh = b / H_;
      const float *xr = x + r * h_, *dyr = dy + r * h_;
      float* dxr = dx + r * h_;
#pragma omp simd
      for (int64_t j = 0; j < h_; ++j) {
        const double xhat = xr[j] * rstd;
        dxr[j] = static_cast<float>(rstd * (g[j] * double(dyr[j]) - xhat * bh));
        sdg[j] += dyr[j] * xhat;
      }
    }
    for (int64_t j = 0; j < h_; ++j) dg[j] = static_cast<float>(sdg[j]);
  }

 private:
  // Every rank's [R, h_p] block, in rank order (block p starts at R * offset[p]).
  void gather(Communicator& comm, const float* mine, std::vector<float>& all) {
    std::vector<int> bytes(split_.count.size());
    for (size_t p = 0; p < bytes.size(); ++p)
      bytes[p] = static_cast<int>(R_ * split_.count[p] * sizeof(float));
    all.resize(static_cast<size_t>(R_ * H_));
    all_gather(comm, mine, all.data(), bytes);
  }
  // f(pointer, count, offset) over row r's pieces in the gathered blocks.
  template <class F>
  void for_row(const std::vector<float>& all, int64_t r, F&& f) const {
    for (size_t p = 0; p < split_.count.size(); ++p) {
      const int64_t hp = split_.count[p];
      f(&all[R_ * split_.offset[p] + r * hp], hp, split_.offset[p]);
    }
  }

  tpnorm_test::Split split_;
  std::vector<float> x_all_;
};

// One layer's q and k parts; Batched: both in one tpnorm call, else each part on its own.
template <class Part, bool Batched>
class QkCase : public BenchCase {
 public:
  QkCase(const BenchConfig& c, int rank, int size)
      : q_(with_hidden(c, c.hidden), rank, size, 1), k_(with_hidden(c, kv_hidden(c)), rank, size, 11) {}

  std::string local_shape() const override {
    return q_.local_shape() + "+" + k_.local_shape().substr(k_.local_shape().find('x') + 1);
  }
  void forward(Communicator& comm) override {
    if (Batched) {
      const tpnorm::RowNormItem items[] = {q_.item(), k_.item()};
      tpnorm::batched_norm_forward(comm, items, 2);
    } else {
      q_.forward(comm);
      k_.forward(comm);
    }
  }
  void backward(Communicator& comm) override {
    if (Batched) {
      const tpnorm::RowNormGradItem items[] = {q_.grad_item(), k_.grad_item()};
      tpnorm::batched_norm_backward(comm, items, 2);
    } else {
      q_.backward(comm);
      k_.backward(comm);
    }
  }
  int64_t count_wrong() override { return q_.count_wrong() + k_.count_wrong(); }
  uint64_t payload_values(bool forward) const override {
    return q_.payload_values(forward) + k_.payload_values(forward);
  }

 private:
  Part q_, k_;
};

// RowNormCase with the (centered, config, rank, size, seed) constructor of GatherRmsCase.
struct RmsCase : RowNormCase {
  RmsCase(const BenchConfig& c, int rank, int size, uint64_t seed)
      : RowNormCase(false, c, rank, size, seed) {}
};

template <class Case>
std::unique_ptr<BenchCase> make(const BenchConfig& c, int rank, int size) {
  return std::make_unique<Case>(c, rank, size);
}

double rows(const BenchConfig& c) { return static_cast<double>(c.rows); }

// RMSNorm's payload is one float64 per row per norm (docs/cpp-api.md, "One collective per
// call") after the call's header; a batched call adds one count per item (tpnorm/batched.h).
std::vector<Collective> plan_qk_tpnorm(const BenchConfig& c, int, int, bool) {
  const double b = (2 * rows(c) + 2 + header_values(true)) * sizeof(double);
  return {{false, b, b}};
}
std::vector<Collective> plan_qk_two(const BenchConfig& c, int, int, bool) {
  const double b = (rows(c) + header_values(true)) * sizeof(double);
  return {{false, b, b}, {false, b, b}};
}
std::vector<Collective> plan_qk_gather(const BenchConfig& c, int P, int rank, bool) {
  std::vector<Collective> out;
  for (int64_t h : {c.hidden, kv_hidden(c)}) {
    const double total = rows(c) * static_cast<double>(h) * sizeof(float);
    const double mine =
        rank < 0 ? total / P : rows(c) * tpnorm_test::split_even(h, P).count[rank] * sizeof(float);
    out.push_back({true, mine, total});
  }
  return out;
}

}  // namespace

std::vector<BenchStrategy> qk_strategies() {
  return {
      {"qk_tpnorm", "q_norm + k_norm: tpnorm, 1 all-reduce / pass",
       make<QkCase<RmsCase, true>>, plan_qk_tpnorm, "qknorm"},
      {"qk_two", "q_norm, k_norm apart: 2 all-reduces / pass", make<QkCase<RmsCase, false>>,
       plan_qk_two, "qknorm"},
      {"qk_gather", "all-gather q and k, local norms, slice (vLLM, SGLang)",
       make<QkCase<GatherRmsCase, false>>, plan_qk_gather, "qknorm"},
  };
}

}  // namespace tpnorm_bench
