// tp_transformer_block.cpp — a Megatron-style tensor-parallel MLP block stack on CPU at P ranks,
// with its norms sharded through tpnorm, trained with SGD on a synthetic regression task.
//
// Layout. In Megatron the residual stream is replicated: every TP rank holds the full hidden of
// every token and runs the same LayerNorm on it. Here the residual stream is HIDDEN-SHARDED:
// rank p owns columns [c0_p, c0_p + h_p) of the [T, H] stream (uneven splits allowed), so the
// norm is exactly what tpnorm computes: partial statistics over h_p columns, one all-reduce.
// A block's MLP is then Megatron's pair of linears wrapped in the two collectives that move
// between the hidden-sharded stream and the full hidden the column-parallel linear needs (the
// hidden-dimension analogue of Megatron's sequence parallelism):
//
//   u_p [T,h_p] --all-gather(hidden)--> u [T,H] --column-parallel W1[:, f_p], tanh--> a_p [T,F_p]
//   a_p --row-parallel W2[f_p, :]--> partial z [T,H] --reduce-scatter(hidden)--> z_p [T,h_p] + b2_p
//
// Backward is the transpose: all-gather of dz before W2^T, reduce-scatter of du after W1^T.
// All parameters are sharded (W1 by columns, W2 by rows, b2 / gamma / beta by hidden), so SGD
// needs no gradient all-reduce. Variants (--arch):
//   pre       h' = h + MLP(Norm(h)), and a final Norm before the loss
//   post      h' = Norm(h + MLP(h))
//   deepnorm  h' = Norm(alpha*h + MLP(h)), alpha = deepnorm_alpha(kEncoderOnly, N, 0) =
//             (2N)^(1/4); W1, W2 initialised scaled by beta = deepnorm_beta(kEncoderOnly, N, 0) =
//             (8N)^(-1/4) (DeepNet's encoder-only preset)
// Every residual add goes through tpnorm's fused ops (tpnorm/fused.h), which add and normalize
// in one pass and one collective: in post and deepnorm the add and the block's own norm; in pre
// the add that ends block l and the norm that starts block l+1 (or the final norm), so only
// the first block's norm is a plain one. In pre, h' also feeds the next residual add: its
// gradient from there enters the fused backward as dh_extra.
// --norm layernorm|rmsnorm picks the norm. The parameters and data are generated from seeds on
// their FULL shapes and sliced, so every world size trains the same model; runs at different P
// differ only by the order of floating-point sums (matmuls accumulate in float64, the
// reduce-scatter is float64, tpnorm's statistics are float64).
//
// --stats exact: the same bits at every world size. The norms run in Stats::kExact (integer
// statistics, tpnorm/norm.h), and the rest is made independent of the split too: the MLP's
// float64 sums over F would depend on how F is split across ranks, so every rank holds all of
// W1 / W2 and computes the full sums (its reduce-scatter becomes "take my columns"), and the
// loss is summed over the gathered [T, H] in one order. The losses then match bitwise.
//
// Flags: --arch --norm --stats (robust|exact) --tokens --hidden --ffn --layers --steps --lr, and
// --write/--check/--tol (see ../common/loss_log.h). Prints the loss per step on rank 0.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/loss_log.h"
#include "tpnorm/fused.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm_example;
using tpnorm::Shape;
using tpnorm::view;
using Vec = std::vector<float>;

namespace {

// The tensor-parallel group: the caller's MPI_Comm for the MLP collectives and a tpnorm
// communicator (a duplicate of the same group) for the norms.
struct Tp {
  MPI_Comm comm;
  std::unique_ptr<tpnorm::Communicator> norm_comm;
  int rank = 0, P = 1;
  int64_t T = 0, H = 0;
  std::vector<Slice> hid;  // hidden slice of every rank
  bool exact = false;      // --stats exact (see the header)
  tpnorm::NormOptions opt;
  Slice me() const { return hid[rank]; }
};

// [T, h_p] float on every rank -> [T, H] on every rank.
Vec all_gather_hidden(const Tp& tp, const Vec& local) {
  std::vector<int> counts(tp.P), displs(tp.P);
  for (int q = 0; q < tp.P; ++q) {
    counts[q] = static_cast<int>(tp.T * tp.hid[q].n);
    displs[q] = static_cast<int>(tp.T * tp.hid[q].c0);
  }
  Vec blocks(tp.T * tp.H), full(tp.T * tp.H);
  MPI_Allgatherv(local.data(), counts[tp.rank], MPI_FLOAT, blocks.data(), counts.data(),
                 displs.data(), MPI_FLOAT, tp.comm);
  for (int q = 0; q < tp.P; ++q)  // rank q's block is [T, h_q] row-major
    for (int64_t t = 0; t < tp.T; ++t)
      for (int64_t c = 0; c < tp.hid[q].n; ++c)
        full[t * tp.H + tp.hid[q].c0 + c] = blocks[displs[q] + t * tp.hid[q].n + c];
  return full;
}

// Partial [T, H] float64 on every rank -> this rank's [T, h_p] of the sum over ranks. With
// --stats exact every rank holds the whole sum already: its own columns, nothing sent.
Vec reduce_scatter_hidden(const Tp& tp, const std::vector<double>& partial) {
  if (tp.exact) {
    Vec mine;
    for (int64_t t = 0; t < tp.T; ++t)
      for (int64_t c = tp.me().c0; c < tp.me().c0 + tp.me().n; ++c)
        mine.push_back(static_cast<float>(partial[t * tp.H + c]));
    return mine;
  }
  std::vector<int> counts(tp.P);
  std::vector<double> blocks(tp.T * tp.H), mine(tp.T * tp.me().n);
  for (int q = 0; q < tp.P; ++q) {
    counts[q] = static_cast<int>(tp.T * tp.hid[q].n);
    for (int64_t t = 0; t < tp.T; ++t)
      for (int64_t c = 0; c < tp.hid[q].n; ++c)
        blocks[tp.T * tp.hid[q].c0 + t * tp.hid[q].n + c] = partial[t * tp.H + tp.hid[q].c0 + c];
  }
  MPI_Reduce_scatter(blocks.data(), mine.data(), counts.data(), MPI_DOUBLE, MPI_SUM, tp.comm);
  return Vec(mine.begin(), mine.end());
}

// C[m,n] = sum_l A(i,l) B(l,j) in float64, with A(i,l) = A[i*as + l*al], B(l,j) = B[l*bs + j*bj]:
// one loop for X W, X^T dY and dY W^T.
std::vector<double> gemm(int64_t m, int64_t n, int64_t k, const Vec& A, int64_t as, int64_t al,
                         const Vec& B, int64_t bs, int64_t bj) {
  std::vector<double> C(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t l = 0; l < k; ++l) {
      const double a = A[i * as + l * al];
      for (int64_t j = 0; j < n; ++j) C[i * n + j] += a * B[l * bs + j * bj];
    }
  return C;
}

void sgd(Vec& w, const std::vector<double>& g, double lr) {
  for (size_t i = 0; i < w.size(); ++i) w[i] -= static_cast<float>(lr * g[i]);
}
void sgd(Vec& w, const Vec& g, double lr) { sgd(w, std::vector<double>(g.begin(), g.end()), lr); }

// A hidden-sharded norm with its own slice of gamma (and beta), through tpnorm: on its own
// (forward / backward) or fused with the residual add in front of it (add_forward / add_backward).
struct ShardedNorm {
  bool rms = false;
  Vec gamma, beta, h, mean, rstd, dgamma, dbeta;  // h: the normalized input, kept for backward
  ShardedNorm(bool r, int64_t n) : rms(r), gamma(n, 1.0f), beta(n, 0.0f), dgamma(n), dbeta(n) {}

  // y = Norm(in).
  Vec forward(Tp& tp, const Vec& in) {
    const int64_t T = tp.T, n = tp.me().n;
    h = in;
    prepare(T);
    Vec y(in.size());
    if (rms)
      tpnorm::rms_norm_forward(*tp.norm_comm, view(h.data(), Shape{T, n}), g(n),
                               view(y.data(), Shape{T, n}), view(rstd.data(), Shape{T}), tp.opt);
    else
      tpnorm::layer_norm_forward(*tp.norm_comm, view(h.data(), Shape{T, n}), g(n), b(n),
                                 view(y.data(), Shape{T, n}), view(mean.data(), Shape{T}),
                                 view(rstd.data(), Shape{T}), tp.opt);
    return y;
  }
  // Returns dL/din.
  Vec backward(Tp& tp, const Vec& dy) {
    const int64_t T = tp.T, n = tp.me().n;
    Vec dx(dy.size());
    if (rms)
      tpnorm::rms_norm_backward(*tp.norm_comm, view(dy.data(), Shape{T, n}),
                                view(h.data(), Shape{T, n}), g(n), view(rstd.data(), Shape{T}),
                                view(dx.data(), Shape{T, n}), view(dgamma.data(), Shape{n}),
                                tp.opt);
    else
      tpnorm::layer_norm_backward(
          *tp.norm_comm, view(dy.data(), Shape{T, n}), view(h.data(), Shape{T, n}), g(n),
          view(mean.data(), Shape{T}), view(rstd.data(), Shape{T}), view(dx.data(), Shape{T, n}),
          view(dgamma.data(), Shape{n}), view(dbeta.data(), Shape{n}), tp.opt);
    return dx;
  }

  // h = alpha*x + f (the new residual stream, kept in h), y = Norm(h): one fused call.
  Vec add_forward(Tp& tp, const Vec& x, const Vec& f, double alpha) {
    const int64_t T = tp.T, n = tp.me().n;
    h.resize(x.size());
    prepare(T);
    Vec y(x.size());
    const Shape s{T, n};
    if (rms)
      tpnorm::fused_add_rms_norm_forward(*tp.norm_comm, cview(x, s), cview(f, s), alpha, g(n),
                                         view(h.data(), s), view(y.data(), s),
                                         view(rstd.data(), Shape{T}), tp.opt);
    else
      tpnorm::fused_add_layer_norm_forward(
          *tp.norm_comm, cview(x, s), cview(f, s), alpha, g(n), b(n), view(h.data(), s),
          view(y.data(), s), view(mean.data(), Shape{T}), view(rstd.data(), Shape{T}), tp.opt);
    return y;
  }
  // Given dL/dy and dh_extra (dL/dh from h's other uses; empty: none), returns {dL/dx, dL/df}.
  std::pair<Vec, Vec> add_backward(Tp& tp, const Vec& dy, const Vec& dh_extra, double alpha) {
    const int64_t T = tp.T, n = tp.me().n;
    const Shape s{T, n};
    const tpnorm::TensorView extra = dh_extra.empty() ? tpnorm::TensorView{} : cview(dh_extra, s);
    Vec dx(dy.size()), df(dy.size());
    if (rms)
      tpnorm::fused_add_rms_norm_backward(
          *tp.norm_comm, cview(dy, s), extra, view(h.data(), s), g(n), view(rstd.data(), Shape{T}),
          alpha, view(dx.data(), s), view(df.data(), s), view(dgamma.data(), Shape{n}), tp.opt);
    else
      tpnorm::fused_add_layer_norm_backward(
          *tp.norm_comm, cview(dy, s), extra, view(h.data(), s), g(n), view(mean.data(), Shape{T}),
          view(rstd.data(), Shape{T}), alpha, view(dx.data(), s), view(df.data(), s),
          view(dgamma.data(), Shape{n}), view(dbeta.data(), Shape{n}), tp.opt);
    return {dx, df};
  }

  void step(double lr) {
    sgd(gamma, dgamma, lr);
    if (!rms) sgd(beta, dbeta, lr);
  }

 private:
  void prepare(int64_t T) {
    mean.assign(T, 0.0f);
    rstd.assign(T, 0.0f);
  }
  tpnorm::TensorView g(int64_t n) { return view(gamma.data(), Shape{n}); }
  tpnorm::TensorView b(int64_t n) { return view(beta.data(), Shape{n}); }
  // tpnorm's views are mutable; the inputs are only read.
  static tpnorm::TensorView cview(const Vec& v, Shape s) {
    return view(const_cast<float*>(v.data()), s);
  }
};

// Column-parallel W1 [H, F_p] + tanh, row-parallel W2 [F_p, H], hidden-sharded bias b2 [h_p].
struct TpMlp {
  int64_t Fp = 0;
  Vec W1, b1, W2, b2, u, a;  // u: gathered input [T, H]; a: activations [T, F_p]
  std::vector<double> dW1, db1, dW2, db2;

  TpMlp(const Tp& tp, int64_t F, int layer, double init_scale) {
    const Slice f = tp.exact ? Slice{0, F} : slice_of(F, tp.P, tp.rank);  // exact: all of F
    Fp = f.n;
    const auto w1 = normal(100 + layer, tp.H * F, init_scale / std::sqrt(double(tp.H)));
    const auto w2 = normal(200 + layer, F * tp.H, init_scale / std::sqrt(double(F)));
    for (int64_t i = 0; i < tp.H; ++i)
      for (int64_t j = 0; j < Fp; ++j) W1.push_back(static_cast<float>(w1[i * F + f.c0 + j]));
    W2.assign(w2.begin() + f.c0 * tp.H, w2.begin() + (f.c0 + Fp) * tp.H);
    b1.assign(Fp, 0.0f);
    b2.assign(tp.me().n, 0.0f);
  }

  Vec forward(const Tp& tp, const Vec& in) {
    const int64_t T = tp.T, H = tp.H;
    u = all_gather_hidden(tp, in);
    const auto pre = gemm(T, Fp, H, u, H, 1, W1, Fp, 1);
    a.resize(T * Fp);
    for (int64_t i = 0; i < T * Fp; ++i) a[i] = static_cast<float>(std::tanh(pre[i] + b1[i % Fp]));
    Vec z = reduce_scatter_hidden(tp, gemm(T, H, Fp, a, Fp, 1, W2, H, 1));
    for (size_t i = 0; i < z.size(); ++i) z[i] += b2[i % b2.size()];
    return z;
  }
  Vec backward(const Tp& tp, const Vec& dz) {
    const int64_t T = tp.T, H = tp.H, h = tp.me().n;
    const Vec dzf = all_gather_hidden(tp, dz);
    db2.assign(h, 0.0);
    for (int64_t i = 0; i < T * h; ++i) db2[i % h] += dz[i];
    dW2 = gemm(Fp, H, T, a, 1, Fp, dzf, H, 1);            // a^T dz
    const auto da = gemm(T, Fp, H, dzf, H, 1, W2, 1, H);  // dz W2^T
    Vec du(T * Fp);
    db1.assign(Fp, 0.0);
    for (int64_t i = 0; i < T * Fp; ++i) {
      du[i] = static_cast<float>(da[i] * (1.0 - double(a[i]) * a[i]));
      db1[i % Fp] += du[i];
    }
    dW1 = gemm(H, Fp, T, u, 1, H, du, Fp, 1);                                // u^T du
    return reduce_scatter_hidden(tp, gemm(T, H, Fp, du, Fp, 1, W1, 1, Fp));  // du W1^T
  }
  void step(double lr) {
    sgd(W1, dW1, lr);
    sgd(b1, db1, lr);
    sgd(W2, dW2, lr);
    sgd(b2, db2, lr);
  }
};

enum class Arch { kPre, kPost, kDeepNorm };

// The block stack. pre: norms[l] starts block l and norms[L] is the final norm; post and
// deepnorm: norms[l] ends block l.
struct Model {
  Arch arch;
  double alpha;
  std::vector<ShardedNorm> norms;
  std::vector<TpMlp> mlps;
  Model(const Tp& tp, Arch ar, bool rms, int64_t F, int layers)
      : arch(ar),
        alpha(ar == Arch::kDeepNorm
                  ? tpnorm::deepnorm_alpha(tpnorm::DeepNormStack::kEncoderOnly, layers, 0)
                  : 1.0) {
    const double init = ar == Arch::kDeepNorm
                            ? tpnorm::deepnorm_beta(tpnorm::DeepNormStack::kEncoderOnly, layers, 0)
                            : 1.0;
    for (int l = 0; l < layers; ++l) mlps.emplace_back(tp, F, l, init);
    norms.assign(layers + (ar == Arch::kPre ? 1 : 0), ShardedNorm(rms, tp.me().n));
  }

  Vec forward(Tp& tp, const Vec& x) {
    const size_t L = mlps.size();
    if (arch != Arch::kPre) {
      Vec h = x;
      for (size_t l = 0; l < L; ++l) h = norms[l].add_forward(tp, h, mlps[l].forward(tp, h), alpha);
      return h;
    }
    Vec y = norms[0].forward(tp, x);
    const Vec* h = &x;  // the residual stream entering block l
    for (size_t l = 0; l < L; ++l) {
      y = norms[l + 1].add_forward(tp, *h, mlps[l].forward(tp, y), 1.0);
      h = &norms[l + 1].h;
    }
    return y;
  }

  // Backward from dL/d(output); the gradient of the input x is not needed.
  void backward(Tp& tp, const Vec& dout) {
    const size_t L = mlps.size();
    if (arch != Arch::kPre) {
      Vec dh = dout;
      for (size_t l = L; l-- > 0;) {
        auto [dx, df] = norms[l].add_backward(tp, dh, {}, alpha);
        dh = mlps[l].backward(tp, df);
        for (size_t i = 0; i < dh.size(); ++i) dh[i] += dx[i];
      }
      return;
    }
    Vec dy = dout, extra;  // extra: dL/dh of block l+1's stream through its skip connection
    for (size_t l = L; l-- > 0;) {
      auto [dx, df] = norms[l + 1].add_backward(tp, dy, extra, 1.0);
      dy = mlps[l].backward(tp, df);
      extra = std::move(dx);
    }
    norms[0].backward(tp, dy);  // for norms[0]'s dgamma / dbeta
  }

  void step(double lr) {
    for (auto& n : norms) n.step(lr);
    for (auto& m : mlps) m.step(lr);
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Flags f(argc, argv);
  Tp tp;
  tp.comm = MPI_COMM_WORLD;
  MPI_Comm_rank(tp.comm, &tp.rank);
  MPI_Comm_size(tp.comm, &tp.P);
  tp.norm_comm = tpnorm::make_mpi_communicator(tp.comm);
  tp.T = static_cast<int64_t>(f.num("tokens", 16));
  tp.H = static_cast<int64_t>(f.num("hidden", 30));
  const int64_t F = static_cast<int64_t>(f.num("ffn", 64));
  const int layers = static_cast<int>(f.num("layers", 2)),
            steps = static_cast<int>(f.num("steps", 30));
  const double lr = f.num("lr", 0.05);
  const std::string arch_name = f.get("arch", "pre"), norm_name = f.get("norm", "layernorm");
  const Arch arch = arch_name == "post"       ? Arch::kPost
                    : arch_name == "deepnorm" ? Arch::kDeepNorm
                                              : Arch::kPre;
  const bool rms = norm_name == "rmsnorm";
  tp.exact = f.get("stats", "robust") == "exact";
  tp.opt.stats = tp.exact ? tpnorm::Stats::kExact : tpnorm::Stats::kRobust;
  for (int q = 0; q < tp.P; ++q) tp.hid.push_back(slice_of(tp.H, tp.P, q));
  const Slice me = tp.me();

  // Synthetic task: y[t,c] = tanh(x[t,c+1] - x[t,c]/2), which needs mixing across the hidden.
  const auto X = normal(1, tp.T * tp.H);
  Vec x, y;
  for (int64_t t = 0; t < tp.T; ++t)
    for (int64_t c = me.c0; c < me.c0 + me.n; ++c) {
      x.push_back(static_cast<float>(X[t * tp.H + c]));
      y.push_back(
          static_cast<float>(std::tanh(X[t * tp.H + (c + 1) % tp.H] - 0.5 * X[t * tp.H + c])));
    }

  Model model(tp, arch, rms, F, layers);
  if (tp.rank == 0)
    std::printf(
        "tp_transformer_block: %d ranks, arch %s, %s, %s statistics, T=%lld H=%lld "
        "F=%lld, %d layers\n",
        tp.P, arch_name.c_str(), norm_name.c_str(), tp.exact ? "exact" : "robust", (long long)tp.T,
        (long long)tp.H, (long long)F, layers);

  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    const Vec h = model.forward(tp, x);
    double loss = 0;
    Vec dh(h.size());
    const double n = double(tp.T * tp.H);
    for (size_t i = 0; i < h.size(); ++i) {
      loss += double(h[i] - y[i]) * (h[i] - y[i]) / n;
      dh[i] = static_cast<float>(2.0 * (h[i] - y[i]) / n);
    }
    if (tp.exact) {  // over the gathered stream in one order: the same sum at every P
      const Vec hf = all_gather_hidden(tp, h);
      loss = 0;
      for (int64_t t = 0; t < tp.T; ++t)
        for (int64_t c = 0; c < tp.H; ++c) {
          const auto yc = static_cast<float>(
              std::tanh(X[t * tp.H + (c + 1) % tp.H] - 0.5 * X[t * tp.H + c]));  // as y above
          loss += double(hf[t * tp.H + c] - yc) * (hf[t * tp.H + c] - yc) / n;
        }
    } else {
      MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, tp.comm);
    }
    losses.push_back(loss);
    if (tp.rank == 0) std::printf("step %3d  loss %.9f\n", step, loss);

    model.backward(tp, dh);
    model.step(lr);
  }
  const int status = finish_losses(f, losses, tp.rank);
  tp.norm_comm.reset();  // frees tpnorm's duplicate of the group before MPI_Finalize
  MPI_Finalize();
  return status;
}
