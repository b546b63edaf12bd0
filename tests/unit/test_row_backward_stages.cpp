// The row backward's two stages at P > 1 (kernels/cpu/row_norm.h): dgamma/dbeta summed by the
// partial while it reads x and dy for the row sums (RowNormArgs::params_in_partial, what the
// row norms do) against the same sums made by the apply (what the fused residual norms and the
// batched op do): the row sums, dx, dgamma and dbeta must be the same bits, whole calls and
// chunked ones (chunks of a multiple of 16 rows, as the chunk rule makes), 1 and 2 threads,
// odd shapes, every storage / statistics type; and both against a float64 reference
// (fp32: 2e-5 relative + 2e-5 absolute per element, with the stats as given, n = h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/row_norm.h"

namespace kc = tpnorm::kernels::cpu;
using tpnorm::from_float;
using tpnorm::to_float;

namespace {

struct Case {
  int64_t rows, h;
  bool centered, gamma, params;
  int threads;
  int64_t chunk;  // rows per chunk, 0: the whole call
  float offset;
};

template <class T, class P, class W>
struct Outputs {
  std::vector<W> stats;
  std::vector<T> dx;
  std::vector<P> dgamma, dbeta;
};

template <class T, class P, class W, class S>
struct Data {
  std::vector<T> x, dy;
  std::vector<P> gamma;
  std::vector<S> mean, rstd;
  Data(const Case& c, std::mt19937& gen) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < c.rows * c.h; ++i) x.push_back(from_float<T>(c.offset + nd(gen)));
    for (int64_t i = 0; i < c.rows * c.h; ++i) dy.push_back(from_float<T>(nd(gen)));
    for (int64_t j = 0; j < c.h; ++j) gamma.push_back(from_float<P>(1 + 0.1f * nd(gen)));
    for (int64_t r = 0; r < c.rows; ++r) {
      mean.push_back(static_cast<S>(c.offset + 0.01f * nd(gen)));
      rstd.push_back(static_cast<S>(1.0 / (1.0 + 0.1 * std::abs(nd(gen)))));
    }
  }
};

// Partials over the call (or its chunks, in order), then applies: one rank's two stages with
// the statistics as given (the sum over ranks of one rank is its own).
template <class T, class P, class W, class S>
Outputs<T, P, W> run(const Case& c, const Data<T, P, W, S>& d, bool in_partial) {
  const int k = c.centered ? 2 : 1;
  Outputs<T, P, W> o;
  o.stats.assign(static_cast<size_t>(k * c.rows), W(0));
  o.dx.assign(static_cast<size_t>(c.rows * c.h), from_float<T>(0.f));
  o.dgamma.assign(static_cast<size_t>(c.h), from_float<P>(0.f));
  o.dbeta = o.dgamma;
  auto args = [&](int64_t r0, int64_t r1) {
    kc::RowNormArgs a;
    a.rows = r1 - r0;
    a.h = c.h;
    a.centered = c.centered;
    a.threads = c.threads;
    a.row0 = r0;
    a.call_rows = c.chunk ? c.rows : 0;
    a.params_in_partial = in_partial && c.params;
    a.param_last = r1 == c.rows;
    return a;
  };
  std::vector<double> acc(kc::row_param_acc_size(args(0, c.rows)), 0.0);
  const P* gamma = c.gamma ? d.gamma.data() : nullptr;
  const S* mean = c.centered ? d.mean.data() : nullptr;
  const int64_t step = c.chunk ? c.chunk : std::max<int64_t>(1, c.rows);
  for (int stage = 0; stage < 2; ++stage)
    for (int64_t r0 = 0; r0 < c.rows; r0 += step) {
      const int64_t r1 = std::min(c.rows, r0 + step);
      kc::RowNormArgs a = args(r0, r1);
      if (c.chunk || a.params_in_partial) a.param_acc = acc.data();
      const size_t e = static_cast<size_t>(r0 * c.h);
      if (stage == 0)
        kc::row_partial_backward<T, P, W, S>(a, d.dy.data() + e, d.x.data() + e, gamma,
                                             mean ? mean + r0 : nullptr, d.rstd.data() + r0,
                                             o.stats.data() + k * r0);
      else
        kc::row_apply_backward<T, P, W, S>(
            a, d.dy.data() + e, d.x.data() + e, gamma, mean ? mean + r0 : nullptr,
            d.rstd.data() + r0, o.stats.data() + k * r0, static_cast<double>(c.h),
            o.dx.data() + e, c.params ? o.dgamma.data() : nullptr,
            c.params && c.centered ? o.dbeta.data() : nullptr);
    }
  return o;
}

template <class V>
bool same_bits(const std::vector<V>& a, const std::vector<V>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(V)) == 0;
}

template <class T, class P, class W, class S>
void expect_same(const Case& c, std::mt19937& gen) {
  const Data<T, P, W, S> d(c, gen);
  const Outputs<T, P, W> apply = run(c, d, false), partial = run(c, d, true);
  const std::string what = "rows " + std::to_string(c.rows) + " h " + std::to_string(c.h) +
                           (c.centered ? " LayerNorm" : " RMSNorm") + " gamma " +
                           std::to_string(c.gamma) + " params " + std::to_string(c.params) +
                           " threads " + std::to_string(c.threads) + " chunk " +
                           std::to_string(c.chunk);
  EXPECT_TRUE(same_bits(apply.stats, partial.stats)) << what;
  EXPECT_TRUE(same_bits(apply.dx, partial.dx)) << what;
  EXPECT_TRUE(same_bits(apply.dgamma, partial.dgamma)) << what;
  EXPECT_TRUE(same_bits(apply.dbeta, partial.dbeta)) << what;
}

TEST(RowBackwardStages, ParamsInThePartialAreTheApplysBits) {
  std::mt19937 gen(20261201);
  std::uniform_int_distribution<int> rows(1, 150), cols(1, 1100), coin(0, 1), type(0, 4);
  for (int i = 0; i < 160; ++i) {
    Case c{rows(gen), cols(gen),        coin(gen) == 1,
           coin(gen) == 1, i % 6 != 0, 1 + coin(gen),
           coin(gen) ? 16 * (1 + rows(gen) % 4) : 0, coin(gen) ? 100.f : 0.f};
    if (i % 40 == 0) c.h = 4099;  // more than one block of columns, a tail
    switch (type(gen)) {
      case 0: expect_same<float, float, double, float>(c, gen); break;
      case 1: expect_same<float, float, double, double>(c, gen); break;
      case 2: expect_same<float, float, float, float>(c, gen); break;
      case 3: expect_same<tpnorm::bf16, float, double, float>(c, gen); break;
      default: expect_same<tpnorm::f16, tpnorm::f16, double, float>(c, gen); break;
    }
  }
}

TEST(RowBackwardStages, AgreeWithAFloat64Reference) {
  std::mt19937 gen(14);
  for (const Case& c : {Case{37, 515, true, true, true, 1, 16, 0.f},
                        Case{64, 1000, true, false, true, 2, 0, 100.f},
                        Case{19, 77, false, true, true, 2, 16, 0.f},
                        Case{1, 3, false, false, true, 1, 0, 0.f}}) {
    const Data<float, float, double, float> d(c, gen);
    const Outputs<float, float, double> o = run(c, d, true);
    std::vector<double> dg(static_cast<size_t>(c.h), 0.0), db = dg;
    for (int64_t r = 0; r < c.rows; ++r) {
      const double mean = c.centered ? d.mean[r] : 0.0, rs = d.rstd[r];
      double s1 = 0, s2 = 0;
      std::vector<double> xh(static_cast<size_t>(c.h)), g = xh;
      for (int64_t j = 0; j < c.h; ++j) {
        const double dy = d.dy[r * c.h + j];
        xh[j] = (d.x[r * c.h + j] - mean) * rs;
        g[j] = c.gamma ? dy * d.gamma[j] : dy;
        s1 += g[j];
        s2 += g[j] * xh[j];
        dg[j] += dy * xh[j];
        db[j] += dy;
      }
      const double n = static_cast<double>(c.h), c1 = c.centered ? s1 / n : 0.0, c2 = s2 / n;
      for (int64_t j = 0; j < c.h; ++j) {
        const double want = rs * (g[j] - c1 - xh[j] * c2);
        EXPECT_NEAR(o.dx[r * c.h + j], want, 2e-5 + 2e-5 * std::abs(want)) << r << " " << j;
      }
    }
    for (int64_t j = 0; j < c.h; ++j) {
      EXPECT_NEAR(o.dgamma[j], dg[j], 2e-5 + 2e-5 * std::abs(dg[j])) << j;
      if (c.centered) {
        EXPECT_NEAR(o.dbeta[j], db[j], 2e-5 + 2e-5 * std::abs(db[j])) << j;
      }
    }
  }
}

}  // namespace
