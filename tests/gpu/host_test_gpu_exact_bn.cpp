// Host tests (no GPU needed) of what the CUDA kernels of Stats::kExact for SyncBatchNorm
// compute (kernels/cuda/exact_channels_math.h): the split of a channel over blocks, the two
// walks, and a rehearsal of the whole device path on the host. The rehearsal calls the
// header's functions the way kernels/cuda/exact_channels.cu does — 256 simulated threads per
// (channel, split) block, the threads' limbs added as int64 and normalized, the splits added
// per channel, the ranks' payloads added, the per-channel constants, the grid-stride apply —
// and compares every output bit for bit with the CPU op's kExact (y, saved and running
// statistics, dx, dgamma, dbeta; training and eval; NCHW and channels-last; several simulated
// ranks with uneven batches and a rank without samples; many splits per channel). What it
// cannot check: the CUDA launch, the block barriers and the device's conversions to
// fp16/bf16 (tests/gpu/test_gpu_exact_bn.cpp does, on a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "harness.h"
#include "kernels/cuda/exact_channels_math.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/communicator.h"

namespace {

using namespace tpnorm;
using namespace tpnorm::kernels::cuda;
using tpnorm_test::Buffer;

// ---- the split and the walks ----------------------------------------------------------------

TEST(ExactBnPlan, SplitsCoverEachChannelOnceWithinTheHeadroom) {
  const int64_t shapes[][3] = {{0, 5, 7},       {1, 1, 1},       {3, 13, 49},  {2, 2, 70000},
                               {1, 1, 1 << 27}, {4096, 2048, 1}, {7, 3, 1},    {64, 1, 12345},
                               {5, 0, 9},       {2, 1000000, 1}, {1, 1, 8191}, {1, 1, 8193}};
  for (const auto& s : shapes) {
    const BnExactPlan p = bn_exact_plan(s[0], s[1], s[2]);
    SCOPED_TRACE(std::to_string(s[0]) + "x" + std::to_string(s[1]) + "x" + std::to_string(s[2]));
    EXPECT_EQ(p.m, s[0] * s[2]);
    if (p.c == 0) {
      EXPECT_EQ(p.splits, 0);
      continue;
    }
    EXPECT_GE(p.splits, 1);
    EXPECT_LE(p.splits, kBnExactMaxSplits);
    EXPECT_LE(p.splits, exact::kMaxRanks);
    int64_t covered = 0;
    for (int64_t sp = 0; sp < p.splits; ++sp) {
      int64_t k0, k1;
      bn_split_range(p, sp, &k0, &k1);
      EXPECT_EQ(k0, covered) << "split " << sp;
      if (p.m > 0) {
        EXPECT_GT(k1, k0) << "empty split " << sp;
      }
      covered = k1;
    }
    EXPECT_EQ(covered, p.m);
    if (p.m >= kBnExactMinSplit * 2 && p.c * 2 <= kBnExactTargetBlocks) {
      EXPECT_GT(p.splits, 1) << "large channels go over several blocks";
    }
  }
  // One channel of 2^27 values: the most splits; many channels: one block each.
  EXPECT_EQ(bn_exact_plan(1, 1, 1 << 27).splits, kBnExactMaxSplits);
  EXPECT_EQ(bn_exact_plan(4096, 2048, 1).splits, 1);
  EXPECT_EQ(bn_exact_plan(0, 3, 5).splits, 1);  // no element: one block writes zeros
  EXPECT_EQ(bn_apply_blocks(0), 1);
  EXPECT_EQ(bn_apply_blocks(257), 2);
  EXPECT_EQ(bn_apply_blocks(int64_t{1} << 40), int64_t{1} << 16);
}

TEST(ExactBnPlan, ChannelWalkVisitsTheChannelsElementsInOrder) {
  const int64_t shapes[][3] = {{3, 4, 49},  {5, 3, 1},   {2, 2, 70000}, {9, 1, 300},
                               {1, 7, 256}, {4, 5, 255}, {3, 2, 257}};
  for (const auto& s : shapes)
    for (int nt : {1, 3, 32, 256}) {
      const BnExactPlan p = bn_exact_plan(s[0], s[1], s[2]);
      for (int64_t ch : {int64_t{0}, p.c - 1}) {
        std::vector<int> seen(static_cast<size_t>(p.m), 0);
        int64_t wrong = 0;
        for (int64_t sp = 0; sp < p.splits; ++sp) {
          int64_t k0, k1;
          bn_split_range(p, sp, &k0, &k1);
          for (int t = 0; t < nt; ++t) {
            int64_t k = k0 + t;
            for (BnChannelWalk w = BnChannelWalk::start(p, sp, t, nt); w.left > 0; w.next(p)) {
              const int64_t want = (k / p.inner * p.c + ch) * p.inner + k % p.inner;
              wrong += w.at(p, ch) != want || k >= k1;
              if (k < p.m) ++seen[static_cast<size_t>(k)];
              k += nt;
            }
            wrong += k < k1;  // the walk stopped early
          }
        }
        for (int v : seen) wrong += v != 1;
        EXPECT_EQ(wrong, 0) << s[0] << "x" << s[1] << "x" << s[2] << " threads " << nt << " ch "
                            << ch;
      }
    }
}

TEST(ExactBnPlan, FlatWalkTracksTheChannel) {
  const int64_t shapes[][2] = {{3, 49}, {13, 1}, {1, 1}, {8, 7}, {300, 1}, {5, 1000}, {2, 256}};
  for (const auto& s : shapes)
    for (int64_t step :
         {int64_t{1}, int64_t{7}, int64_t{256}, int64_t{3 * 256}, int64_t{65536 * 256}}) {
      const int64_t c = s[0], inner = s[1], total = 11 * c * inner + 3;
      int64_t wrong = 0;
      for (int64_t i0 : {int64_t{0}, int64_t{1}, step - 1, int64_t{5}})
        for (BnFlatWalk w = BnFlatWalk::start(i0, step, c, inner); w.i < total; w.next(c, inner))
          wrong += w.ch != (w.i / inner) % c || w.s != w.i % inner;
      EXPECT_EQ(wrong, 0) << "c " << c << " inner " << inner << " step " << step;
    }
}

// ---- the rehearsal ------------------------------------------------------------------------

uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// Values of a statistics buffer (float32 or float64) as doubles.
std::vector<double> doubles(Buffer& b) {
  std::vector<double> v(b.size());
  const void* p = b.view(Shape{static_cast<int64_t>(b.size())}).data;
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = b.dtype() == DType::F64 ? static_cast<const double*>(p)[i]
                                   : static_cast<double>(static_cast<const float*>(p)[i]);
  return v;
}
// Doubles stored in a statistics dtype, as store_fd does.
std::vector<double> stored(DType t, const std::vector<double>& v) {
  std::vector<double> r(v);
  if (t == DType::F32)
    for (double& d : r) d = static_cast<double>(static_cast<float>(d));
  return r;
}

// Bits that differ (NaN equals NaN).
int64_t differ(const std::vector<double>& got, const std::vector<double>& want, const char* what,
               std::string* first) {
  if (got.size() != want.size()) return *first = std::string(what) + ": sizes differ", 1;
  int64_t d = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    uint64_t a, b;
    std::memcpy(&a, &got[i], 8);
    std::memcpy(&b, &want[i], 8);
    if (a == b) continue;
    if (first->empty()) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s[%zu]: %.17g, want %.17g", what, i, got[i], want[i]);
      *first = buf;
    }
    ++d;
  }
  return d;
}
// Element values of T outputs, rounded through the storage dtype (float bits otherwise).
std::vector<double> as_dtype(DType t, const std::vector<float>& v) {
  const std::vector<float> r = Buffer(t, v).floats();
  return {r.begin(), r.end()};
}

// One rank's payload as exact_channels.cu makes it: block (ch, sp) of 256 threads, each
// thread's limbs (bn_thread_emax, group max, bn_thread_limbs), summed as int64 and
// normalized; then the splits summed and normalized per channel.
template <int N, class Load>
std::vector<int64_t> sim_payload(const BnExactPlan& p, Load load_of) {
  constexpr int K = N == 1 ? kBnFwdLimbs : kBnBwdLimbs;
  std::vector<int64_t> parts(static_cast<size_t>(p.c * p.splits * kBnFwdLimbs));
  for (int64_t ch = 0; ch < p.c; ++ch) {
    auto load = load_of(ch);
    for (int64_t sp = 0; sp < p.splits; ++sp) {
      int block[N] = {};
      for (int t = 0; t < kBnExactThreads; ++t) {
        int e[N];
        bn_thread_emax<N>(p, ch, sp, t, kBnExactThreads, load, e);
        for (int j = 0; j < N; ++j) block[j] = std::max(block[j], e[j]);
      }
      int64_t sum[K] = {};
      for (int t = 0; t < kBnExactThreads; ++t) {
        int64_t l[K];
        bn_thread_limbs<N>(p, ch, sp, t, kBnExactThreads, load, block, l);
        for (int i = 0; i < K; ++i) sum[i] += l[i];
      }
      bn_normalize(sum, K);
      std::copy(sum, sum + K, parts.begin() + (ch * p.splits + sp) * kBnFwdLimbs);
    }
  }
  std::vector<int64_t> out(static_cast<size_t>(p.c * K));
  for (int64_t ch = 0; ch < p.c; ++ch) {
    int64_t l[kBnFwdLimbs] = {};
    for (int64_t sp = 0; sp < p.splits; ++sp)
      for (int i = 0; i < K; ++i) l[i] += parts[(ch * p.splits + sp) * kBnFwdLimbs + i];
    bn_normalize(l, K);
    std::copy(l, l + K, out.begin() + ch * K);
  }
  return out;
}

// out[i] = f(i, channel of i) over the apply's grid-stride loop.
template <class F>
void sim_apply(int64_t total, int64_t c, int64_t inner, F f) {
  const int64_t step = bn_apply_blocks(total) * kBnExactThreads;
  for (int64_t i0 = 0; i0 < step; ++i0)
    for (BnFlatWalk w = BnFlatWalk::start(i0, step, c, inner); w.i < total; w.next(c, inner))
      f(w.i, w.ch);
}

struct Case {
  const char* name;
  int64_t c;
  std::vector<int64_t> spatial;
  std::vector<int64_t> per_rank;  // samples of each simulated rank
  bool channels_last = false;
  DType dt = DType::F32, stat = DType::F32;
  double offset = 0.0;
  bool bad = false;  // channel 0 holds an inf (its statistics NaN)
  bool cumulative = false;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ExactBnRehearsal : public ::testing::TestWithParam<Case> {};

TEST_P(ExactBnRehearsal, HostRunOfTheDeviceArithmeticGivesTheCpuBits) {
  const Case& cs = GetParam();
  const int64_t C = cs.c, N = std::accumulate(cs.per_rank.begin(), cs.per_rank.end(), int64_t{0});
  const int64_t inner =
      std::accumulate(cs.spatial.begin(), cs.spatial.end(), int64_t{1}, std::multiplies<int64_t>());
  const int64_t per = C * inner;
  const DType dt = cs.dt, sdt = cs.stat;
  std::vector<float> x = Buffer(dt, tpnorm_test::normal(41, 0, N * per, cs.offset, 1.5)).floats();
  if (cs.bad) x[cs.channels_last ? C : 1] = std::numeric_limits<float>::infinity();  // channel 0
  const std::vector<float> dy = Buffer(dt, tpnorm_test::normal(41, 1, N * per)).floats();
  const std::vector<float> gamma = Buffer(dt, tpnorm_test::normal(41, 2, C, 1.0, 0.5)).floats();
  const std::vector<float> beta = Buffer(dt, tpnorm_test::normal(41, 3, C)).floats();
  Shape xs;  // [n, C, *spatial] or [n, *spatial, C]
  auto shape = [&](int64_t n) {
    Shape s;
    s.ndim = 2 + static_cast<int>(cs.spatial.size());
    s.dims[0] = n;
    const int cd = cs.channels_last ? s.ndim - 1 : 1;
    s.dims[cd] = C;
    for (size_t i = 0; i < cs.spatial.size(); ++i) s.dims[(cd == 1 ? 2 : 1) + i] = cs.spatial[i];
    return s;
  };
  xs = shape(N);
  const Shape csh{C};
  BatchNormOptions o;
  o.stats = Stats::kExact;
  o.layout = cs.channels_last ? Layout::kChannelsLast : Layout::kNCHW;
  if (cs.cumulative) o.momentum = BatchNormOptions::cumulative();
  const int64_t tracked0 = 3;

  // The CPU op on the whole batch (its bits are the same at any world size: rel tests).
  auto cpu = make_single_communicator();
  Buffer bx(dt, x), bdy(dt, dy), bg(dt, gamma), bb(dt, beta), by(dt, N * per), bdx(dt, N * per),
      bdg(dt, C), bdb(dt, C);
  Buffer rm(sdt, std::vector<float>(C, 0.25f)), rv(sdt, std::vector<float>(C, 2.0f)), sm(sdt, C),
      si(sdt, C), sm_e(sdt, C), si_e(sdt, C), by_e(dt, N * per), bdx_e(dt, N * per), bdg_e(dt, C),
      bdb_e(dt, C);
  const std::vector<double> rm0 = doubles(rm), rv0 = doubles(rv);
  int64_t tracked = tracked0;
  sync_batch_norm_forward(*cpu, bx.view(xs), bg.view(csh), bb.view(csh), rm.view(csh), rv.view(csh),
                          &tracked, by.view(xs), sm.view(csh), si.view(csh), o);
  sync_batch_norm_backward(*cpu, bdy.view(xs), bx.view(xs), bg.view(csh), sm.view(csh),
                           si.view(csh), bdx.view(xs), bdg.view(csh), bdb.view(csh), o);
  BatchNormOptions oe = o;
  oe.training = false;
  sync_batch_norm_forward(*cpu, bx.view(xs), bg.view(csh), bb.view(csh), rm.view(csh), rv.view(csh),
                          &tracked, by_e.view(xs), sm_e.view(csh), si_e.view(csh), oe);
  sync_batch_norm_backward(*cpu, bdy.view(xs), bx.view(xs), bg.view(csh), sm_e.view(csh),
                           si_e.view(csh), bdx_e.view(xs), bdg_e.view(csh), bdb_e.view(csh), oe);
  const std::vector<double> smean = doubles(sm), sinv = doubles(si);

  // The device path, rank by rank. Both layouts hold a sample's values contiguously.
  const int P = static_cast<int>(cs.per_rank.size());
  std::vector<int64_t> b0(P + 1, 0);
  for (int r = 0; r < P; ++r) b0[r + 1] = b0[r] + cs.per_rank[r];
  auto plan = [&](int r) {
    const int64_t n = cs.per_rank[r];
    return cs.channels_last ? bn_exact_plan(n * inner, C, 1) : bn_exact_plan(n, C, inner);
  };
  // Forward partials, summed over ranks (the collective), the global count.
  std::vector<int64_t> fwd(static_cast<size_t>(C * kBnFwdLimbs), 0);
  for (int r = 0; r < P; ++r) {
    const float* xr = x.data() + b0[r] * per;
    const auto pay = sim_payload<1>(plan(r), [&](int64_t) {
      return [=](int64_t at, uint32_t(&u)[1]) { u[0] = bits(xr[at]); };
    });
    for (size_t i = 0; i < fwd.size(); ++i) fwd[i] += pay[i];
  }
  const auto n = static_cast<uint64_t>(N * inner);
  const double m = cs.cumulative ? 1.0 / static_cast<double>(tracked0 + 1) : o.momentum;
  std::vector<double> g_mean(C), g_inv(C), g_rm(rm0), g_rv(rv0), e_mean(C), e_inv(C);
  std::vector<BnFwdConsts> kf(C), ke(C);
  for (int64_t ch = 0; ch < C; ++ch) {
    double var;
    bn_exact_moments(fwd.data() + ch * kBnFwdLimbs, n, &g_mean[ch], &var);
    bn_update_running(g_mean[ch], var, static_cast<double>(n), m, &g_rm[ch], &g_rv[ch]);
    g_inv[ch] = bn_invstd(var, o.eps);
    kf[ch] = bn_fwd_consts(g_mean[ch], g_inv[ch], gamma[ch], beta[ch]);
  }
  g_rm = stored(sdt, g_rm);
  g_rv = stored(sdt, g_rv);
  for (int64_t ch = 0; ch < C; ++ch) {  // eval: from the updated running statistics
    e_mean[ch] = g_rm[ch];
    e_inv[ch] = bn_invstd(g_rv[ch], o.eps);
    ke[ch] = bn_fwd_consts(e_mean[ch], e_inv[ch], gamma[ch], beta[ch]);
  }
  const int64_t cl_inner = cs.channels_last ? 1 : inner;
  std::vector<float> y(N * per), ye(N * per), dx(N * per), dxe(N * per);
  for (int r = 0; r < P; ++r) {
    const int64_t o0 = b0[r] * per, total = cs.per_rank[r] * per;
    sim_apply(total, C, cl_inner, [&](int64_t i, int64_t ch) {
      y[o0 + i] = bn_exact_y(x[o0 + i], kf[ch]);
      ye[o0 + i] = bn_exact_y(x[o0 + i], ke[ch]);
    });
  }
  // Backward partials with the saved statistics (the CPU's, as the backward's inputs).
  const std::vector<double> smean_e = doubles(sm_e), sinv_e = doubles(si_e);
  std::vector<int64_t> bwd(static_cast<size_t>(C * kBnBwdLimbs), 0);
  std::vector<std::vector<int64_t>> local(P), local_e(P);
  for (int r = 0; r < P; ++r) {
    const float* xr = x.data() + b0[r] * per;
    const float* dyr = dy.data() + b0[r] * per;
    auto terms = [&](const std::vector<double>& mean) {
      return [&, xr, dyr](int64_t ch) {
        float mh, mt;
        bn_split_mean(mean[ch], &mh, &mt);
        return [=](int64_t at, uint32_t(&u)[2]) {
          float a, b;
          bn_bwd_terms(dyr[at], xr[at], mh, mt, &a, &b);
          u[0] = bits(a);
          u[1] = bits(b);
        };
      };
    };
    local[r] = sim_payload<2>(plan(r), terms(smean));
    local_e[r] = sim_payload<2>(plan(r), terms(smean_e));
    for (size_t i = 0; i < bwd.size(); ++i) bwd[i] += local[r][i];
  }
  std::vector<BnBwdConsts> kb(C), kbe(C);
  for (int64_t ch = 0; ch < C; ++ch) {
    double s0, s1;
    bn_exact_backward_sums(bwd.data() + ch * kBnBwdLimbs, n, &s0, &s1);
    kb[ch] = bn_bwd_consts(smean[ch], sinv[ch], gamma[ch], true, s0, s1);
    kbe[ch] = bn_bwd_consts(smean_e[ch], sinv_e[ch], gamma[ch], false, 0.0, 0.0);
  }
  for (int r = 0; r < P; ++r) {
    const int64_t o0 = b0[r] * per, total = cs.per_rank[r] * per;
    sim_apply(total, C, cl_inner, [&](int64_t i, int64_t ch) {
      dx[o0 + i] = bn_exact_dx(dy[o0 + i], x[o0 + i], kb[ch]);
      dxe[o0 + i] = bn_exact_dx(dy[o0 + i], x[o0 + i], kbe[ch]);
    });
  }

  std::string first;
  int64_t d = 0;
  auto out = [&](Buffer& b) { return as_dtype(dt, b.floats()); };
  d += differ(as_dtype(dt, y), out(by), "y", &first);
  d += differ(stored(sdt, g_mean), smean, "save_mean", &first);
  d += differ(stored(sdt, g_inv), sinv, "save_invstd", &first);
  d += differ(g_rm, doubles(rm), "running_mean", &first);
  d += differ(g_rv, doubles(rv), "running_var", &first);
  d += differ(as_dtype(dt, ye), out(by_e), "y (eval)", &first);
  d += differ(stored(sdt, e_mean), smean_e, "save_mean (eval)", &first);
  d += differ(stored(sdt, e_inv), sinv_e, "save_invstd (eval)", &first);
  d += differ(as_dtype(dt, dx), out(bdx), "dx", &first);
  d += differ(as_dtype(dt, dxe), out(bdx_e), "dx (eval)", &first);
  // dgamma / dbeta: each rank's own sums. At one rank, the CPU's; at several, the CPU's
  // backward over that rank's samples alone with the same saved statistics (its dgamma /
  // dbeta are that rank's sums).
  for (int r = 0; r < P; ++r)
    for (bool train : {true, false}) {
      const std::vector<int64_t>& l = train ? local[r] : local_e[r];
      const std::vector<double>& inv = train ? sinv : sinv_e;
      std::vector<float> dg(C), db(C);
      for (int64_t ch = 0; ch < C; ++ch) {
        double s0, s1;
        bn_exact_backward_sums(l.data() + ch * kBnBwdLimbs, 1, &s0, &s1);
        dg[ch] = bn_dgamma(inv[ch], s1);
        db[ch] = static_cast<float>(s0);
      }
      Buffer wg(dt, C), wb(dt, C);
      if (P == 1) {
        wg = train ? bdg : bdg_e;
        wb = train ? bdb : bdb_e;
      } else {
        const int64_t nr = cs.per_rank[r];
        const std::vector<float> xr(x.begin() + b0[r] * per, x.begin() + b0[r + 1] * per),
            dyr(dy.begin() + b0[r] * per, dy.begin() + b0[r + 1] * per);
        Buffer rx(dt, xr), rdy(dt, dyr), rdx(dt, nr * per);
        Buffer& smb = train ? sm : sm_e;
        Buffer& sib = train ? si : si_e;
        sync_batch_norm_backward(*cpu, rdy.view(shape(nr)), rx.view(shape(nr)), bg.view(csh),
                                 smb.view(csh), sib.view(csh), rdx.view(shape(nr)), wg.view(csh),
                                 wb.view(csh), train ? o : oe);
      }
      const std::string tag = std::string(train ? "" : " (eval)") + " rank " + std::to_string(r);
      d += differ(as_dtype(dt, dg), out(wg), ("dgamma" + tag).c_str(), &first);
      d += differ(as_dtype(dt, db), out(wb), ("dbeta" + tag).c_str(), &first);
    }
  EXPECT_EQ(d, 0) << "first: " << first;
  EXPECT_EQ(tracked, tracked0 + 1);
  if (cs.bad) {
    EXPECT_TRUE(std::isnan(smean[0]));
  }
}

const Case kCases[] = {
    {"c3_7x7_nchw", 3, {7, 7}, {5}},
    {"c3_7x7_channels_last", 3, {7, 7}, {5}, true},
    {"c13_nospatial_3ranks_empty", 13, {}, {4, 0, 3}},
    {"c13_nospatial_channels_last", 13, {}, {2, 5}, true},
    {"c5_one_sample_4ranks", 5, {3, 11}, {1, 0, 0, 0}},
    {"c2_70000_splits", 2, {70000}, {1, 2}, false, DType::F32, DType::F32, 1e4},
    {"c2_70000_splits_channels_last", 2, {70000}, {2, 1}, true},
    {"c6_9x9_bf16_f64stats_offset1e6", 6, {9, 9}, {3, 2}, false, DType::BF16, DType::F64, 1e6},
    {"c7_5_fp16_cumulative", 7, {5}, {2, 3, 1}, true, DType::F16, DType::F32, 0.0, false, true},
    {"c64_3x3_f64stats_channels_last", 64, {3, 3}, {3, 4}, true, DType::F32, DType::F64, 3.0},
    {"c4_6_bad", 4, {6}, {2, 2}, false, DType::F32, DType::F32, 0.0, true},
};

INSTANTIATE_TEST_SUITE_P(Cases, ExactBnRehearsal, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

}  // namespace
