// Stats::kExact: the same bits at every world size. Random cases (tests/support/property_driver.h)
// at world sizes 1-4 on sub-communicators of one 4-rank job, uneven splits with empty ranks,
// offsets 0, 1e4 and 1e6, fp32/fp16/bf16: every output of a forward and a backward (y, the saved
// statistics, dx, dgamma, dbeta, and each op's own) must be BITWISE equal to the same op run on
// the whole input in one process (a single-process communicator), which itself runs with a
// different thread count (1 or 2 against 2 or 1). A wrong element is any differing bit pattern.
//
// Plus the exactness the mode promises, on small cases whose rational statistics are exact in
// double (a power-of-two count of fp32 values on a coarse grid): the saved float64 mean is
// that rational and rstd is 1/sqrt(var + eps) of the exact variance; and, for the record, the
// rstd error of kExact against kRobust at an offset of 1e6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "property_driver.h"
#include "storage.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/batched.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

using namespace tpnorm;
using namespace tpnorm_test;

namespace {

constexpr int kCases = 360;
constexpr int kTinyCases = 60;
constexpr uint64_t kSeed = 1515;

// Elements of a and b (same dtype and size) whose bits differ; prints the first few.
int64_t bits_differ(const char* what, Buffer& got, Buffer& want) {
  const size_t n = got.size(), w = dtype_size(got.dtype());
  const auto* a = static_cast<const unsigned char*>(got.view(Shape{int64_t(n)}).data);
  const auto* b = static_cast<const unsigned char*>(want.view(Shape{int64_t(n)}).data);
  int64_t wrong = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(a + i * w, b + i * w, w) != 0 && wrong++ < 3)
      std::fprintf(stderr, "[rank %d] %s[%zu]: %.9g, one process %.9g\n", world_rank(), what, i,
                   got.get(i), want.get(i));
  return wrong;
}

// eps for values drawn at `scale`: the default, and for tiny values (scale 2^-100 or 2^-135)
// 1e-60 (~2^-199), near their variance, so that the last units of the sum of squares (2^-204)
// show in rstd and in everything after it.
double eps_for(double scale) { return scale == 1.0 ? 1e-5 : 1e-60; }

DType draw_dtype(std::mt19937_64& g) {
  const DType dts[] = {DType::F32, DType::F16, DType::BF16};
  return dts[pick(g, 3)];
}
double draw_offset(std::mt19937_64& g) {
  const double offs[] = {0.0, 1e4, 1e6};
  return offs[pick(g, 3)];
}
std::vector<int> draw_weights(std::mt19937_64& g, int P) {
  std::vector<int> w;
  for (int p = 0; p < P; ++p) w.push_back(pick(g, 4));
  if (*std::max_element(w.begin(), w.end()) == 0) w[pick(g, P)] = 1;
  return w;
}

// ---- Row norms: LayerNorm / RMSNorm with the hidden dim sharded, plain, fused with a residual
// add (h = alpha*x + f; df and dx), or batched (this norm and the other kind, one collective) ---
enum class RowKind { kPlain, kFused, kBatched };
const char* kind_name(RowKind k) {
  return k == RowKind::kPlain ? "" : k == RowKind::kFused ? "fused " : "batched ";
}

struct RowCase {
  RowKind kind;
  double alpha;
  bool centered, affine;
  DType dt, saved;
  int64_t rows, hidden;
  double offset;
  std::vector<int> weights;
  int threads_one, threads_sharded;
  double scale;  // x (and f) drawn as scale * N(offset, 1)
};

struct RowOut {
  Buffer y, mean, rstd, dx, dg, db, h, df;
};

// Forward + backward over columns [c0, c0 + h) of the full inputs (f: the residual branch of
// the fused kind; a batched call adds an item of the other kind on x2/dy2, whose outputs go to
// *second).
RowOut run_rows(Communicator& comm, const RowCase& c, int threads, int64_t c0, int64_t h,
                const std::vector<float>& x, const std::vector<float>& dy,
                const std::vector<float>& gamma, const std::vector<float>& beta,
                const std::vector<float>& f, RowOut* second = nullptr) {
  const int64_t R = c.rows;
  Buffer xb(c.dt, columns(x, R, c.hidden, c0, h)), dyb(c.dt, columns(dy, R, c.hidden, c0, h));
  Buffer gb(c.dt, columns(gamma, 1, c.hidden, c0, h)), bb(c.dt, columns(beta, 1, c.hidden, c0, h));
  RowOut o{Buffer(c.dt, R * h), Buffer(c.saved, R), Buffer(c.saved, R),  Buffer(c.dt, R * h),
           Buffer(c.dt, h),     Buffer(c.dt, h),    Buffer(c.dt, R * h), Buffer(c.dt, R * h)};
  const Shape s{R, h}, p{h}, r{R};
  NormOptions opt;
  opt.stats = Stats::kExact;
  opt.num_threads = threads;
  opt.eps = eps_for(c.scale);
  const TensorView gv = c.affine ? gb.view(p) : TensorView{};
  if (c.kind == RowKind::kFused) {
    Buffer fb(c.dt, columns(f, R, c.hidden, c0, h));
    const TensorView dh_extra = c.affine ? fb.view(s) : TensorView{};  // present or not
    if (c.centered) {
      const TensorView bv = c.affine ? bb.view(p) : TensorView{};
      fused_add_layer_norm_forward(comm, xb.view(s), fb.view(s), c.alpha, gv, bv, o.h.view(s),
                                   o.y.view(s), o.mean.view(r), o.rstd.view(r), opt);
      fused_add_layer_norm_backward(comm, dyb.view(s), dh_extra, o.h.view(s), gv, o.mean.view(r),
                                    o.rstd.view(r), c.alpha, o.dx.view(s), o.df.view(s),
                                    o.dg.view(p), o.db.view(p), opt);
    } else {
      fused_add_rms_norm_forward(comm, xb.view(s), fb.view(s), c.alpha, gv, o.h.view(s),
                                 o.y.view(s), o.rstd.view(r), opt);
      fused_add_rms_norm_backward(comm, dyb.view(s), dh_extra, o.h.view(s), gv, o.rstd.view(r),
                                  c.alpha, o.dx.view(s), o.df.view(s), o.dg.view(p), opt);
    }
    return o;
  }
  if (c.kind == RowKind::kBatched) {
    // Item 0: this case's norm on x; item 1: the other kind on f (no affine), with dy reversed.
    std::vector<float> dy2(dy.rbegin(), dy.rend());
    Buffer x2(c.dt, columns(f, R, c.hidden, c0, h)), dy2b(c.dt, columns(dy2, R, c.hidden, c0, h));
    *second =
        RowOut{Buffer(c.dt, R * h), Buffer(c.saved, R), Buffer(c.saved, R), Buffer(c.dt, R * h),
               Buffer(c.dt, h),     Buffer(c.dt, h),    Buffer(c.dt, 0),    Buffer(c.dt, 0)};
    RowOut& o2 = *second;
    const TensorView bv = c.affine && c.centered ? bb.view(p) : TensorView{};
    RowNormItem fwd[2] = {{c.centered, xb.view(s), gv, bv, o.y.view(s),
                           c.centered ? o.mean.view(r) : TensorView{}, o.rstd.view(r)},
                          {!c.centered,
                           x2.view(s),
                           {},
                           {},
                           o2.y.view(s),
                           !c.centered ? o2.mean.view(r) : TensorView{},
                           o2.rstd.view(r)}};
    batched_norm_forward(comm, fwd, 2, opt);
    RowNormGradItem bwd[2] = {
        {c.centered, dyb.view(s), xb.view(s), gv, c.centered ? o.mean.view(r) : TensorView{},
         o.rstd.view(r), o.dx.view(s), c.affine ? o.dg.view(p) : TensorView{},
         c.affine && c.centered ? o.db.view(p) : TensorView{}},
        {!c.centered,
         dy2b.view(s),
         x2.view(s),
         {},
         !c.centered ? o2.mean.view(r) : TensorView{},
         o2.rstd.view(r),
         o2.dx.view(s),
         {},
         {}}};
    batched_norm_backward(comm, bwd, 2, opt);
    return o;
  }
  if (c.centered) {
    const TensorView bv = c.affine ? bb.view(p) : TensorView{};
    layer_norm_forward(comm, xb.view(s), gv, bv, o.y.view(s), o.mean.view(r), o.rstd.view(r), opt);
    layer_norm_backward(comm, dyb.view(s), xb.view(s), gv, o.mean.view(r), o.rstd.view(r),
                        o.dx.view(s), o.dg.view(p), o.db.view(p), opt);
  } else {
    rms_norm_forward(comm, xb.view(s), gv, o.y.view(s), o.rstd.view(r), opt);
    rms_norm_backward(comm, dyb.view(s), xb.view(s), gv, o.rstd.view(r), o.dx.view(s), o.dg.view(p),
                      opt);
  }
  return o;
}

// A case drawn from g; scale != 1 scales x (and f) and replaces fp16 (which has no such tiny
// values) by fp32, without drawing anything more from g.
PropertyCase draw_rows(std::mt19937_64& g, int P, double scale = 1.0) {
  RowCase c;
  c.kind = static_cast<RowKind>(pick(g, 3));
  c.alpha = pick(g, 2) ? 1.0 : 1.0 + pick(g, 100) / 37.0;
  c.centered = pick(g, 2) == 0;
  c.affine = pick(g, 3) != 0;
  c.dt = draw_dtype(g);
  c.saved = pick(g, 2) ? DType::F32 : DType::F64;
  // Sometimes more rows than one block of the deterministic dgamma/dbeta sums (256 rows).
  const bool tall = pick(g, 6) == 0;
  c.rows = tall ? 257 + pick(g, 400) : 1 + pick(g, 9);
  c.hidden = 1 + pick(g, tall ? 40 : 700);
  c.offset = c.centered ? draw_offset(g) : 0.0;
  c.weights = draw_weights(g, P);
  c.threads_one = 1 + pick(g, 2);
  c.threads_sharded = 3 - c.threads_one;
  c.scale = scale;
  if (scale != 1.0 && c.dt == DType::F16) c.dt = DType::F32;
  std::string w;
  for (int x : c.weights) w += std::to_string(x) + ",";
  const std::string what = kind_name(c.kind) + std::string(c.centered ? "LayerNorm" : "RMSNorm") +
                           " P=" + std::to_string(P) + " [" + std::to_string(c.rows) + "x" +
                           std::to_string(c.hidden) + "] " + dtype_name(c.dt) + " saved " +
                           dtype_name(c.saved) + " offset " + std::to_string(c.offset) +
                           (c.affine ? " affine" : "") + " weights " + w + " scale 2^" +
                           std::to_string(std::ilogb(c.scale));
  return {kind_name(c.kind) + std::string(c.centered ? "LayerNorm" : "RMSNorm"), what,
          [c](Communicator& comm, uint64_t seed) {
            const int64_t R = c.rows, H = c.hidden;
            const auto x = normal(seed, 0, R * H, c.scale * c.offset, c.scale);
            const auto dy = normal(seed, 1, R * H);
            const auto gamma = normal(seed, 2, H, 1.0, 0.5), beta = normal(seed, 3, H);
            const auto f = normal(seed, 4, R * H, c.scale * c.offset, c.scale);
            auto one = make_single_communicator();
            RowOut want2, got2;
            RowOut want = run_rows(*one, c, c.threads_one, 0, H, x, dy, gamma, beta, f, &want2);
            const Split sp = split_weighted(H, c.weights);
            const int me = comm.rank();
            const int64_t c0 = sp.offset[me], h = sp.count[me];
            RowOut got = run_rows(comm, c, c.threads_sharded, c0, h, x, dy, gamma, beta, f, &got2);
            // This rank's columns of the one-process outputs.
            Buffer wy(c.dt, columns(want.y.floats(), R, H, c0, h));
            Buffer wdx(c.dt, columns(want.dx.floats(), R, H, c0, h));
            Buffer wdg(c.dt, columns(want.dg.floats(), 1, H, c0, h));
            Buffer wdb(c.dt, columns(want.db.floats(), 1, H, c0, h));
            int64_t wrong = bits_differ("y", got.y, wy) + bits_differ("rstd", got.rstd, want.rstd) +
                            bits_differ("dx", got.dx, wdx);
            if (c.affine) wrong += bits_differ("dgamma", got.dg, wdg);
            if (c.centered) {
              wrong += bits_differ("mean", got.mean, want.mean);
              if (c.affine) wrong += bits_differ("dbeta", got.db, wdb);
            }
            if (c.kind == RowKind::kFused) {
              Buffer wh(c.dt, columns(want.h.floats(), R, H, c0, h));
              Buffer wdf(c.dt, columns(want.df.floats(), R, H, c0, h));
              wrong += bits_differ("h", got.h, wh) + bits_differ("df", got.df, wdf);
            }
            if (c.kind == RowKind::kBatched) {
              Buffer wy2(c.dt, columns(want2.y.floats(), R, H, c0, h));
              Buffer wdx2(c.dt, columns(want2.dx.floats(), R, H, c0, h));
              wrong += bits_differ("items[1].y", got2.y, wy2) +
                       bits_differ("items[1].rstd", got2.rstd, want2.rstd) +
                       bits_differ("items[1].dx", got2.dx, wdx2);
              if (!c.centered) wrong += bits_differ("items[1].mean", got2.mean, want2.mean);
            }
            return wrong;
          }};
}

// ---- SyncBatchNorm: the batch sharded over ranks ----------------------------------------------
// One training step (forward with running statistics, backward). dgamma / dbeta are this rank's
// sums by the API (the model's gradient all-reduce adds them), so only a one-rank case compares
// them; everything else is global.
struct BnCase {
  int64_t c, n_total;
  std::vector<int64_t> spatial;
  bool channels_last, affine;
  DType dt, saved;
  double offset;
  std::vector<int> weights;
  int threads_one, threads_sharded;
  double scale;
};

struct BnOut {
  Buffer y, mean, invstd, rmean, rvar, dx, dg, db;
};

// Samples [b0, b0 + nb) of the full batch (sample-major in both layouts).
std::vector<float> samples(const std::vector<float>& v, int64_t per, int64_t b0, int64_t nb) {
  return std::vector<float>(v.begin() + b0 * per, v.begin() + (b0 + nb) * per);
}

BnOut run_bn(Communicator& comm, const BnCase& c, int threads, int64_t b0, int64_t nb,
             const std::vector<float>& x, const std::vector<float>& dy,
             const std::vector<float>& gamma, const std::vector<float>& beta) {
  int64_t inner = 1;
  for (int64_t d : c.spatial) inner *= d;
  const int64_t per = c.c * inner;
  Shape xs;
  xs.ndim = 0;
  xs.dims[xs.ndim++] = nb;
  if (!c.channels_last) xs.dims[xs.ndim++] = c.c;
  for (int64_t d : c.spatial) xs.dims[xs.ndim++] = d;
  if (c.channels_last) xs.dims[xs.ndim++] = c.c;
  Buffer xb(c.dt, samples(x, per, b0, nb)), dyb(c.dt, samples(dy, per, b0, nb));
  Buffer gb(c.dt, gamma), bb(c.dt, beta);
  BnOut o{Buffer(c.dt, nb * per),
          Buffer(c.saved, c.c),
          Buffer(c.saved, c.c),
          Buffer(c.saved, std::vector<float>(c.c, 0.5f)),
          Buffer(c.saved, std::vector<float>(c.c, 2.0f)),
          Buffer(c.dt, nb * per),
          Buffer(c.dt, c.c),
          Buffer(c.dt, c.c)};
  const Shape cs{c.c};
  BatchNormOptions opt;
  opt.stats = Stats::kExact;
  opt.num_threads = threads;
  opt.eps = eps_for(c.scale);
  opt.layout = c.channels_last ? Layout::kChannelsLast : Layout::kNCHW;
  const TensorView gv = c.affine ? gb.view(cs) : TensorView{};
  const TensorView bv = c.affine ? bb.view(cs) : TensorView{};
  sync_batch_norm_forward(comm, xb.view(xs), gv, bv, o.rmean.view(cs), o.rvar.view(cs), nullptr,
                          o.y.view(xs), o.mean.view(cs), o.invstd.view(cs), opt);
  sync_batch_norm_backward(comm, dyb.view(xs), xb.view(xs), gv, o.mean.view(cs), o.invstd.view(cs),
                           o.dx.view(xs), c.affine ? o.dg.view(cs) : TensorView{},
                           c.affine ? o.db.view(cs) : TensorView{}, opt);
  return o;
}

PropertyCase draw_bn(std::mt19937_64& g, int P, double scale = 1.0) {
  BnCase c;
  c.c = 1 + pick(g, 6);
  c.n_total = 2 + pick(g, 9);
  for (int d = pick(g, 3); d > 0; --d) c.spatial.push_back(1 + pick(g, 6));
  c.channels_last = pick(g, 2) == 0;
  c.affine = pick(g, 3) != 0;
  c.dt = draw_dtype(g);
  c.saved = pick(g, 2) ? DType::F32 : DType::F64;
  c.offset = draw_offset(g);
  c.weights = draw_weights(g, P);
  c.threads_one = 1 + pick(g, 2);
  c.threads_sharded = 3 - c.threads_one;
  c.scale = scale;
  if (scale != 1.0 && c.dt == DType::F16) c.dt = DType::F32;
  std::string w;
  for (int x : c.weights) w += std::to_string(x) + ",";
  const std::string what = "SyncBN P=" + std::to_string(P) + " C=" + std::to_string(c.c) +
                           " N=" + std::to_string(c.n_total) + " spatial dims " +
                           std::to_string(c.spatial.size()) +
                           (c.channels_last ? " channels-last " : " NCHW ") + dtype_name(c.dt) +
                           " offset " + std::to_string(c.offset) + " weights " + w + " scale 2^" +
                           std::to_string(std::ilogb(c.scale));
  return {"SyncBatchNorm", what, [c, P](Communicator& comm, uint64_t seed) {
            int64_t inner = 1;
            for (int64_t d : c.spatial) inner *= d;
            const int64_t per = c.c * inner, total = c.n_total * per;
            const auto x = normal(seed, 0, total, c.scale * c.offset, c.scale);
            const auto dy = normal(seed, 1, total);
            const auto gamma = normal(seed, 2, c.c, 1.0, 0.5), beta = normal(seed, 3, c.c);
            auto one = make_single_communicator();
            BnOut want = run_bn(*one, c, c.threads_one, 0, c.n_total, x, dy, gamma, beta);
            const Split sp = split_weighted(c.n_total, c.weights);
            const int me = comm.rank();
            const int64_t b0 = sp.offset[me], nb = sp.count[me];
            BnOut got = run_bn(comm, c, c.threads_sharded, b0, nb, x, dy, gamma, beta);
            Buffer wy(c.dt, samples(want.y.floats(), per, b0, nb));
            Buffer wdx(c.dt, samples(want.dx.floats(), per, b0, nb));
            int64_t wrong = bits_differ("y", got.y, wy) + bits_differ("mean", got.mean, want.mean) +
                            bits_differ("invstd", got.invstd, want.invstd) +
                            bits_differ("running_mean", got.rmean, want.rmean) +
                            bits_differ("running_var", got.rvar, want.rvar) +
                            bits_differ("dx", got.dx, wdx);
            if (P == 1 && c.affine)
              wrong +=
                  bits_differ("dgamma", got.dg, want.dg) + bits_differ("dbeta", got.db, want.db);
            return wrong;
          }};
}

// ---- GroupNorm / InstanceNorm: channels sharded over ranks (a group may span ranks) ----------
struct GnCase {
  int64_t n, c, groups;
  std::vector<int64_t> spatial;
  bool affine;
  DType dt, saved;
  double offset;
  std::vector<int> weights;
  int threads_one, threads_sharded;
  double scale;
};

struct GnOut {
  Buffer y, mean, rstd, dx, dg, db;
};

// Channels [c0, c0 + nc) of every sample of a full [n, c, inner] tensor.
std::vector<float> chans(const std::vector<float>& v, int64_t n, int64_t c, int64_t inner,
                         int64_t c0, int64_t nc) {
  std::vector<float> out;
  for (int64_t b = 0; b < n; ++b)
    out.insert(out.end(), v.begin() + (b * c + c0) * inner, v.begin() + (b * c + c0 + nc) * inner);
  return out;
}

GnOut run_gn(Communicator& comm, const GnCase& c, int threads, int64_t c0, int64_t nc,
             const std::vector<float>& x, const std::vector<float>& dy,
             const std::vector<float>& gamma, const std::vector<float>& beta) {
  int64_t inner = 1;
  for (int64_t d : c.spatial) inner *= d;
  Shape xs;
  xs.dims[xs.ndim++] = c.n;
  xs.dims[xs.ndim++] = nc;
  for (int64_t d : c.spatial) xs.dims[xs.ndim++] = d;
  Buffer xb(c.dt, chans(x, c.n, c.c, inner, c0, nc)), dyb(c.dt, chans(dy, c.n, c.c, inner, c0, nc));
  Buffer gb(c.dt, chans(gamma, 1, c.c, 1, c0, nc)), bb(c.dt, chans(beta, 1, c.c, 1, c0, nc));
  const int64_t ng = c.n * c.groups;
  GnOut o{Buffer(c.dt, c.n * nc * inner), Buffer(c.saved, ng), Buffer(c.saved, ng),
          Buffer(c.dt, c.n * nc * inner), Buffer(c.dt, nc),    Buffer(c.dt, nc)};
  const Shape cs{nc}, gs{ng};
  NormOptions opt;
  opt.stats = Stats::kExact;
  opt.num_threads = threads;
  opt.eps = eps_for(c.scale);
  const ChannelGroups cg{c.groups, c.c, c0};
  const TensorView gv = c.affine ? gb.view(cs) : TensorView{};
  const TensorView bv = c.affine ? bb.view(cs) : TensorView{};
  group_norm_forward(comm, xb.view(xs), cg, gv, bv, o.y.view(xs), o.mean.view(gs), o.rstd.view(gs),
                     opt);
  group_norm_backward(comm, dyb.view(xs), xb.view(xs), cg, gv, o.mean.view(gs), o.rstd.view(gs),
                      o.dx.view(xs), c.affine ? o.dg.view(cs) : TensorView{},
                      c.affine ? o.db.view(cs) : TensorView{}, opt);
  return o;
}

PropertyCase draw_gn(std::mt19937_64& g, int P, double scale = 1.0) {
  GnCase c;
  c.groups = 1 + pick(g, 4);
  c.c = c.groups * (1 + pick(g, 3));  // InstanceNorm when groups == channels
  c.n = 1 + pick(g, 3);
  for (int d = 1 + pick(g, 2); d > 0; --d) c.spatial.push_back(1 + pick(g, 7));
  c.affine = pick(g, 3) != 0;
  c.dt = draw_dtype(g);
  c.saved = pick(g, 2) ? DType::F32 : DType::F64;
  c.offset = draw_offset(g);
  c.weights = draw_weights(g, P);
  c.threads_one = 1 + pick(g, 2);
  c.threads_sharded = 3 - c.threads_one;
  c.scale = scale;
  if (scale != 1.0 && c.dt == DType::F16) c.dt = DType::F32;
  std::string w;
  for (int x : c.weights) w += std::to_string(x) + ",";
  const std::string what = "GroupNorm P=" + std::to_string(P) + " N=" + std::to_string(c.n) +
                           " C=" + std::to_string(c.c) + " G=" + std::to_string(c.groups) + " " +
                           dtype_name(c.dt) + " offset " + std::to_string(c.offset) + " weights " +
                           w + " scale 2^" + std::to_string(std::ilogb(c.scale));
  return {"GroupNorm", what, [c](Communicator& comm, uint64_t seed) {
            int64_t inner = 1;
            for (int64_t d : c.spatial) inner *= d;
            const int64_t total = c.n * c.c * inner;
            const auto x = normal(seed, 0, total, c.scale * c.offset, c.scale);
            const auto dy = normal(seed, 1, total);
            const auto gamma = normal(seed, 2, c.c, 1.0, 0.5), beta = normal(seed, 3, c.c);
            auto one = make_single_communicator();
            GnOut want = run_gn(*one, c, c.threads_one, 0, c.c, x, dy, gamma, beta);
            const Split sp = split_weighted(c.c, c.weights);
            const int me = comm.rank();
            const int64_t c0 = sp.offset[me], nc = sp.count[me];
            GnOut got = run_gn(comm, c, c.threads_sharded, c0, nc, x, dy, gamma, beta);
            Buffer wy(c.dt, chans(want.y.floats(), c.n, c.c, inner, c0, nc));
            Buffer wdx(c.dt, chans(want.dx.floats(), c.n, c.c, inner, c0, nc));
            Buffer wdg(c.dt, chans(want.dg.floats(), 1, c.c, 1, c0, nc));
            Buffer wdb(c.dt, chans(want.db.floats(), 1, c.c, 1, c0, nc));
            int64_t wrong = bits_differ("y", got.y, wy) + bits_differ("mean", got.mean, want.mean) +
                            bits_differ("rstd", got.rstd, want.rstd) +
                            bits_differ("dx", got.dx, wdx);
            if (c.affine)
              wrong += bits_differ("dgamma", got.dg, wdg) + bits_differ("dbeta", got.db, wdb);
            return wrong;
          }};
}

TEST(ExactInvariance, RandomCasesBitwiseEqualToOneProcess) {
  const std::vector<std::function<PropertyCase(std::mt19937_64&, int, double)>> drawers = {
      draw_rows, draw_bn, draw_gn};
  run_random_cases(kCases, kSeed, [&](std::mt19937_64& g, int P) {
    return drawers[static_cast<size_t>(pick(g, static_cast<int>(drawers.size())))](g, P, 1.0);
  });
}

// Values whose squares exact_sum.h truncates to the grid 2^-204 (|x| < 2^-79): x drawn around
// 2^-100 (normal fp32/bf16) or 2^-135 (subnormals), eps 1e-60 (eps_for). The truncation is per
// element, so every op must still give the same bits at every world size and split.
TEST(ExactInvariance, TinyValuesBitwiseEqualToOneProcess) {
  const std::vector<std::function<PropertyCase(std::mt19937_64&, int, double)>> drawers = {
      draw_rows, draw_bn, draw_gn};
  run_random_cases(kTinyCases, kSeed + 1, [&](std::mt19937_64& g, int P) {
    const double scale = std::ldexp(1.0, pick(g, 2) ? -100 : -135);
    return drawers[static_cast<size_t>(pick(g, static_cast<int>(drawers.size())))](g, P, scale);
  });
}

// Small cases with exact rational statistics: n = 64 columns (a power of two) of fp32 values
// 1e6 + N(0,1) (multiples of 2^-4 at 1e6) or N(0,1) rounded to multiples of 2^-10. Then
// S1 = sum 2^k x and S2 = sum (2^k x)^2 are small integers, the mean S1 / (n 2^k) and the
// variance (n S2 - S1^2) / (n^2 2^2k) are exact in double, and the op must return exactly
// them (mean) and 1/sqrt(var + eps) (rstd, float64), at the world size of the job, the hidden
// dim split unevenly. kRobust's rstd error at 1e6 is printed beside it.
TEST(ExactInvariance, VarianceExactOnSmallCases) {
  constexpr int64_t R = 8, H = 64;
  Communicator& comm = *[] {
    static auto c = make_mpi_communicator(MPI_COMM_WORLD);
    return c.get();
  }();
  const int P = comm.size(), me = comm.rank();
  std::vector<int> weights;
  for (int p = 0; p < P; ++p) weights.push_back(p % 3);  // rank 0 holds nothing when P > 1
  if (P == 1) weights = {1};
  const Split sp = split_weighted(H, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  for (int k : {4, 10}) {
    const double offset = k == 4 ? 1e6 : 0.0;
    std::vector<float> x = normal(77, static_cast<uint64_t>(k), R * H, offset, 1.0);
    for (float& v : x) v = static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(v, k)), -k));
    std::vector<double> mean_ref(R), rstd_ref(R);
    for (int64_t r = 0; r < R; ++r) {
      __int128 s1 = 0, s2 = 0;
      for (int64_t j = 0; j < H; ++j) {
        const auto m = static_cast<__int128>(std::ldexp(x[r * H + j], k));  // exact integer
        s1 += m;
        s2 += m * m;
      }
      const __int128 num = H * s2 - s1 * s1;                      // < 2^53 here: exact in double
      mean_ref[r] = std::ldexp(static_cast<double>(s1), -k) / H;  // power-of-two divisor
      const double var = std::ldexp(static_cast<double>(num), -2 * k) / (H * H);
      rstd_ref[r] = 1.0 / std::sqrt(var + 1e-5);
    }
    double err[2] = {0, 0};
    for (Stats mode : {Stats::kExact, Stats::kRobust}) {
      Buffer xb(DType::F32, columns(x, R, H, c0, h)), y(DType::F32, R * h);
      Buffer mean(DType::F64, R), rstd(DType::F64, R);
      NormOptions opt;
      opt.stats = mode;
      layer_norm_forward(comm, xb.view({R, h}), {}, {}, y.view({R, h}), mean.view({R}),
                         rstd.view({R}), opt);
      const auto* m = static_cast<const double*>(mean.view({R}).data);
      const auto* s = static_cast<const double*>(rstd.view({R}).data);
      for (int64_t r = 0; r < R; ++r) {
        if (mode == Stats::kExact) {
          EXPECT_EQ(m[r], mean_ref[r]) << "row " << r << " k " << k;
          EXPECT_EQ(s[r], rstd_ref[r]) << "row " << r << " k " << k;
        }
        err[mode == Stats::kExact ? 0 : 1] =
            std::max(err[mode == Stats::kExact ? 0 : 1], std::fabs(s[r] / rstd_ref[r] - 1.0));
      }
    }
    if (me == 0)
      std::printf(
          "exact: P=%d offset %g: largest relative rstd error, kExact %.3g, kRobust "
          "%.3g\n",
          P, offset, err[0], err[1]);
  }
}

// Statistics of tiny values against integers formed here, independently of the library: rows
// of fp32 values under 2^-94 (a few subnormals among them; row 0 all +-2^-110, whose squares
// truncate to 0), m = x * 2^149 an exact integer, S1 = sum m and S2 = sum floor(x^2 * 2^204)
// = sum (m^2 >> 94): each square truncated to the grid, as exact_sum.h documents. With
// eps = 1e-300 (the API's eps > 0, far below these statistics), the saved float64 statistics
// must be the rationals of the truncated squares rounded once: RMSNorm's 1/sqrt(S2 / n 2^-204 +
// eps), LayerNorm's mean S1 / n 2^-149 and 1/sqrt(max(0, n S2 2^94 - S1^2) / n^2 2^-298 + eps),
// at the job's world size with the hidden dim split unevenly. Most rows' statistics differ from
// those of the exact squares (checked: the test tells truncation from no truncation).
TEST(ExactInvariance, TinyValuesGiveTheStatisticsOfTruncatedSquares) {
  constexpr int64_t R = 6, H = 64;
  constexpr double kEps = 1e-300;
  Communicator& comm = *[] {
    static auto c = make_mpi_communicator(MPI_COMM_WORLD);
    return c.get();
  }();
  const int P = comm.size(), me = comm.rank();
  std::vector<int> weights;
  for (int p = 0; p < P; ++p) weights.push_back(1 + p % 3);
  const Split sp = split_weighted(H, weights);
  const int64_t c0 = sp.offset[me], h = sp.count[me];
  std::vector<float> x = normal(91, 0, R * H);
  for (int64_t i = 0; i < R * H; ++i) {
    const float v = std::max(-3.9f, std::min(3.9f, x[i]));
    x[i] = i < H ? std::ldexp(i % 3 ? 1.0f : -1.0f, -110)
                 : std::ldexp(v, i % 17 == 5 ? -140 : -96);  // |x| < 2^-94; subnormals
  }
  std::vector<double> ms_ref(R), mean_ref(R), var_ref(R);
  int differs = 0;
  for (int64_t r = 0; r < R; ++r) {
    __int128 s1 = 0, s2 = 0, q = 0;  // q: the exact squares, m^2
    for (int64_t j = 0; j < H; ++j) {
      const auto m = static_cast<__int128>(std::ldexp(static_cast<double>(x[r * H + j]), 149));
      const auto sq = static_cast<unsigned __int128>(m < 0 ? -m : m) * (m < 0 ? -m : m);
      s1 += m;
      s2 += static_cast<__int128>(sq >> 94);
      q += static_cast<__int128>(sq);
    }
    ms_ref[r] = std::ldexp(static_cast<double>(s2), -204) / H;  // s2 < 2^22: exact
    mean_ref[r] = std::ldexp(static_cast<double>(s1), -149) / H;
    const __int128 num = H * s2 * (static_cast<__int128>(1) << 94) - s1 * s1;  // |.| < 2^123
    var_ref[r] = std::ldexp(static_cast<double>(num > 0 ? num : 0), -298) / (H * H);
    const double var_exact = std::ldexp(static_cast<double>(H * q - s1 * s1), -298) / (H * H);
    differs += 1.0 / std::sqrt(var_exact + kEps) != 1.0 / std::sqrt(var_ref[r] + kEps);
  }
  EXPECT_GE(differs, R - 1);
  Buffer xb(DType::F32, columns(x, R, H, c0, h)), y(DType::F32, R * h);
  Buffer mean(DType::F64, R), rstd(DType::F64, R);
  NormOptions opt;
  opt.stats = Stats::kExact;
  opt.eps = kEps;
  const auto* m = static_cast<const double*>(mean.view({R}).data);
  const auto* s = static_cast<const double*>(rstd.view({R}).data);
  rms_norm_forward(comm, xb.view({R, h}), {}, y.view({R, h}), rstd.view({R}), opt);
  for (int64_t r = 0; r < R; ++r)
    EXPECT_EQ(s[r], 1.0 / std::sqrt(ms_ref[r] + kEps)) << "RMSNorm row " << r;
  layer_norm_forward(comm, xb.view({R, h}), {}, {}, y.view({R, h}), mean.view({R}), rstd.view({R}),
                     opt);
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(m[r], mean_ref[r]) << "LayerNorm row " << r;
    EXPECT_EQ(s[r], 1.0 / std::sqrt(var_ref[r] + kEps)) << "LayerNorm row " << r;
  }
}

}  // namespace
