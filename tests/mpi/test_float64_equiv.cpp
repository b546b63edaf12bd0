// float64 storage (kernels/cpu/float64.cpp) at 2, 3 and 4 ranks: LayerNorm / RMSNorm with the
// hidden dim sharded, the fused residual add + LayerNorm, GroupNorm with channels sharded and
// SyncBatchNorm (NCHW and channels-last, running statistics) with the batch sharded, forward
// and backward, against a long double reference on the full data. Shards are uneven, some rank
// holds nothing (hidden 2, a batch of 2), and one row. The inputs are float64 values no float32
// holds, and the tolerance (1e-12 relative) is 4 orders below float32's epsilon: one float32
// rounding anywhere on the path fails. Refusals (Stats::kNaive / kExact, float32 gamma next to
// float64 x) are the same error on every rank, outputs untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "expect_error.h"
#include "harness.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

using Vec = std::vector<double>;
using LD = long double;
constexpr double kTol = 1e-12;
constexpr double kEps = 1e-5;

// Seeded values with full float64 mantissas (seed the same on every rank: the full tensors).
Vec values(unsigned seed, int64_t n, double scale = 1.0, double shift = 0.0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(0.0, 1.0);
  Vec v(static_cast<size_t>(n));
  for (double& e : v) e = shift + scale * d(g);
  return v;
}

// [start, start + count) of n items for this rank: the first n % P ranks one more.
void my_range(int64_t n, int64_t* start, int64_t* count) {
  const int64_t P = world_size(), r = world_rank(), q = n / P, e = n % P;
  *start = r * q + std::min(r, e);
  *count = q + (r < e ? 1 : 0);
}

// Columns [c0, c0 + nc) of every one of `outer` runs of `width` values (rows, or planes).
Vec cols(const Vec& v, int64_t outer, int64_t width, int64_t inner, int64_t c0, int64_t nc) {
  Vec out;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t c = c0; c < c0 + nc; ++c)
      for (int64_t i = 0; i < inner; ++i) out.push_back(v[(o * width + c) * inner + i]);
  return out;
}

TensorView tv(Vec& v, Shape s) { return {v.data(), DType::F64, s}; }

int64_t count_bad(const char* what, const Vec& got, const Vec& want) {
  EXPECT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= kTol * (1.0 + std::fabs(want[i])))) {
      if (bad++ < 3)
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i]
                      << " (diff " << got[i] - want[i] << ")";
    }
  return bad;
}

// Normalization of `m` groups of `k` values each, value(g, i), with scale(g, i) / shift(g, i)
// (gamma, beta) and gradient dy(g, i), in long double: y, dx, mean, rstd; centred or RMS.
struct NormRef {
  std::vector<LD> y, dx, mean, rstd, xhat;
};
template <class X, class G, class B, class D>
NormRef norm_ref(int64_t m, int64_t k, bool centered, X x, G gamma, B beta, D dy) {
  NormRef r;
  r.y.resize(m * k), r.dx.resize(m * k), r.xhat.resize(m * k), r.mean.resize(m), r.rstd.resize(m);
  for (int64_t g = 0; g < m; ++g) {
    LD s = 0, ss = 0;
    for (int64_t i = 0; i < k; ++i) s += x(g, i);
    const LD mu = centered ? s / k : 0;
    for (int64_t i = 0; i < k; ++i) ss += (x(g, i) - mu) * (x(g, i) - mu);
    const LD rs = 1 / std::sqrt(ss / k + kEps);
    r.mean[g] = mu, r.rstd[g] = rs;
    LD sg = 0, sgx = 0;
    for (int64_t i = 0; i < k; ++i) {
      const LD xh = (x(g, i) - mu) * rs, gg = dy(g, i) * gamma(g, i);
      r.xhat[g * k + i] = xh;
      r.y[g * k + i] = xh * gamma(g, i) + beta(g, i);
      sg += gg, sgx += gg * xh;
    }
    for (int64_t i = 0; i < k; ++i) {
      const LD xh = r.xhat[g * k + i], gg = dy(g, i) * gamma(g, i);
      r.dx[g * k + i] = rs * (gg - (centered ? sg / k : 0) - xh * sgx / k);
    }
  }
  return r;
}

Vec to_vec(const std::vector<LD>& v) { return Vec(v.begin(), v.end()); }

// --- LayerNorm / RMSNorm, and the fused add + LayerNorm -----------------------------------------

struct RowCase {
  int64_t rows, hidden;
  bool centered, fused;
};

class Float64Rows : public ::testing::TestWithParam<RowCase> {};

TEST_P(Float64Rows, MatchesLongDoubleReference) {
  const RowCase k = GetParam();
  const int64_t R = k.rows, H = k.hidden;
  int64_t c0, nc;
  my_range(H, &c0, &nc);
  const Vec X = values(1, R * H, 1.5, 0.25), F = values(2, R * H, 0.5);
  const Vec W = values(3, H, 0.3, 1.0), B = values(4, H, 0.3), DY = values(5, R * H);
  const double alpha = 0.75;
  Vec Hs(R * H);  // the fused op's h = alpha x + f
  for (int64_t i = 0; i < R * H; ++i) Hs[i] = k.fused ? alpha * X[i] + F[i] : X[i];

  Vec x = cols(X, R, H, 1, c0, nc), f = cols(F, R, H, 1, c0, nc), dy = cols(DY, R, H, 1, c0, nc);
  Vec w = cols(W, 1, H, 1, c0, nc), b = cols(B, 1, H, 1, c0, nc);
  Vec y(R * nc), h(R * nc), mean(R), rstd(R), dx(R * nc), dg(nc), db(nc), df(R * nc);
  const Shape s{R, nc};
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  NormOptions opt;
  opt.eps = kEps;
  opt.hidden_size = H;
  if (k.fused) {
    fused_add_layer_norm_forward(*world, tv(x, s), tv(f, s), alpha, tv(w, {nc}), tv(b, {nc}),
                                 tv(h, s), tv(y, s), tv(mean, {R}), tv(rstd, {R}), opt);
    fused_add_layer_norm_backward(*world, tv(dy, s), TensorView{}, tv(h, s), tv(w, {nc}),
                                  tv(mean, {R}), tv(rstd, {R}), alpha, tv(dx, s), tv(df, s),
                                  tv(dg, {nc}), tv(db, {nc}), opt);
  } else if (k.centered) {
    layer_norm_forward(*world, tv(x, s), tv(w, {nc}), tv(b, {nc}), tv(y, s), tv(mean, {R}),
                       tv(rstd, {R}), opt);
    layer_norm_backward(*world, tv(dy, s), tv(x, s), tv(w, {nc}), tv(mean, {R}), tv(rstd, {R}),
                        tv(dx, s), tv(dg, {nc}), tv(db, {nc}), opt);
  } else {
    rms_norm_forward(*world, tv(x, s), tv(w, {nc}), tv(y, s), tv(rstd, {R}), opt);
    rms_norm_backward(*world, tv(dy, s), tv(x, s), tv(w, {nc}), tv(rstd, {R}), tv(dx, s),
                      tv(dg, {nc}), opt);
  }

  const bool c = k.centered || k.fused;
  const NormRef ref = norm_ref(
      R, H, c, [&](int64_t g, int64_t i) -> LD { return Hs[g * H + i]; },
      [&](int64_t, int64_t i) -> LD { return W[i]; },
      [&](int64_t, int64_t i) -> LD { return c ? B[i] : 0; },
      [&](int64_t g, int64_t i) -> LD { return DY[g * H + i]; });
  Vec rdg(H, 0.0), rdb(H, 0.0);
  for (int64_t i = 0; i < H; ++i) {
    LD sg = 0, sb = 0;
    for (int64_t g = 0; g < R; ++g) sg += DY[g * H + i] * ref.xhat[g * H + i], sb += DY[g * H + i];
    rdg[i] = static_cast<double>(sg), rdb[i] = static_cast<double>(sb);
  }
  int64_t bad = count_bad("y", y, cols(to_vec(ref.y), R, H, 1, c0, nc));
  bad += count_bad("rstd", rstd, to_vec(ref.rstd));
  if (c) bad += count_bad("mean", mean, to_vec(ref.mean));
  // The fused backward's dx is the gradient of x: alpha times that of h (df).
  Vec want_dx = cols(to_vec(ref.dx), R, H, 1, c0, nc);
  if (k.fused) {
    bad += count_bad("h", h, cols(Hs, R, H, 1, c0, nc));
    bad += count_bad("df", df, want_dx);
    for (double& v : want_dx) v *= alpha;
  }
  bad += count_bad("dx", dx, want_dx);
  bad += count_bad("dgamma", dg, cols(rdg, 1, H, 1, c0, nc));
  if (c) bad += count_bad("dbeta", db, cols(rdb, 1, H, 1, c0, nc));
  EXPECT_EQ(sum_over_ranks(bad), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Float64Rows,
                         ::testing::Values(RowCase{5, 37, true, false}, RowCase{5, 37, false, false},
                                           RowCase{1, 2, true, false}, RowCase{3, 2, false, false},
                                           RowCase{4, 11, true, true}, RowCase{1, 2, true, true}));

// --- GroupNorm, channels sharded ---------------------------------------------------------------

TEST(Float64GroupNorm, MatchesLongDoubleReference) {
  const int64_t N = 2, C = 6, S = 5, G = 2, cpg = C / G;  // groups span ranks at 3 and 4 ranks
  int64_t c0, nc;
  my_range(C, &c0, &nc);
  const Vec X = values(6, N * C * S, 2.0, -0.5), DY = values(7, N * C * S);
  const Vec W = values(8, C, 0.3, 1.0), B = values(9, C, 0.3);
  Vec x = cols(X, N, C, S, c0, nc), dy = cols(DY, N, C, S, c0, nc);
  Vec w = cols(W, 1, C, 1, c0, nc), b = cols(B, 1, C, 1, c0, nc);
  Vec y(N * nc * S), dx(N * nc * S), mean(N * G), rstd(N * G), dg(nc), db(nc);
  const Shape s{N, nc, S};
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  const ChannelGroups cg{G, C, c0};
  NormOptions opt;
  opt.eps = kEps;
  group_norm_forward(*world, tv(x, s), cg, tv(w, {nc}), tv(b, {nc}), tv(y, s), tv(mean, {N, G}),
                     tv(rstd, {N, G}), opt);
  group_norm_backward(*world, tv(dy, s), tv(x, s), cg, tv(w, {nc}), tv(mean, {N, G}),
                      tv(rstd, {N, G}), tv(dx, s), tv(dg, {nc}), tv(db, {nc}), opt);
  // Group (n, g) holds channels [g cpg, (g+1) cpg) of sample n: element i of it is channel
  // g cpg + i / S, position i % S.
  auto at = [&](int64_t q, int64_t i) { return ((q / G) * C + (q % G) * cpg + i / S) * S + i % S; };
  const NormRef ref = norm_ref(
      N * G, cpg * S, true, [&](int64_t q, int64_t i) -> LD { return X[at(q, i)]; },
      [&](int64_t q, int64_t i) -> LD { return W[(q % G) * cpg + i / S]; },
      [&](int64_t q, int64_t i) -> LD { return B[(q % G) * cpg + i / S]; },
      [&](int64_t q, int64_t i) -> LD { return DY[at(q, i)]; });
  Vec ry(N * C * S), rdx(N * C * S), rdg(C, 0.0), rdb(C, 0.0);
  std::vector<LD> sg(C, 0), sb(C, 0);
  for (int64_t q = 0; q < N * G; ++q)
    for (int64_t i = 0; i < cpg * S; ++i) {
      const int64_t o = at(q, i), ch = (q % G) * cpg + i / S;
      ry[o] = static_cast<double>(ref.y[q * cpg * S + i]);
      rdx[o] = static_cast<double>(ref.dx[q * cpg * S + i]);
      sg[ch] += DY[o] * ref.xhat[q * cpg * S + i], sb[ch] += DY[o];
    }
  for (int64_t ch = 0; ch < C; ++ch) rdg[ch] = static_cast<double>(sg[ch]), rdb[ch] = sb[ch];
  int64_t bad = count_bad("y", y, cols(ry, N, C, S, c0, nc));
  bad += count_bad("mean", mean, to_vec(ref.mean));
  bad += count_bad("rstd", rstd, to_vec(ref.rstd));
  bad += count_bad("dx", dx, cols(rdx, N, C, S, c0, nc));
  bad += count_bad("dgamma", dg, cols(rdg, 1, C, 1, c0, nc));
  bad += count_bad("dbeta", db, cols(rdb, 1, C, 1, c0, nc));
  EXPECT_EQ(sum_over_ranks(bad), 0);
}

// --- SyncBatchNorm, batch sharded ---------------------------------------------------------------

struct BnCase {
  int64_t n, c, inner;
  bool channels_last;
};

class Float64BatchNorm : public ::testing::TestWithParam<BnCase> {};

TEST_P(Float64BatchNorm, MatchesLongDoubleReference) {
  const BnCase k = GetParam();
  const int64_t N = k.n, C = k.c, I = k.inner;
  int64_t n0, nn;
  my_range(N, &n0, &nn);
  // Full tensors in NCHW; (b, ch, s) at (b C + ch) I + s, or channels-last (b I + s) C + ch.
  const Vec X = values(10, N * C * I, 1.5, 3.0), DY = values(11, N * C * I);
  const Vec W = values(12, C, 0.3, 1.0), B = values(13, C, 0.3);
  auto off = [&](int64_t b, int64_t ch, int64_t s) {
    return k.channels_last ? (b * I + s) * C + ch : (b * C + ch) * I + s;
  };
  Vec x(X.begin() + n0 * C * I, X.begin() + (n0 + nn) * C * I);
  Vec dy(DY.begin() + n0 * C * I, DY.begin() + (n0 + nn) * C * I);
  Vec w = W, b = B, y(nn * C * I), dx(nn * C * I), sm(C), si(C), dg(C), db(C);
  Vec rm(C, 0.5), rv(C, 2.0);
  const Shape s = k.channels_last ? Shape{nn, I, C} : Shape{nn, C, I};
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  BatchNormOptions opt;
  opt.eps = kEps;
  opt.momentum = 0.1;
  opt.layout = k.channels_last ? Layout::kChannelsLast : Layout::kNCHW;
  int64_t tracked = 0;
  sync_batch_norm_forward(*world, tv(x, s), tv(w, {C}), tv(b, {C}), tv(rm, {C}), tv(rv, {C}),
                          &tracked, tv(y, s), tv(sm, {C}), tv(si, {C}), opt);
  sync_batch_norm_backward(*world, tv(dy, s), tv(x, s), tv(w, {C}), tv(sm, {C}), tv(si, {C}),
                           tv(dx, s), tv(dg, {C}), tv(db, {C}), opt);
  // Channel ch, element i = b I + s.
  const int64_t M = N * I;
  const NormRef ref = norm_ref(
      C, M, true, [&](int64_t ch, int64_t i) -> LD { return X[off(i / I, ch, i % I)]; },
      [&](int64_t ch, int64_t) -> LD { return W[ch]; },
      [&](int64_t ch, int64_t) -> LD { return B[ch]; },
      [&](int64_t ch, int64_t i) -> LD { return DY[off(i / I, ch, i % I)]; });
  Vec ry(N * C * I), rdx(N * C * I), rdg(C), rdb(C), rrm(C), rrv(C);
  for (int64_t ch = 0; ch < C; ++ch) {
    LD sg = 0, sb = 0, var = 0;
    for (int64_t i = 0; i < M; ++i) {
      const int64_t o = off(i / I, ch, i % I);
      ry[o] = static_cast<double>(ref.y[ch * M + i]);
      rdx[o] = static_cast<double>(ref.dx[ch * M + i]);
      var += (X[o] - ref.mean[ch]) * (X[o] - ref.mean[ch]);
      if (i / I >= n0 && i / I < n0 + nn) sg += DY[o] * ref.xhat[ch * M + i], sb += DY[o];
    }
    rdg[ch] = static_cast<double>(sg), rdb[ch] = static_cast<double>(sb);
    rrm[ch] = static_cast<double>(0.9L * 0.5L + 0.1L * ref.mean[ch]);
    rrv[ch] = static_cast<double>(0.9L * 2.0L + 0.1L * var / (M - 1));
  }
  auto mine = [&](const Vec& v) { return Vec(v.begin() + n0 * C * I, v.begin() + (n0 + nn) * C * I); };
  int64_t bad = count_bad("y", y, mine(ry));
  bad += count_bad("save_mean", sm, to_vec(ref.mean));
  bad += count_bad("save_invstd", si, to_vec(ref.rstd));
  bad += count_bad("running_mean", rm, rrm);
  bad += count_bad("running_var", rv, rrv);
  bad += count_bad("dx", dx, mine(rdx));
  bad += count_bad("dgamma (this rank's)", dg, rdg);
  bad += count_bad("dbeta (this rank's)", db, rdb);
  EXPECT_EQ(tracked, 1);
  EXPECT_EQ(sum_over_ranks(bad), 0);
}

// N = 2: a rank with no sample at 3 and 4 ranks; N = 5: uneven at 2-4.
INSTANTIATE_TEST_SUITE_P(Shapes, Float64BatchNorm,
                         ::testing::Values(BnCase{5, 3, 7, false}, BnCase{2, 4, 3, false},
                                           BnCase{5, 3, 4, true}, BnCase{2, 2, 1, true}));

// --- refusals -----------------------------------------------------------------------------------

TEST(Float64Refusals, SameErrorOnEveryRankOutputsUntouched) {
  const int64_t R = 2, h = 3;
  Vec x = values(14, R * h), y(R * h, -7.0), rstd(R, -7.0);
  std::vector<float> w32(h, 1.f);
  auto world = make_mpi_communicator(MPI_COMM_WORLD);
  for (Stats st : {Stats::kNaive, Stats::kExact}) {
    NormOptions opt;
    opt.stats = st;
    const std::string msg = error_of(
        [&] { rms_norm_forward(*world, tv(x, {R, h}), TensorView{}, tv(y, {R, h}),
                               tv(rstd, {R}), opt); },
        ErrorCode::kInvalidArgument);
    EXPECT_NE(msg.find("is fp64, which needs Stats::kRobust"), std::string::npos) << msg;
  }
  const std::string msg = error_of(
      [&] { rms_norm_forward(*world, tv(x, {R, h}), view(w32.data(), {h}), tv(y, {R, h}),
                             tv(rstd, {R})); },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("expected x's (fp64)"), std::string::npos) << msg;
  for (double v : y) EXPECT_EQ(v, -7.0);
  for (double v : rstd) EXPECT_EQ(v, -7.0);
}

}  // namespace
