// Property test of every op besides the plain row norms (test_property.cpp): 600 random cases of
// SyncBatchNorm, GroupNorm / InstanceNorm, fused residual + LayerNorm / RMSNorm and batched norms,
// each against its float64 reference in tests/reference, at world sizes 1-4 on sub-communicators
// of one 4-rank job (tests/support/property_driver.h). Every case runs a forward and a backward
// and compares every output element by element.
//
// Tolerances (abs + rel*|want|), r = one rounding of the storage dtype (storage_rtol: fp32 1e-5,
// fp16 1e-3, bf16 8e-3), rs = the largest reference rstd / invstd of the case, as in the
// multi-rank equivalence tests of each op (tests/mpi/test_*_equiv.cpp):
//   y, h: r + r;  mean: 1e-6 + 1e-6;  rstd / invstd: 1e-6 rel (1e-5 for SyncBatchNorm, as in
//   its equivalence test), widened for the fused and batched row statistics by the float32
//   block-sum bound of row_stat_tolerance (tests/reference/reference.h);  dx, df: r*max(1, rs)
//   (times alpha for the fused dx) + 10r;  dgamma, dbeta: r*(values summed) + r;  running
//   statistics: 1e-6 + 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>

#include "batch_norm_reference.h"
#include "batched_runner.h"
#include "fused_reference.h"
#include "gated_reference.h"
#include "group_reference.h"
#include "harness.h"
#include "property_driver.h"
#include "reference.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/fused.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr int kCases = 600;
constexpr uint64_t kSeed = 20261130;
constexpr double kEps = 1e-5;

DType draw_dtype(std::mt19937_64& g) {
  const DType dts[] = {DType::F32, DType::F16, DType::BF16};
  return dts[pick(g, 3)];
}
// Per-rank weights 0..3 (0: nothing on that rank), at least one non-zero.
std::vector<int> draw_weights(std::mt19937_64& g, int P) {
  std::vector<int> w;
  for (int p = 0; p < P; ++p) w.push_back(pick(g, 4));
  if (*std::max_element(w.begin(), w.end()) == 0) w[pick(g, P)] = 1;
  return w;
}
std::string str(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += std::to_string(x) + ",";
  return s;
}
std::vector<float> rounded(DType dt, std::vector<float> v) { return Buffer(dt, v).floats(); }
// An optional input: v rounded to dt when present, else empty (absent).
std::vector<float> if_present(bool present, DType dt, std::vector<float> v) {
  return present ? rounded(dt, v) : std::vector<float>{};
}
std::vector<double> cols(const std::vector<double>& m, int64_t rows, int64_t n, int64_t c0,
                         int64_t nc) {
  std::vector<double> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * n + c0 + c];
  return out;
}
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// ---- SyncBatchNorm: one training step (forward + backward) over this rank's samples --------
struct BnCase {
  int64_t c;
  std::vector<int64_t> spatial, n;  // n: samples per rank (0 allowed)
  Layout layout;
  bool affine;
  double momentum;
  DType dt;
};

PropertyCase draw_bn(std::mt19937_64& g, int P) {
  BnCase k;
  k.c = 1 + pick(g, 6);
  for (int d = pick(g, 3); d > 0; --d) k.spatial.push_back(1 + pick(g, 4));
  for (int p = 0; p < P; ++p) k.n.push_back(pick(g, 4));
  const int64_t inner =
      std::accumulate(k.spatial.begin(), k.spatial.end(), int64_t{1}, std::multiplies<int64_t>());
  // A global count per channel of 1 is an error (as in PyTorch): make it >= 2.
  if (std::accumulate(k.n.begin(), k.n.end(), int64_t{0}) * inner < 2) k.n[pick(g, P)] += 2;
  k.layout = pick(g, 2) ? Layout::kNCHW : Layout::kChannelsLast;
  k.affine = pick(g, 2);
  k.momentum = pick(g, 2) ? 0.1 : BatchNormOptions::cumulative();
  k.dt = draw_dtype(g);
  std::string sp;
  for (int64_t s : k.spatial) sp += std::to_string(s) + "x";
  const std::string what = "SyncBatchNorm C=" + std::to_string(k.c) + " spatial=" + sp +
                           " n=" + str(std::vector<int>(k.n.begin(), k.n.end())) +
                           (k.layout == Layout::kNCHW ? " nchw" : " channels_last") +
                           " affine=" + std::to_string(k.affine) +
                           (std::isnan(k.momentum) ? " momentum=none " : " momentum=0.1 ") +
                           dtype_name(k.dt);
  return {
      "SyncBatchNorm", what, [k](Communicator& comm, uint64_t seed) -> int64_t {
        const int me = comm.rank();
        const int64_t C = k.c, N = std::accumulate(k.n.begin(), k.n.end(), int64_t{0});
        const int64_t inner = std::accumulate(k.spatial.begin(), k.spatial.end(), int64_t{1},
                                              std::multiplies<int64_t>());
        const int64_t nb = k.n[me], b0 = std::accumulate(k.n.begin(), k.n.begin() + me, int64_t{0});
        const int64_t per = C * inner, count = N * inner;
        const bool cl = k.layout == Layout::kChannelsLast;
        auto mine = [&](const auto& full) {  // this rank's samples, in the op's layout
          std::decay_t<decltype(full)> v(full.begin() + b0 * per, full.begin() + (b0 + nb) * per);
          return cl ? to_channels_last(v, nb, C, inner) : v;
        };
        const auto x = rounded(k.dt, normal(seed, 0, N * per, 0.5, 1.5));
        const auto dy = rounded(k.dt, normal(seed, 1, N * per));
        const auto gamma = if_present(k.affine, k.dt, normal(seed, 2, C, 1.0, 0.5));
        const auto beta = if_present(k.affine, k.dt, normal(seed, 3, C));
        Buffer xl(k.dt, mine(x)), dyl(k.dt, mine(dy)), y(k.dt, nb * per), dx(k.dt, nb * per),
            gb(k.dt, gamma), bb(k.dt, beta), dg(k.dt, C), db(k.dt, C);
        Shape xs;
        xs.ndim = 2 + static_cast<int>(k.spatial.size());
        xs.dims[0] = nb;
        xs.dims[cl ? xs.ndim - 1 : 1] = C;
        for (size_t i = 0; i < k.spatial.size(); ++i) xs.dims[(cl ? 1 : 2) + i] = k.spatial[i];
        const Shape cs{C};
        const TensorView gv = k.affine ? gb.view(cs) : TensorView{};
        const TensorView bv = k.affine ? bb.view(cs) : TensorView{};
        std::vector<float> rm(C, 0.f), rv(C, 1.f), smean(C), sinv(C);
        int64_t tracked = 0;
        BatchNormOptions opt;
        opt.layout = k.layout;
        opt.momentum = k.momentum;
        sync_batch_norm_forward(comm, xl.view(xs), gv, bv, view(rm.data(), cs), view(rv.data(), cs),
                                &tracked, y.view(xs), view(smean.data(), cs), view(sinv.data(), cs),
                                opt);
        sync_batch_norm_backward(comm, dyl.view(xs), xl.view(xs), gv, view(smean.data(), cs),
                                 view(sinv.data(), cs), dx.view(xs), dg.view(cs), db.view(cs), opt);
        // dgamma / dbeta are this rank's sums: add them over the case's ranks in float64.
        const std::vector<float> dgl = dg.floats(), dbl = db.floats();
        std::vector<double> dgs(dgl.begin(), dgl.end()), dbs(dbl.begin(), dbl.end());
        comm.all_reduce_sum(dgs.data(), dgs.size(), DType::F64);
        comm.all_reduce_sum(dbs.data(), dbs.size(), DType::F64);

        const BnRef ref = batch_norm_reference(x, N, C, inner, gamma, beta, opt.eps, dy);
        const double m = std::isnan(k.momentum) ? 1.0 : k.momentum;  // 1/num_batches_tracked
        std::vector<double> invstd(C), rm_ref(C), rv_ref(C);
        for (int64_t ch = 0; ch < C; ++ch) {
          invstd[ch] = 1.0 / std::sqrt(ref.var[ch] + opt.eps);
          rm_ref[ch] = m * ref.mean[ch];
          rv_ref[ch] = (1 - m) + m * ref.var[ch] * count / (count - 1);
        }
        const double rt = storage_rtol(k.dt);
        return count_wrong("y", y.floats(), mine(ref.y), rt, rt) +
               count_wrong("dx", dx.floats(), mine(ref.dx), rt * std::max(1.0, max_of(invstd)),
                           10 * rt) +
               count_wrong("save_mean", smean, ref.mean, 1e-6, 1e-6) +
               count_wrong("save_invstd", sinv, invstd, 0, 1e-5) +
               count_wrong("running_mean", rm, rm_ref, 1e-6, 1e-5) +
               count_wrong("running_var", rv, rv_ref, 1e-6, 1e-5) +
               count_wrong("dgamma summed", std::vector<float>(dgs.begin(), dgs.end()), ref.dgamma,
                           rt * count, rt) +
               count_wrong("dbeta summed", std::vector<float>(dbs.begin(), dbs.end()), ref.dbeta,
                           rt * count, rt) +
               (tracked == 1 ? 0 : 1);
      }};
}

// ---- GroupNorm / InstanceNorm: channels sharded unevenly, groups spanning ranks ------------
PropertyCase draw_group(std::mt19937_64& g, int P) {
  const bool instance = pick(g, 4) == 0;
  const int64_t n = 1 + pick(g, 3), groups = 1 + pick(g, 4), per_group = 1 + pick(g, 3);
  const int64_t C = groups * per_group;
  int64_t s = 1 + pick(g, 6);
  if (instance && s == 1) s = 2;  // InstanceNorm refuses one spatial element, as torch's
  const std::vector<int> w = draw_weights(g, P);
  const bool affine = pick(g, 2);
  const DType dt = draw_dtype(g), saved = pick(g, 2) ? DType::F64 : DType::F32;
  const std::string what =
      std::string(instance ? "InstanceNorm" : "GroupNorm") + " n=" + std::to_string(n) +
      " C=" + std::to_string(C) + " G=" + std::to_string(instance ? C : groups) +
      " s=" + std::to_string(s) + " split=" + str(w) + " affine=" + std::to_string(affine) + " " +
      dtype_name(dt) + " saved=" + dtype_name(saved);
  return {instance ? "InstanceNorm" : "GroupNorm", what, [=](Communicator& comm, uint64_t seed) {
            const Split sp = split_weighted(C, w);
            const int64_t c0 = sp.offset[comm.rank()], nc = sp.count[comm.rank()];
            const int64_t G = instance ? C : groups;
            const auto x = rounded(dt, normal(seed, 0, n * C * s, 0.5, 1.5));
            const auto dy = rounded(dt, normal(seed, 1, n * C * s));
            const auto gamma = if_present(affine, dt, normal(seed, 2, C, 1.0, 0.5));
            const auto beta = if_present(affine, dt, normal(seed, 3, C));
            GroupSetup st;
            st.dt = dt;
            st.saved = saved;
            st.n = n;
            st.c_local = nc;
            st.s = s;
            st.cg = {G, C, c0};
            st.affine = affine;
            st.instance = instance;
            auto slice = [&](const std::vector<float>& v) {
              return v.empty() ? v : channel_slice(v, 1, C, 1, c0, nc);
            };
            const GroupOut got =
                run_group(comm, st, channel_slice(x, n, C, s, c0, nc), slice(gamma), slice(beta),
                          channel_slice(dy, n, C, s, c0, nc));
            const GroupRef ref = group_norm_reference(x, n, C, s, G, gamma, beta, kEps, dy);
            const double rt = storage_rtol(dt);
            int64_t wrong = count_wrong("y", got.y, channel_slice(ref.y, n, C, s, c0, nc), rt, rt) +
                            count_wrong("mean", got.mean, ref.mean, 1e-6, 1e-6) +
                            count_wrong("rstd", got.rstd, ref.rstd, 0, 1e-6) +
                            count_wrong("dx", got.dx, channel_slice(ref.dx, n, C, s, c0, nc),
                                        rt * std::max(1.0, max_of(ref.rstd)), 10 * rt);
            if (affine)
              wrong += count_wrong("dgamma", got.dgamma, channel_slice(ref.dgamma, 1, C, 1, c0, nc),
                                   rt * n * s, rt) +
                       count_wrong("dbeta", got.dbeta, channel_slice(ref.dbeta, 1, C, 1, c0, nc),
                                   rt * n * s, rt);
            return wrong;
          }};
}

// ---- fused residual add + LayerNorm / RMSNorm, alpha 1 or DeepNorm's -----------------------
PropertyCase draw_fused(std::mt19937_64& g, int P) {
  FusedSetup st;
  st.centered = pick(g, 2);
  st.dt = draw_dtype(g);
  st.saved = pick(g, 2) ? DType::F64 : DType::F32;
  const DeepNormStack stack =
      pick(g, 2) ? DeepNormStack::kEncoderOnly : DeepNormStack::kDecoderOnly;
  const int64_t layers = 1 + pick(g, 48);
  st.alpha = pick(g, 2) ? 1.0 : deepnorm_alpha(stack, layers, layers);
  st.rows = 1 + pick(g, 8);
  const int64_t H = 1 + pick(g, 40);
  const std::vector<int> w = draw_weights(g, P);
  st.affine = pick(g, 2);
  st.backward = true;
  st.extra = pick(g, 2);
  st.in_place = pick(g, 2);
  char what[200];
  std::snprintf(what, sizeof what,
                "fused %s alpha=%.4f rows=%lld H=%lld split=%s affine=%d "
                "extra=%d in_place=%d %s saved=%s",
                st.centered ? "LayerNorm" : "RMSNorm", st.alpha, static_cast<long long>(st.rows),
                static_cast<long long>(H), str(w).c_str(), st.affine, st.extra, st.in_place,
                dtype_name(st.dt), dtype_name(st.saved));
  return {st.centered ? "fused LayerNorm" : "fused RMSNorm", what,
          [st, H, w](Communicator& comm, uint64_t seed) {
            const Split sp = split_weighted(H, w);
            const int64_t c0 = sp.offset[comm.rank()], h = sp.count[comm.rank()], R = st.rows;
            const DType dt = st.dt;
            const auto x = rounded(dt, normal(seed, 0, R * H, 0.5, 1.5));
            const auto f = rounded(dt, normal(seed, 1, R * H, 0.0, 0.5));
            const auto dy = rounded(dt, normal(seed, 2, R * H));
            const auto ex = if_present(st.extra, dt, normal(seed, 3, R * H));
            const auto gamma = if_present(st.affine, dt, normal(seed, 4, H, 1.0, 0.5));
            const auto beta = if_present(st.affine && st.centered, dt, normal(seed, 5, H));
            auto mine = [&](const std::vector<float>& m, int64_t rows) {
              return m.empty() ? m : columns(m, rows, H, c0, h);
            };
            FusedSetup local = st;
            local.h = h;
            const FusedOut got = run_fused(comm, local, mine(x, R), mine(f, R), mine(gamma, 1),
                                           mine(beta, 1), mine(dy, R), mine(ex, R));
            // The reference normalizes the op's stored h (see fused_reference.h); the
            // single-process op on the full data gives it, and h itself is checked against float64
            // alpha*x + f.
            auto single = make_single_communicator();
            FusedSetup full = st;
            full.h = H;
            const FusedOut one = run_fused(*single, full, x, f, gamma, beta, dy, ex);
            const FusedRef ref = fused_reference(st.centered, x, f, st.alpha, one.h, R, H, gamma,
                                                 beta, kEps, dy, ex);
            const double rt = storage_rtol(dt);
            const double gtol = rt * std::max(1.0, max_of(ref.norm.rstd));
            const RowStatTol stol =
                row_stat_tolerance(st.centered, one.h, R, H, sp.offset, sp.count, ref.norm);
            int64_t wrong =
                count_wrong("h", got.h, cols(ref.h, R, H, c0, h), rt, rt) +
                count_wrong("y", got.y, cols(ref.norm.y, R, H, c0, h), rt, rt) +
                count_wrong("rstd", got.rstd, ref.norm.rstd, 0, stol.rstd_rtol) +
                count_wrong("df", got.df, cols(ref.df, R, H, c0, h), gtol, 10 * rt) +
                count_wrong("dx", got.dx, cols(ref.dx, R, H, c0, h), gtol * st.alpha, 10 * rt);
            if (st.affine)
              wrong +=
                  count_wrong("dgamma", got.dgamma, cols(ref.norm.dgamma, 1, H, c0, h), rt * R, rt);
            if (st.centered) {
              wrong += count_wrong("mean", got.mean, ref.norm.mean, stol.mean_atol, 1e-6);
              if (st.affine)
                wrong +=
                    count_wrong("dbeta", got.dbeta, cols(ref.norm.dbeta, 1, H, c0, h), rt * R, rt);
            }
            return wrong;
          }};
}

// ---- batched: 1-4 row norms, each with its own op, dtype, shape and split, ONE collective ---
struct ItemSpec {
  bool centered, affine;
  DType dt, saved;
  int64_t rows, hidden;
  std::vector<int> weights;
};

PropertyCase draw_batched(std::mt19937_64& g, int P) {
  std::vector<ItemSpec> specs(1 + pick(g, 4));
  std::string what = "batched";
  for (ItemSpec& s : specs) {
    s.centered = pick(g, 2);
    s.affine = pick(g, 2);
    s.dt = draw_dtype(g);
    s.saved = pick(g, 2) ? DType::F64 : DType::F32;
    s.rows = 1 + pick(g, 6);
    s.hidden = 1 + pick(g, 32);
    s.weights = draw_weights(g, P);
    what += std::string(" [") + (s.centered ? "LN" : "RMS") + " " + std::to_string(s.rows) + "x" +
            std::to_string(s.hidden) + " split=" + str(s.weights) +
            " affine=" + std::to_string(s.affine) + " " + dtype_name(s.dt) + "/" +
            dtype_name(s.saved) + "]";
  }
  return {"batched", what, [specs](Communicator& comm, uint64_t seed) {
            std::vector<BatchedItem> items;
            std::vector<RowRef> refs;
            std::vector<Split> splits;
            std::vector<RowStatTol> stols;
            for (size_t i = 0; i < specs.size(); ++i) {
              const ItemSpec& s = specs[i];
              const uint64_t sd = seed * 8 + i;
              const int64_t R = s.rows, H = s.hidden;
              const auto x = rounded(s.dt, normal(sd, 0, R * H, 0.5, 1.5));
              const auto dy = rounded(s.dt, normal(sd, 1, R * H));
              const auto gamma = if_present(s.affine, s.dt, normal(sd, 2, H, 1.0, 0.5));
              const auto beta = if_present(s.affine && s.centered, s.dt, normal(sd, 3, H));
              refs.push_back(row_norm_reference(s.centered, x, R, H, gamma, beta, kEps, dy));
              splits.push_back(split_weighted(H, s.weights));
              stols.push_back(row_stat_tolerance(s.centered, x, R, H, splits[i].offset,
                                                 splits[i].count, refs[i]));
              const int64_t c0 = splits[i].offset[comm.rank()], h = splits[i].count[comm.rank()];
              auto mine = [&](const std::vector<float>& m, int64_t rows) {
                return m.empty() ? m : columns(m, rows, H, c0, h);
              };
              items.push_back({s.centered, s.dt, s.saved, R, h, s.affine, mine(x, R),
                               mine(gamma, 1), mine(beta, 1), mine(dy, R)});
            }
            const auto got = run_batched(comm, items);
            int64_t wrong = 0;
            for (size_t i = 0; i < specs.size(); ++i) {
              const ItemSpec& s = specs[i];
              const RowRef& ref = refs[i];
              const int64_t c0 = splits[i].offset[comm.rank()], h = splits[i].count[comm.rank()];
              const int64_t R = s.rows, H = s.hidden;
              const double rt = storage_rtol(s.dt);
              wrong += count_wrong("item y", got[i].y, cols(ref.y, R, H, c0, h), rt, rt) +
                       count_wrong("item rstd", got[i].rstd, ref.rstd, 0, stols[i].rstd_rtol) +
                       count_wrong("item dx", got[i].dx, cols(ref.dx, R, H, c0, h),
                                   rt * std::max(1.0, max_of(ref.rstd)), 10 * rt);
              if (s.affine)
                wrong += count_wrong("item dgamma", got[i].dgamma, cols(ref.dgamma, 1, H, c0, h),
                                     rt * R, rt);
              if (s.centered) {
                wrong += count_wrong("item mean", got[i].mean, ref.mean, stols[i].mean_atol, 1e-6);
                if (s.affine)
                  wrong += count_wrong("item dbeta", got[i].dbeta, cols(ref.dbeta, 1, H, c0, h),
                                       rt * R, rt);
              }
            }
            return wrong;
          }};
}

// ---- the gated RMSNorm: channels sharded unevenly, groups spanning ranks, either gate order --
PropertyCase draw_gated(std::mt19937_64& g, int P) {
  GatedSetup st;
  st.dt = draw_dtype(g);
  st.saved = pick(g, 2) ? DType::F64 : DType::F32;
  st.rows = 1 + pick(g, 8);
  const int64_t groups = 1 + pick(g, 4), group_size = 1 + pick(g, 12);
  const int64_t H = groups * group_size;
  const bool nbg = pick(g, 2), gated = pick(g, 4) != 0;
  st.weighted = pick(g, 2);
  const std::vector<int> w = draw_weights(g, P);
  const std::string what = "gated RMSNorm rows=" + std::to_string(st.rows) + " H=" +
                           std::to_string(H) + " group_size=" + std::to_string(group_size) +
                           " split=" + str(w) + " norm_before_gate=" + std::to_string(nbg) +
                           " gate=" + std::to_string(gated) + " weight=" +
                           std::to_string(st.weighted) + " " + dtype_name(st.dt) +
                           " saved=" + dtype_name(st.saved);
  return {"RMSNormGated", what, [=](Communicator& comm, uint64_t seed) {
            const Split sp = split_weighted(H, w);
            const int64_t c0 = sp.offset[comm.rank()], nc = sp.count[comm.rank()];
            GatedSetup s = st;
            s.param = st.dt;
            s.c_local = nc;
            s.gated = gated;
            s.gg = {group_size, H, c0, nbg};
            const int64_t R = s.rows;
            const auto x = rounded(s.dt, normal(seed, 0, R * H, 0.5, 1.5));
            const auto z = gated ? rounded(s.dt, normal(seed, 1, R * H, 0.0, 2.0))
                                 : std::vector<float>{};
            const auto weight = if_present(s.weighted, s.dt, normal(seed, 2, H, 1.0, 0.5));
            const auto dy = rounded(s.dt, normal(seed, 3, R * H));
            auto cols_of = [&](const std::vector<float>& v, int64_t rows) {
              return v.empty() ? v : columns(v, rows, H, c0, nc);
            };
            const GatedOut got =
                run_gated(comm, s, cols_of(x, R), cols_of(z, R), cols_of(weight, 1), cols_of(dy, R));
            const GatedRef ref =
                rms_norm_gated_reference(x, z, R, H, group_size, nbg, weight, kEps, dy);
            const double rt = storage_rtol(s.dt);
            auto cols_d = [&](const std::vector<double>& v, int64_t rows) {
              std::vector<double> out;
              for (int64_t r = 0; r < rows; ++r)
                out.insert(out.end(), v.begin() + r * H + c0, v.begin() + r * H + c0 + nc);
              return out;
            };
            int64_t wrong = count_wrong("y", got.y, cols_d(ref.y, R), rt, rt) +
                            count_wrong("rstd", got.rstd, ref.rstd, 0, 1e-5) +
                            count_wrong("dx", got.dx, cols_d(ref.dx, R),
                                        4 * rt * std::max(1.0, max_of(ref.rstd)), 10 * rt);
            if (gated)
              wrong += count_wrong("dz", got.dz, cols_d(ref.dz, R),
                                   4 * rt * std::max(1.0, max_of(ref.rstd)), 10 * rt);
            if (s.weighted)
              wrong += count_wrong("dweight", got.dweight, cols_d(ref.dweight, 1), rt * R, rt);
            return wrong;
          }};
}

TEST(PropertyOps, RandomCasesOfEveryOpMatchTheirFloat64References) {
  run_random_cases(kCases, kSeed, [](std::mt19937_64& g, int P) {
    switch (pick(g, 5)) {
      case 0:
        return draw_bn(g, P);
      case 1:
        return draw_group(g, P);
      case 2:
        return draw_fused(g, P);
      case 3:
        return draw_gated(g, P);
      default:
        return draw_batched(g, P);
    }
  });
}

}  // namespace
