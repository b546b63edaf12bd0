// sync_bn_convnet.cpp — a small data-parallel conv net with tpnorm's SyncBatchNorm, trained
// with SGD on a synthetic regression task at P ranks.
//
//   x [N, Ci, S, S] -> conv3x3 -> SyncBN -> ReLU -> conv3x3 -> SyncBN -> ReLU -> mean over
//   space -> linear -> MSE against targets [N, K]
//
// Data parallelism: rank p holds samples [n0_p, n0_p + n_p) of the global batch (uneven splits
// allowed) and a full replica of the parameters. SyncBatchNorm makes the batch statistics those
// of the GLOBAL batch, so the forward and backward are those of one process on the concatenated
// batch; the local parameter gradients (including SyncBN's dgamma / dbeta, which tpnorm returns
// as this rank's sums) are then summed in ONE MPI_Allreduce on the caller's communicator, as a
// DP framework would. So a run at P ranks trains the same model as a run at 1 rank, up to the
// order of floating-point sums. After training, one eval-mode forward (running statistics, no
// communication in the norms) adds the eval loss as the last logged value: it checks that the
// running statistics agree as well.
//
// Flags: --batch --steps --lr, and --write/--check/--tol (see ../common/loss_log.h).
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "common/loss_log.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/mpi.h"

using namespace tpnorm_example;
using tpnorm::Shape;
using tpnorm::view;
using Vec = std::vector<float>;

namespace {

constexpr int64_t kS = 6, kCi = 2, kC = 4, kK = 3;  // image side, in/hidden channels, outputs

// 3x3 convolution with zero padding 1, [n, ci, S, S] -> [n, co, S, S]: calls f(out, in, w)
// with the flat indices of every product term, so forward, dW and dX share one loop.
template <class F>
void conv_terms(int64_t n, int64_t ci, int64_t co, F&& f) {
  for (int64_t b = 0; b < n; ++b)
    for (int64_t o = 0; o < co; ++o)
      for (int64_t c = 0; c < ci; ++c)
        for (int64_t i = 0; i < kS; ++i)
          for (int64_t j = 0; j < kS; ++j)
            for (int64_t di = 0; di < 3; ++di)
              for (int64_t dj = 0; dj < 3; ++dj) {
                const int64_t si = i + di - 1, sj = j + dj - 1;
                if (si < 0 || sj < 0 || si >= kS || sj >= kS) continue;
                f(((b * co + o) * kS + i) * kS + j, ((b * ci + c) * kS + si) * kS + sj,
                  ((o * ci + c) * 3 + di) * 3 + dj);
              }
}

// conv -> SyncBN -> ReLU, keeping what the backward needs.
struct ConvBnRelu {
  int64_t ci, co;
  Vec w, gamma, beta, run_mean, run_var, x, z, save_mean, save_invstd, y;
  std::vector<double> dw;
  Vec dgamma, dbeta;
  int64_t batches = 0;

  ConvBnRelu(int64_t in, int64_t out, uint64_t seed)
      : ci(in),
        co(out),
        gamma(out, 1.0f),
        beta(out, 0.0f),
        run_mean(out, 0.0f),
        run_var(out, 1.0f),
        save_mean(out),
        save_invstd(out),
        dgamma(out),
        dbeta(out) {
    const auto v = normal(seed, out * in * 9, 1.0 / std::sqrt(9.0 * in));
    w.assign(v.begin(), v.end());
  }

  Vec forward(tpnorm::Communicator& comm, const Vec& in, int64_t n, bool training) {
    x = in;
    std::vector<double> acc(n * co * kS * kS, 0.0);
    conv_terms(n, ci, co, [&](int64_t o, int64_t i, int64_t k) { acc[o] += double(w[k]) * x[i]; });
    z.assign(acc.begin(), acc.end());
    y.assign(z.size(), 0.0f);
    tpnorm::BatchNormOptions opt;
    opt.training = training;
    const Shape s{n, co, kS, kS}, c{co};
    tpnorm::sync_batch_norm_forward(comm, view(z.data(), s), view(gamma.data(), c),
                                    view(beta.data(), c), view(run_mean.data(), c),
                                    view(run_var.data(), c), &batches, view(y.data(), s),
                                    view(save_mean.data(), c), view(save_invstd.data(), c), opt);
    for (auto& e : y) e = e > 0 ? e : 0.0f;
    return y;
  }

  // dy: gradient at the ReLU output; returns the gradient at this layer's input.
  Vec backward(tpnorm::Communicator& comm, Vec dy, int64_t n) {
    for (size_t i = 0; i < dy.size(); ++i) dy[i] = y[i] > 0 ? dy[i] : 0.0f;
    Vec dz(dy.size());
    const Shape s{n, co, kS, kS}, c{co};
    tpnorm::sync_batch_norm_backward(comm, view(dy.data(), s), view(z.data(), s),
                                     view(gamma.data(), c), view(save_mean.data(), c),
                                     view(save_invstd.data(), c), view(dz.data(), s),
                                     view(dgamma.data(), c), view(dbeta.data(), c));
    dw.assign(w.size(), 0.0);
    std::vector<double> dx(x.size(), 0.0);
    conv_terms(n, ci, co, [&](int64_t o, int64_t i, int64_t k) {
      dw[k] += double(dz[o]) * x[i];
      dx[i] += double(dz[o]) * w[k];
    });
    return Vec(dx.begin(), dx.end());
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Flags f(argc, argv);
  int rank = 0, P = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  auto comm = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
  const int64_t N = static_cast<int64_t>(f.num("batch", 7));
  const int steps = static_cast<int>(f.num("steps", 30));
  const double lr = f.num("lr", 0.1);
  const Slice me = slice_of(N, P, rank);
  const int64_t n = me.n;

  // Global batch from seeds; targets depend on both channels and on position.
  const auto X = normal(1, N * kCi * kS * kS);
  const int64_t img = kCi * kS * kS;
  const Vec x(X.begin() + me.c0 * img, X.begin() + (me.c0 + n) * img);
  std::vector<double> target(n * kK);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t k = 0; k < kK; ++k) {
      double s = 0;
      for (int64_t i = 0; i < img; ++i) s += x[b * img + i] * std::sin(0.1 * (k + 1) * i);
      target[b * kK + k] = std::tanh(0.2 * s);
    }

  ConvBnRelu l1(kCi, kC, 11), l2(kC, kC, 12);
  const auto v = normal(13, kK * kC, 0.5);
  Vec V(v.begin(), v.end()), e(kK, 0.0f);
  if (rank == 0)
    std::printf("sync_bn_convnet: %d ranks, global batch %lld, this rank %lld samples\n", P,
                (long long)N, (long long)n);

  std::vector<double> losses;
  for (int step = 0; step <= steps; ++step) {
    const bool training = step < steps;  // the last pass is the eval-mode forward
    const Vec h = l2.forward(*comm, l1.forward(*comm, x, n, training), n, training);
    Vec pooled(n * kC), dout(n * kK);
    for (size_t i = 0; i < h.size(); ++i) pooled[i / (kS * kS)] += h[i] / float(kS * kS);
    double loss = 0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t k = 0; k < kK; ++k) {
        double o = e[k];
        for (int64_t c = 0; c < kC; ++c) o += double(V[k * kC + c]) * pooled[b * kC + c];
        const double d = o - target[b * kK + k];
        loss += d * d / double(N * kK);
        dout[b * kK + k] = static_cast<float>(2.0 * d / double(N * kK));
      }
    MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    losses.push_back(loss);
    if (rank == 0) std::printf("%s %3d  loss %.9f\n", training ? "step" : "eval", step, loss);
    if (!training) break;

    // Backward: local gradients, then one all-reduce of all of them (data parallelism).
    std::vector<double> dV(kK * kC, 0.0), de(kK, 0.0);
    Vec dh(h.size());
    for (int64_t b = 0; b < n; ++b)
      for (int64_t k = 0; k < kK; ++k) {
        de[k] += dout[b * kK + k];
        for (int64_t c = 0; c < kC; ++c)
          dV[k * kC + c] += double(dout[b * kK + k]) * pooled[b * kC + c];
      }
    for (size_t i = 0; i < dh.size(); ++i) {
      const int64_t b = i / (kC * kS * kS), c = (i / (kS * kS)) % kC;
      double g = 0;
      for (int64_t k = 0; k < kK; ++k) g += double(dout[b * kK + k]) * V[k * kC + c];
      dh[i] = static_cast<float>(g / double(kS * kS));
    }
    l1.backward(*comm, l2.backward(*comm, dh, n), n);

    std::vector<double> grads;
    std::vector<Vec*> params;
    auto pack = [&](Vec& p, auto&& g) {
      params.push_back(&p);
      grads.insert(grads.end(), g.begin(), g.end());
    };
    for (ConvBnRelu* l : {&l1, &l2}) {
      pack(l->w, l->dw);
      pack(l->gamma, l->dgamma);
      pack(l->beta, l->dbeta);
    }
    pack(V, dV);
    pack(e, de);
    MPI_Allreduce(MPI_IN_PLACE, grads.data(), static_cast<int>(grads.size()), MPI_DOUBLE, MPI_SUM,
                  MPI_COMM_WORLD);
    size_t at = 0;
    for (Vec* p : params)
      for (auto& w : *p) w -= static_cast<float>(lr * grads[at++]);
  }
  const int status = finish_losses(f, losses, rank);
  comm.reset();  // frees tpnorm's duplicate of MPI_COMM_WORLD before MPI_Finalize
  MPI_Finalize();
  return status;
}
