// qk_strategies.cpp — four ways to compute an attention layer's QK-norm under tensor
// parallelism: q_norm = RMSNorm over all heads of q [tokens, H], k_norm = RMSNorm over all heads
// of k [tokens, HK] (HF transformers' OLMo 2, OLMoE, MiniMax-M2), the heads split over P ranks
// (./launch/tpnorm bench --strategies qk --hidden H --kv-hidden HK):
//   qk_tpnorm   both norms in one batched call: ONE all-reduce per pass (tpnorm/batched.h)
//   qk_two      q_norm and k_norm as two calls: two all-reduces per pass
//   qk_gather   all-gather q and k, normalise whole rows locally, keep this rank's columns
//               (vLLM's and SGLang's OLMo 2 / OLMoE); backward all-gathers dq and dk
//   qk_a2a      q and k from the heads' split to the tokens' (an all-to-all each), whole rows
//               normalised there, the outputs sent back (another each); backward the same for
//               dy and dx, and the weights' gradients (partial over each rank's tokens)
//               all-reduced: OLMo-core's Attention.apply_tp, whose DTensor redistributions
//               Shard(2) -> Shard(1) -> Shard(2) are these all-to-alls
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

// RMSNorm the OLMo-core way: whole rows of this rank's tokens (split_even of the rows), gamma
// whole on every rank (Replicate).
class AllToAllRmsCase : public RowNormCase {
 public:
  AllToAllRmsCase(const BenchConfig& c, int rank, int size, uint64_t seed)
      : RowNormCase(false, c, rank, size, seed),
        cols_(tpnorm_test::split_even(c.hidden, size)),
        rows_(tpnorm_test::split_even(c.rows, size)),
        r0_(rows_.offset[rank]),
        n_(rows_.count[rank]) {
    rstd_rows_ = {r0_, r0_ + n_};
  }

  void forward(Communicator& comm) override {
    to_rows(comm, f32(x_), x_rows_);
    std::vector<float> y(static_cast<size_t>(n_ * H_));
    for (int64_t r = 0; r < n_; ++r) {
      double ss = 0;
      for_row(r, [&](int64_t i, int64_t n, int64_t) {
        const float* v = &x_rows_[i];
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; ++j) ss += double(v[j]) * v[j];
      });
      const double rstd = 1 / std::sqrt(ss / H_ + 1e-5);
      rstd_[r0_ + r] = static_cast<float>(rstd);
      for_row(r, [&](int64_t i, int64_t n, int64_t c0) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j)
          y[i + j] = static_cast<float>(x_rows_[i + j] * rstd * G_[c0 + j]);
      });
    }
    from_rows(comm, y, f32(y_));
  }

  void backward(Communicator& comm) override {
    std::vector<float> dy, dx(static_cast<size_t>(n_ * H_)), dg(H_);
    to_rows(comm, f32(dy_), dy);
    std::vector<double> sdg(H_, 0.0);
    for (int64_t r = 0; r < n_; ++r) {
      const double rstd = rstd_[r0_ + r];
      double b = 0;
      for_row(r, [&](int64_t i, int64_t n, int64_t c0) {
#pragma omp simd reduction(+ : b)
        for (int64_t j = 0; j < n; ++j) b += double(G_[c0 + j]) * dy[i + j] * x_rows_[i + j] * rstd;
      });
      const double bh = b / H_;
      for_row(r, [&](int64_t i, int64_t n, int64_t c0) {
        for (int64_t j = 0; j < n; ++j) {
          const double xhat = x_rows_[i + j] * rstd;
          dx[i + j] = static_cast<float>(rstd * (G_[c0 + j] * double(dy[i + j]) - xhat * bh));
          sdg[c0 + j] += dy[i + j] * xhat;
        }
      });
    }
    from_rows(comm, dx, f32(dx_));
    // gamma's gradient over this rank's tokens: Partial, summed over the ranks (OLMo-core
    // leaves it Partial until the gradient is read; a step reads it)
    for (int64_t j = 0; j < H_; ++j) dg[j] = static_cast<float>(sdg[j]);
    comm.all_reduce_sum(dg.data(), dg.size(), tpnorm::DType::F32);
    std::copy_n(&dg[c0_], h_, f32(dg_));
  }

 private:
  // This rank's rows, whole, lie in blocks by the rank that held the columns: block p is
  // [n_, cols_.count[p]] at n_ * cols_.offset[p]. f(index, count, first column) per block of
  // row r.
  template <class F>
  void for_row(int64_t r, F&& f) const {
    for (size_t p = 0; p < cols_.count.size(); ++p)
      f(n_ * cols_.offset[p] + r * cols_.count[p], cols_.count[p], cols_.offset[p]);
  }
  // [R, h_] (this rank's columns of every row) -> this rank's rows, whole.
  void to_rows(Communicator& comm, const float* mine, std::vector<float>& rows) {
    const size_t P = cols_.count.size();
    std::vector<int> send(P), recv(P);
    for (size_t p = 0; p < P; ++p) {
      send[p] = static_cast<int>(rows_.count[p] * h_ * sizeof(float));
      recv[p] = static_cast<int>(n_ * cols_.count[p] * sizeof(float));
    }
    rows.resize(static_cast<size_t>(n_ * H_));
    all_to_all(comm, mine, send, rows.data(), recv);
  }
  // The reverse: this rank's rows, whole -> [R, h_].
  void from_rows(Communicator& comm, const std::vector<float>& rows, float* mine) {
    const size_t P = cols_.count.size();
    std::vector<int> send(P), recv(P);
    for (size_t p = 0; p < P; ++p) {
      send[p] = static_cast<int>(n_ * cols_.count[p] * sizeof(float));
      recv[p] = static_cast<int>(rows_.count[p] * h_ * sizeof(float));
    }
    all_to_all(comm, rows.data(), send, mine, recv);
  }

  tpnorm_test::Split cols_, rows_;
  int64_t r0_, n_;
  std::vector<float> x_rows_;  // the forward's rows, kept for the backward
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
  return {{Collective::kAllReduce, b, b}};
}
std::vector<Collective> plan_qk_two(const BenchConfig& c, int, int, bool) {
  const double b = (rows(c) + header_values(true)) * sizeof(double);
  return {{Collective::kAllReduce, b, b}, {Collective::kAllReduce, b, b}};
}
// Per norm: its columns of every row to whole rows and the output back, forward (x, y) and
// backward (dy, dx); backward also gamma's gradient, H float32 values.
std::vector<Collective> plan_qk_a2a(const BenchConfig& c, int P, int rank, bool forward) {
  std::vector<Collective> out;
  for (int64_t h : {c.hidden, kv_hidden(c)}) {
    const double total = rows(c) * static_cast<double>(h) * sizeof(float);
    const double cols = rank < 0 ? total / P
                                 : rows(c) * tpnorm_test::split_even(h, P).count[rank] * sizeof(float);
    const double whole =
        rank < 0 ? total / P
                 : tpnorm_test::split_even(c.rows, P).count[rank] * static_cast<double>(h) * sizeof(float);
    out.push_back({Collective::kAllToAll, cols, total});
    out.push_back({Collective::kAllToAll, whole, total});
    if (!forward) out.push_back({Collective::kAllReduce, h * 4.0, h * 4.0});
  }
  return out;
}
std::vector<Collective> plan_qk_gather(const BenchConfig& c, int P, int rank, bool) {
  std::vector<Collective> out;
  for (int64_t h : {c.hidden, kv_hidden(c)}) {
    const double total = rows(c) * static_cast<double>(h) * sizeof(float);
    const double mine =
        rank < 0 ? total / P : rows(c) * tpnorm_test::split_even(h, P).count[rank] * sizeof(float);
    out.push_back({Collective::kAllGather, mine, total});
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
      {"qk_a2a", "q, k to the tokens' split and back: 4 all-to-alls / pass (OLMo-core)",
       make<QkCase<AllToAllRmsCase, false>>, plan_qk_a2a, "qknorm"},
  };
}

}  // namespace tpnorm_bench
