// Property test: 500 random cases of the row norms against the float64 reference, run at
// world sizes 1-4 on sub-communicators of one 4-rank job (tests/support/property_driver.h).
// Each case draws, from a seed every rank shares: op (LayerNorm / RMSNorm), rows,
// hidden size, P, an uneven split (shards of 0 columns included), affine on/off, storage dtype,
// saved-statistics dtype, statistics mode, agreement check on/off and strict/folded agreement.
// Forward and backward are compared element by element with the per-dtype tolerances of
// tests/mpi/test_row_norm_equiv.cpp. The other ops: test_property_ops.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "harness.h"
#include "property_driver.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr int kCases = 500;
constexpr uint64_t kSeed = 20261129;

struct Case {
  bool centered, affine, check;
  int P;
  int64_t rows, hidden;
  std::vector<int> weights;
  DType dt, saved;
  Stats stats;
  int64_t strict;
  std::string str() const {
    std::string w;
    for (int v : weights) w += std::to_string(v);
    char b[200];
    std::snprintf(b, sizeof b,
                  "%s P=%d rows=%lld hidden=%lld split=%s affine=%d %s saved=%s %s "
                  "check=%d strict=%lld",
                  centered ? "LayerNorm" : "RMSNorm", P, static_cast<long long>(rows),
                  static_cast<long long>(hidden), w.c_str(), affine, dtype_name(dt),
                  dtype_name(saved), stats == Stats::kRobust ? "robust" : "naive", check,
                  static_cast<long long>(strict));
    return b;
  }
};

Case draw(std::mt19937_64& g, int P) {
  auto pick = [&](int n) { return tpnorm_test::pick(g, n); };
  Case c;
  c.centered = pick(2);
  c.affine = pick(2);
  c.check = pick(4) != 0;
  c.P = P;
  c.rows = 1 + pick(9);
  c.hidden = 1 + pick(48);
  for (int p = 0; p < c.P; ++p) c.weights.push_back(pick(4));  // 0: this rank has no column
  if (*std::max_element(c.weights.begin(), c.weights.end()) == 0) c.weights[0] = 1;
  const DType dts[] = {DType::F32, DType::F16, DType::BF16};
  c.dt = dts[pick(3)];
  c.saved = pick(2) ? DType::F64 : DType::F32;
  c.stats = pick(3) ? Stats::kRobust : Stats::kNaive;
  c.strict = pick(2) ? -1 : 0;
  return c;
}

// Runs one case on this rank (a member of comm) and returns its count of wrong elements.
int64_t run_case(Communicator& comm, const Case& c, uint64_t seed) {
  const int me = comm.rank();
  const Split sp = split_weighted(c.hidden, c.weights);
  const int64_t R = c.rows, H = c.hidden, c0 = sp.offset[me], h = sp.count[me];
  auto round = [&](std::vector<float> v) { return Buffer(c.dt, v).floats(); };
  const auto x = round(normal(seed, 0, R * H, 0.5, 1.5)), dy = round(normal(seed, 1, R * H));
  const auto gamma = c.affine ? round(normal(seed, 2, H, 1.0, 0.5)) : std::vector<float>{};
  const auto beta = c.affine && c.centered ? round(normal(seed, 3, H)) : std::vector<float>{};
  const RowRef ref = row_norm_reference(c.centered, x, R, H, gamma, beta, 1e-5, dy);

  auto shard = [&](const std::vector<float>& v, int64_t rows) {
    return Buffer(c.dt, v.empty() ? v : columns(v, rows, H, c0, h));
  };
  Buffer xs = shard(x, R), dys = shard(dy, R), gs = shard(gamma, 1), bs = shard(beta, 1);
  Buffer y(c.dt, R * h), dx(c.dt, R * h), dg(c.dt, h), db(c.dt, h), mean(c.saved, R),
      rstd(c.saved, R);
  const Shape s{R, h}, p{h}, r{R};
  const TensorView gv = c.affine ? gs.view(p) : TensorView{};
  NormOptions o;
  o.stats = c.stats;
  o.check_agreement = c.check;
  comm.set_strict_calls(c.strict);
  if (c.centered) {
    const TensorView bv = c.affine ? bs.view(p) : TensorView{};
    layer_norm_forward(comm, xs.view(s), gv, bv, y.view(s), mean.view(r), rstd.view(r), o);
    layer_norm_backward(comm, dys.view(s), xs.view(s), gv, mean.view(r), rstd.view(r), dx.view(s),
                        dg.view(p), db.view(p), o);
  } else {
    rms_norm_forward(comm, xs.view(s), gv, y.view(s), rstd.view(r), o);
    rms_norm_backward(comm, dys.view(s), xs.view(s), gv, rstd.view(r), dx.view(s), dg.view(p), o);
  }

  auto cols = [&](const std::vector<double>& m, int64_t rows) {
    std::vector<double> out(static_cast<size_t>(rows * h));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < h; ++j) out[i * h + j] = m[i * H + c0 + j];
    return out;
  };
  const double rt = storage_rtol(c.dt);
  // Statistics: robust, within 1e-6 (row_stat_tolerance). The naive mode's float32
  // E[x^2] - E[x]^2 errs by a few float32 roundings of E[x^2], relative to var + eps (the
  // documented cancellation: large when a row's variance is tiny, e.g. hidden = 1 or 2); that
  // error carries through xhat into dx (scaled by rstd) and dgamma (summed over rows).
  const RowStatTol robust = row_stat_tolerance(c.centered, x, R, H, sp.offset, sp.count, ref);
  double st = std::max(robust.mean_atol, robust.rstd_rtol);
  if (c.stats == Stats::kNaive)
    for (int64_t i = 0; i < R; ++i) {
      double ex2 = 0;
      for (int64_t j = 0; j < H; ++j) ex2 += double(x[i * H + j]) * x[i * H + j] / double(H);
      const double var = 1 / (ref.rstd[i] * ref.rstd[i]);  // var + eps
      st = std::max(st, 8 * 0x1p-24 * ex2 / var);
    }
  const double rs_max = *std::max_element(ref.rstd.begin(), ref.rstd.end());
  int64_t wrong = count_wrong("y", y.floats(), cols(ref.y, R), rt + st, rt + st) +
                  count_wrong("rstd", rstd.floats(), ref.rstd, 0, st) +
                  count_wrong("dx", dx.floats(), cols(ref.dx, R), (rt + st) * std::max(1.0, rs_max),
                              10 * rt + st) +
                  count_wrong("dgamma", dg.floats(), cols(ref.dgamma, 1), (rt + st) * R, rt);
  if (c.centered)
    wrong += count_wrong("mean", mean.floats(), ref.mean, st, st) +
             count_wrong("dbeta", db.floats(), cols(ref.dbeta, 1), rt * R, rt);
  return wrong;
}

TEST(Property, RandomCasesMatchTheFloat64Reference) {
  run_random_cases(kCases, kSeed, [](std::mt19937_64& g, int P) {
    const Case c = draw(g, P);
    return PropertyCase{c.centered ? "LayerNorm" : "RMSNorm", c.str(),
                        [c](Communicator& comm, uint64_t seed) { return run_case(comm, c, seed); }};
  });
}

}  // namespace
