// row_norm.cpp — CPU kernels for LayerNorm / RMSNorm rows; see row_norm.h.
//
// Precision: element work is float32; statistics are W (double in the robust mode).
// x - mean is formed as (x - float(mean)) - float(mean - float(mean)): the first difference is
// exact or one rounding of a small number, so xhat keeps float accuracy even when |mean| is
// 1e4 times the standard deviation.
//
// Speed (fp32 is the hot path; fp16/bf16 run the same formulas through lane-wise conversions):
// - Loops are explicit float32 vectors (simd.h, loops.h): row sums in float32 lanes with two
//   accumulator chains over blocks of kBlock elements, each block's sum added in W. Converting
//   every element to double would halve the SIMD width; the robust forward sums d = x - pivot
//   around the row's robust pivot (common/pivot.h: the mean of its first 32 elements), so
//   1e4 + N(0,1) still loses nothing (d is small and exact).
// - With a.fused (one rank: the reduce is the identity) each row's statistics are computed just
//   before its apply loop, while the row is in L1/L2: one pass over memory instead of two.
// - Loops prefetch their inputs kAheadBytes ahead (into the next row), so memory reads overlap
//   the arithmetic and the writes: one thread otherwise waits on memory while it sums a row,
//   then computes without reading memory. (The fused forward's sums pass runs without: it
//   measured faster; its first 4 KiB were prefetched by the previous row's apply loop.) The
//   partials prefetch too (they read x, and dy, straight from memory at P > 1).
// - A chunk of a chunked call (ops/chunking.h) is applied from cache; its apply prefetches the
//   rows the next chunk's partial reads (RowNormArgs::pf_x) instead of its own next rows, so
//   that memory reads continue while the apply computes, as in the fused kernels.
//   Outputs larger than the last-level cache are written with streaming stores from registers.
// - dgamma/dbeta are summed in float32 for kParamRows rows at a time, then added in double:
//   the double accumulators (16 bytes a column) are touched once per block, not once per row.
#include "kernels/cpu/row_norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"
#include "common/pivot.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {
namespace {

// Rows whose float32 dgamma/dbeta sums are added into the double ones at a time.
constexpr int kParamRows = 16;
// With final_stats (Stats::kExact), dgamma/dbeta are summed per block of kFixedRows rows, in
// row order, and the blocks' sums added in block order: the same bits for any thread count
// (threads take whole blocks), where per-thread sums depend on how rows fall to threads.
constexpr int64_t kFixedRows = 256;

// tensors: how many row-major [rows, h] tensors the kernel reads and writes.
// The whole call's rows (a chunk decides as its call does).
template <class T>
bool stream_rows(const RowNormArgs& a, int tensors) {
  const int64_t rows = a.call_rows > 0 ? a.call_rows : a.rows;
  return stream_output<T>(tensors * rows * a.h * static_cast<int64_t>(sizeof(T)));
}

// dgamma/dbeta accumulator slots (2h doubles each): one per thread, or with final_stats one per
// kFixedRows block of the whole call.
int64_t param_slots(const RowNormArgs& a) {
  const int64_t rows = a.call_rows > 0 ? a.call_rows : a.rows;
  return a.final_stats ? (rows + kFixedRows - 1) / kFixedRows : thread_count(a.threads, rows);
}

// Row r of base, kAheadBytes on (the prefetch target while row r is read), or null where that
// would run past the tensor.
template <class T>
const T* ahead(const RowNormArgs& a, const T* base, int64_t r) {
  const int64_t d = kAheadBytes / static_cast<int64_t>(sizeof(T));
  return base && (r + 1) * a.h + d <= a.rows * a.h ? base + r * a.h + d : nullptr;
}

// One row's forward partial: centred {sum x, sum x^2} or RMS {sum x^2} into st.
template <class T, class W>
inline void forward_sums(const RowNormArgs& a, const T* xr, W* st, const T* pf = nullptr) {
  W s1 = 0, s2 = 0;
  if (a.h > 0) {
    if constexpr (std::is_same_v<W, double>) {
      // Accumulate around the row's robust pivot, then shift back exactly enough.
      const float pivot = a.centered ? detail::robust_pivot(xr, a.h) : 0.0f;
      double d1, d2;
      block_sums<double>(
          a.h,
          [=](int64_t j, auto tag) {
            using V = decltype(tag);
            const V d = load_as<V>(xr + j) - splat<V>(pivot);
            return Two<V>{d, d * d};
          },
          d1, d2, pf);
      const double p = pivot, hh = static_cast<double>(a.h);
      s1 = p * hh + d1;
      s2 = d2 + 2.0 * p * d1 + p * p * hh;
    } else {
      block_sums<float>(
          a.h,
          [=](int64_t j, auto tag) {
            using V = decltype(tag);
            const V u = load_as<V>(xr + j);
            return Two<V>{u, u * u};
          },
          s1, s2, pf);
    }
  }
  if (a.centered) {
    st[0] = s1;
    st[1] = s2;
  } else {
    st[0] = s2;
  }
}

// The fused path's row statistics: the kernels' own sums, or with final_stats (Stats::kExact at
// one rank) the exact mode's final values from the row (kernels/cpu/exact_rows.h).
template <class T, class W>
inline void fused_forward_stats(const RowNormArgs& a, const T* xr, W* st) {
  if constexpr (std::is_same_v<W, double>)
    if (a.final_stats) return exact_row_final_forward(a.centered, xr, a.h, st);
  forward_sums(a, xr, st);
}
template <class T, class P, class W>
inline void fused_exact_backward(const RowNormArgs& a, const T* dyr, const T* xr, const P* gamma,
                                 float mh, float mt, float rs, W* st) {
  if constexpr (std::is_same_v<W, double>)
    exact_row_final_backward(a.centered, dyr, xr, gamma, mh, mt, rs, a.h, st);
}

// xhat at j of a row: ((x - mh) - mt) * rs, lane-wise.
template <class V, class T>
inline V xhat_at(const T* xr, int64_t j, float mh, float mt, float rs) {
  return ((load_as<V>(xr + j) - splat<V>(mh)) - splat<V>(mt)) * splat<V>(rs);
}

// xhat_at with the subtractions of a known +0 skipped (v - (+0) is v, bit for bit, -0 and NaN
// included): kM = kRms, no mean (mh = mt = 0); kM = kHead, a mean saved as float32, whose split
// has no tail (mt = 0); kM = kFull, both terms.
constexpr int kRms = 0, kHead = 1, kFull = 2;
template <int kM, class V, class T>
inline V xhat_of(const T* xr, int64_t j, float mh, float mt, float rs) {
  if constexpr (kM == kFull)
    return xhat_at<V>(xr, j, mh, mt, rs);
  else if constexpr (kM == kHead)
    return (load_as<V>(xr + j) - splat<V>(mh)) * splat<V>(rs);
  else
    return load_as<V>(xr + j) * splat<V>(rs);
}

// One row's backward partial: centred {sum g, sum g*xhat} or RMS {sum g*xhat} into st.
template <class T, class P, class W>
inline void backward_sums(const RowNormArgs& a, const T* dyr, const T* xr, const P* gamma, float mh,
                          float mt, float rs, W* st, const T* pf_dy = nullptr,
                          const T* pf_x = nullptr) {
  W sg, sgx;
  block_sums<W>(
      a.h,
      [=](int64_t j, auto tag) {
        using V = decltype(tag);
        const V xhat = xhat_at<V>(xr, j, mh, mt, rs);
        const V d = load_as<V>(dyr + j);
        const V g = gamma ? d * load_as<V>(gamma + j) : d;
        return Two<V>{g, g * xhat};
      },
      sg, sgx, pf_dy, pf_x);
  if (a.centered) {
    st[0] = sg;
    st[1] = sgx;
  } else {
    st[0] = sgx;
  }
}

// --- backward apply -------------------------------------------------------------------------
// Rows go through the backward in groups of up to kGroup: the dgamma/dbeta lanes of a column
// are loaded and stored once per group, not once per row (at h = 4096 they are 32 KiB, all of
// L1, and updating them row by row cost a third of the kernel's time).
// 2 rows: with AVX2 (16 ymm registers) 4 rows' accumulators spill to the stack, and 2-row
// groups took 0.80-0.88x the time of 4-row ones at [16384, 4096], 0.96-1.09x at [65536, 1024];
// with AVX-512 (32 zmm registers, where 4 rows fit) 2-row groups still took 0.86-0.99x the
// 4-row time for LayerNorm and 0.93-1.05x for RMSNorm (docs/measurements.md). The bits do not
// depend on the group (rows in order).
constexpr int kGroup = 2;

// One row of the backward: its inputs and output, x - mean as (x - mh) - mt, rstd, dx's
// constants c1 and c2, and with a.fused its sums (accumulated block by block).
template <class T, class W>
struct BackwardRow {
  const T* x = nullptr;
  const T* dy = nullptr;
  T* dx = nullptr;
  W* st = nullptr;
  const T* pfx = nullptr;  // prefetched at the column the group pass reads (null: none)
  const T* pfy = nullptr;
  float mh = 0, mt = 0, rs = 0, c1 = 0, c2 = 0;
  int64_t skew = 0;  // with streaming stores: elements before dx's first 64-byte boundary
  W s1 = 0, s2 = 0;
};

// dgamma/dbeta of one thread: float32 sums over its last (< kParamRows) rows, added into the
// double sums of the current slot (bind) every kParamRows rows and at the end of a segment.
struct ParamSums {
  int64_t h;
  // dbf is 64 bytes further than h on: with h a multiple of 1024, dgf[j] and dbf[j] would be
  // a multiple of 4 KiB apart, and the store to one would stall the load of the other.
  std::vector<float> part;
  float* dgf;
  float* dbf;
  double* dg = nullptr;
  double* db = nullptr;
  int pending = 0;
  explicit ParamSums(int64_t cols)
      : h(cols), part(cols > 0 ? 2 * cols + 16 : 0, 0.0f), dgf(part.data()), dbf(dgf + h + 16) {}
  void bind(double* slot) {
    dg = slot;
    db = slot + h;
  }
  void flush() {
    for (int64_t j = 0; j < h; ++j) {
      dg[j] += dgf[j];
      db[j] += dbf[j];
      dgf[j] = 0;
      dbf[j] = 0;
    }
    pending = 0;
  }
};

// Columns [j0, j1) of G rows in one pass: with kSums each row's block sums {sum g, sum g*xhat}
// (float lanes in two chains, then added in W: block_sums' order exactly, so the same bits),
// with kParams dgf += dy*xhat, dbf += dy, rows in order (the same bits as row by row).
template <int G, bool kSums, bool kParams, int kM, class T, class P, class W>
inline void group_pass(BackwardRow<T, W>* rw, const P* gamma, int64_t j0, int64_t j1, float* dgf,
                       float* dbf) {
  constexpr int64_t L = vf::L;
  constexpr bool kC = kM != kRms;
  const T* xr[G];
  const T* dr[G];
  const T* px[G];
  float mh[G], mt[G], rs[G];
  vf u0[G], v0[G], u1[G], v1[G];
  for (int i = 0; i < G; ++i) {
    xr[i] = rw[i].x;
    dr[i] = rw[i].dy;
    px[i] = rw[i].pfx;
    mh[i] = rw[i].mh;
    mt[i] = rw[i].mt;
    rs[i] = rw[i].rs;
    u0[i] = v0[i] = u1[i] = v1[i] = vsplat(0);
  }
  // always_inline: GCC kept this lambda out of line, its arrays in memory (2x slower).
  auto step = [&](int64_t j, auto* u, auto* v) __attribute__((always_inline)) {
    using V = std::remove_reference_t<decltype(*u)>;
    V gm{}, pg{}, pb{};
    if (kSums && gamma) gm = load_as<V>(gamma + j);
    if constexpr (kParams) pg = load_as<V>(dgf + j);
    if constexpr (kParams && kC) pb = load_as<V>(dbf + j);
    for (int i = 0; i < G; ++i) {
      const V d = load_as<V>(dr[i] + j);
      const V xhat = xhat_of<kM, V>(xr[i], j, mh[i], mt[i], rs[i]);
      if constexpr (kSums) {
        const V g = gamma ? d * gm : d;
        if constexpr (kC) u[i] += g;
        v[i] += g * xhat;
      }
      if constexpr (kParams) {
        pg = fmadd(d, xhat, pg);
        if constexpr (kC) pb = pb + d;
      }
    }
    if constexpr (kParams) store_as(dgf + j, pg);
    if constexpr (kParams && kC) store_as(dbf + j, pb);
  };
  int64_t j = j0;
  for (; j + 2 * L <= j1; j += 2 * L) {
    for (int i = 0; i < G; ++i)
      if (px[i]) __builtin_prefetch(px[i] + j, 0, 2), __builtin_prefetch(px[i] + j + L, 0, 2);
    step(j, u0, v0);
    step(j + L, u1, v1);
  }
  for (; j + L <= j1; j += L) step(j, u0, v0);
  float f1[G], f2[G];
  for (int i = 0; i < G; ++i) {
    f1[i] = kSums && kC ? hsum(u0[i] + u1[i]) : 0.0f;
    f2[i] = kSums ? hsum(v0[i] + v1[i]) : 0.0f;
  }
  for (; j < j1; ++j) step(j, f1, f2);
  if constexpr (kSums)
    for (int i = 0; i < G; ++i) {
      rw[i].s1 += f1[i];
      rw[i].s2 += f2[i];
    }
}

template <bool kSums, bool kParams, int kM, class T, class P, class W>
inline void group_pass(int g, BackwardRow<T, W>* rw, const P* gamma, int64_t j0, int64_t j1,
                       float* dgf, float* dbf) {
  static_assert(kGroup == 2, "one instance per group size up to kGroup");
  if (g == 1) return group_pass<1, kSums, kParams, kM>(rw, gamma, j0, j1, dgf, dbf);
  return group_pass<2, kSums, kParams, kM>(rw, gamma, j0, j1, dgf, dbf);
}

// The backward apply over a range of rows. Each row needs its sums before its dx, so:
// - not fused (the sums came from the reduce): per block of kBlock columns, the group pass
//   (dgamma/dbeta) reads the block from memory and the dx loop re-reads it from L1;
// - fused (one rank, the kernel's own sums): software-pipelined by group. Per block, the group
//   pass reads the next group's rows from memory (sums, dgamma/dbeta) while the previous group,
//   whose sums are complete and whose rows are still in L2, writes dx. x and dy are read from
//   memory once, and the reads are spread over the whole kernel instead of alternating with
//   phases of arithmetic and writes (the row-by-row form left memory idle while it wrote dx).
// The same columns one group on are prefetched (kGroup rows of 4 KiB are as many pages, on each
// of which the hardware prefetcher starts cold): x by the group pass, dy by the dx loop, so that
// reads are requested through both phases (all of them in the group pass left memory idle while
// dx was written: 10 % slower at [65536, 1024]).
template <int kM, class T, class P, class W, class S>
struct BackwardRows {
  static constexpr bool kC = kM != kRms;
  const RowNormArgs& a;
  const T* dy;
  const T* x;
  const P* gamma;
  const S* mean;
  const S* rstd;
  W* stats;
  double n;
  T* dx;
  bool stream;

  BackwardRow<T, W> row(int64_t r) const {
    BackwardRow<T, W> w;
    w.x = x + r * a.h;
    w.dy = dy + r * a.h;
    w.dx = dx + r * a.h;
    w.st = stats + r * (a.centered ? 2 : 1);
    if (a.centered) split_mean(mean[r], w.mh, w.mt);
    w.rs = static_cast<float>(rstd[r]);
    if constexpr (std::is_same_v<T, float>)
      if (stream) w.skew = ((64 - (reinterpret_cast<uintptr_t>(w.dx) & 63)) & 63) / sizeof(T);
    return w;
  }
  void constants(BackwardRow<T, W>& w) const {
    const int k = a.centered ? 2 : 1;
    const W div = a.final_stats ? W(1) : static_cast<W>(n);
    w.c1 = a.centered ? static_cast<float>(w.st[0] / div) : 0.0f;
    w.c2 = static_cast<float>(w.st[k - 1] / div);
  }
  // A (ga rows, may be 0): the group pass (kSums: their sums; ps: dgamma/dbeta). B (gb rows):
  // dx, given their constants. Both per block of columns, A first.
  template <bool kSums>
  void sweep(BackwardRow<T, W>* A, int ga, ParamSums* ps, BackwardRow<T, W>* B, int gb) const {
    const int64_t h = a.h;
    const T* none = nullptr;
    for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
      const int64_t j1 = std::min(h, j0 + kBlock);
      if (ga > 0) {
        if (ps)
          group_pass<kSums, true, kM>(ga, A, gamma, j0, j1, ps->dgf, ps->dbf);
        else
          group_pass<kSums, false, kM>(ga, A, gamma, j0, j1, nullptr, nullptr);
      }
      for (int i = 0; i < gb; ++i) {
        const BackwardRow<T, W>& w = B[i];
        // Streaming: chunks shifted by the row's skew, so only its first chunk peels.
        const int64_t lo = j0 == 0 ? 0 : std::min(h, j0 + w.skew);
        const int64_t hi = j1 == h ? h : std::min(h, j1 + w.skew);
        const T* xr = w.x + lo;
        const T* dyr = w.dy + lo;
        const float mh = w.mh, mt = w.mt, rs = w.rs, c1 = w.c1, c2 = w.c2;
        const P* gm = gamma ? gamma + lo : nullptr;
        // The group pass prefetches A's x one group on, and the dx loop A's dy (so that memory
        // reads are requested through both phases); without a group pass, B's own x and dy.
        const T* p1 = ga == 0 && w.pfx ? w.pfx + lo : none;
        const T* p2 = ga == 0 && w.pfy ? w.pfy + lo : none;
        if (i < ga && A[i].pfy) p2 = A[i].pfy + lo;
        write_row(w.dx + lo, hi - lo, stream, p1, p2, [=](int64_t j, auto tag) {
          using V = decltype(tag);
          const V xhat = xhat_of<kM, V>(xr, j, mh, mt, rs);
          const V d = load_as<V>(dyr + j);
          const V g = gm ? d * load_as<V>(gm + j) : d;
          if constexpr (kC)
            return splat<V>(rs) * ((g - splat<V>(c1)) - xhat * splat<V>(c2));
          else
            return splat<V>(rs) * (g - xhat * splat<V>(c2));
        });
      }
    }
  }
  // Rows [r0, r1) with ps (may be null) bound to their dgamma/dbeta slot.
  void segment(int64_t r0, int64_t r1, ParamSums* ps) const {
    const bool sums = a.fused && !a.final_stats;
    BackwardRow<T, W> cur[kGroup], nxt[kGroup];
    int gc = 0;
    for (int64_t r = r0; r < r1;) {
      // Groups never straddle a float32 flush of dgamma/dbeta. fp16/bf16 go row by row: with
      // bf16 and groups of 4 rows, GCC 12 -O3 computed wrong sums (not understood; float and
      // fp16 give the bits of the row-by-row form, checked), and their lane-by-lane
      // conversions are the slow part there anyway.
      const int64_t most = std::is_same_v<T, float> ? kGroup : 1;
      int g = static_cast<int>(std::min<int64_t>(most, r1 - r));
      if (ps) g = std::min(g, kParamRows - ps->pending);
      for (int i = 0; i < g; ++i) {
        nxt[i] = row(r + i);
        // The group pass prefetches the same columns g rows on, what it reads next.
        if (a.pf_x) {  // a chunk in cache: the rows the next chunk's partial reads instead
          if (r + i < a.pf_rows) {
            nxt[i].pfx = static_cast<const T*>(a.pf_x) + (r + i) * a.h;
            if (a.pf_dy) nxt[i].pfy = static_cast<const T*>(a.pf_dy) + (r + i) * a.h;
          }
        } else if (r + i + g < a.rows) {
          nxt[i].pfx = nxt[i].x + g * a.h;
          nxt[i].pfy = nxt[i].dy + g * a.h;
        }
      }
      if (!sums) {
        if (a.fused)
          for (int i = 0; i < g; ++i)
            fused_exact_backward(a, nxt[i].dy, nxt[i].x, gamma, nxt[i].mh, nxt[i].mt, nxt[i].rs,
                                 nxt[i].st);
        for (int i = 0; i < g; ++i) constants(nxt[i]);
        sweep<false>(ps ? nxt : nullptr, ps ? g : 0, ps, nxt, g);
      } else {
        sweep<true>(nxt, g, ps, cur, gc);
        for (int i = 0; i < g; ++i) {
          BackwardRow<T, W>& w = nxt[i];
          if (a.centered) {
            w.st[0] = w.s1;
            w.st[1] = w.s2;
          } else {
            w.st[0] = w.s2;
          }
          constants(w);
          cur[i] = w;
        }
        gc = g;
      }
      if (ps && (ps->pending += g) == kParamRows) ps->flush();
      r += g;
    }
    if (gc > 0) sweep<false>(nullptr, 0, nullptr, cur, gc);
    if (ps && ps->pending > 0) ps->flush();
  }
};

// The backward partial with dgamma/dbeta (RowNormArgs::params_in_partial, P > 1): the fused
// kernel's group pass — row sums and dgamma/dbeta in one read of x and dy — so that the apply,
// from cache in a chunked call, only writes dx. Threads, groups and float32 flushes as in
// row_apply_backward's segments (and group_pass's sums in backward_sums' order): the same bits.
// x is prefetched one group on by the group pass, dy here, block by block.
template <int kM, class T, class P, class W, class S>
void partial_with_params(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                         const S* mean, const S* rstd, W* stats) {
  const int64_t h = a.h;
  const int nt = thread_count(a.threads, a.rows);
  const int k = a.centered ? 2 : 1;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t q = a.rows / nt, extra = a.rows % nt;
    const int64_t r0 = t * q + std::min<int64_t>(t, extra), r1 = r0 + q + (t < extra ? 1 : 0);
    ParamSums ps(h);
    ps.bind(a.param_acc + static_cast<size_t>(t) * 2 * h);
    BackwardRow<T, W> rw[kGroup];
    for (int64_t r = r0; r < r1;) {
      const int64_t most = std::is_same_v<T, float> ? kGroup : 1;
      const int g = static_cast<int>(std::min<int64_t>({most, r1 - r, kParamRows - ps.pending}));
      const bool more = r + 2 * g <= a.rows;  // the next group, as far as it has g rows
      for (int i = 0; i < g; ++i) {
        BackwardRow<T, W>& w = rw[i];
        w = BackwardRow<T, W>{};
        w.x = x + (r + i) * h;
        w.dy = dy + (r + i) * h;
        if (kM != kRms) split_mean(mean[r + i], w.mh, w.mt);
        w.rs = static_cast<float>(rstd[r + i]);
        if (more) w.pfx = w.x + g * h;
      }
      for (int64_t j0 = 0; j0 < h; j0 += kBlock) {
        const int64_t j1 = std::min(h, j0 + kBlock);
        group_pass<true, true, kM>(g, rw, gamma, j0, j1, ps.dgf, ps.dbf);
        if (more)
          for (int i = 0; i < g; ++i)
            for (int64_t j = j0; j < j1; j += 64 / static_cast<int64_t>(sizeof(T)))
              __builtin_prefetch(rw[i].dy + g * h + j, 0, 2);
      }
      for (int i = 0; i < g; ++i) {
        W* st = stats + (r + i) * k;
        if (a.centered) {
          st[0] = rw[i].s1;
          st[1] = rw[i].s2;
        } else {
          st[0] = rw[i].s2;
        }
      }
      if ((ps.pending += g) == kParamRows) ps.flush();
      r += g;
    }
    if (ps.pending > 0) ps.flush();
  }
}

}  // namespace

template <class T, class W>
void row_partial_forward(const RowNormArgs& a, const T* x, W* stats) {
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) forward_sums(a, x + r * a.h, stats + r * k, ahead(a, x, r));
}

template <class T, class P, class W, class S>
void row_apply_forward(const RowNormArgs& a, const T* x, const P* gamma, const P* beta, W* stats,
                       double n, double eps, T* y, S* mean, S* rstd) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
  const bool stream = stream_rows<T>(a, 2);
#pragma omp parallel num_threads(thread_count(a.threads, a.rows))
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const T* xr = x + r * h;
      W* st = stats + r * k;
      if (a.fused) fused_forward_stats(a, xr, st);
      W mu = 0, var = 0;
      if (a.final_stats) {
        mu = a.centered ? st[0] : W(0);
        var = st[k - 1];
      } else if (n > 0) {
        if (a.centered) {
          mu = st[0] / static_cast<W>(n);
          var = st[1] / static_cast<W>(n) - mu * mu;
          var = var > 0 ? var : W(0);
        } else {
          var = st[0] / static_cast<W>(n);
        }
      }
      const W rs_w = W(1) / std::sqrt(var + static_cast<W>(eps));
      if (mean) mean[r] = static_cast<S>(mu);
      if (rstd) rstd[r] = static_cast<S>(rs_w);
      float mh, mt;
      split_mean(mu, mh, mt);
      const float rs = static_cast<float>(rs_w);
      const T* pf = !a.pf_x ? ahead(a, x, r)
                    : r < a.pf_rows ? static_cast<const T*>(a.pf_x) + r * h
                                    : nullptr;
      write_row(y + r * h, h, stream, pf, static_cast<const T*>(nullptr),
                [=](int64_t j, auto tag) {
                  using V = decltype(tag);
                  const V xhat = xhat_at<V>(xr, j, mh, mt, rs);
                  const V g = gamma ? load_as<V>(gamma + j) : splat<V>(1.0f);
                  const V b = beta ? load_as<V>(beta + j) : splat<V>(0.0f);
                  return fmadd(xhat, g, b);
                });
    }
    if (stream) stream_fence();
  }
}

template <class T, class P, class W, class S>
void row_partial_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                          const S* mean, const S* rstd, W* stats) {
  if (a.params_in_partial) {
    constexpr int kMean = std::is_same_v<S, float> ? kHead : kFull;
    if (a.centered)
      return partial_with_params<kMean>(a, dy, x, gamma, mean, rstd, stats);
    return partial_with_params<kRms>(a, dy, x, gamma, mean, rstd, stats);
  }
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    float mh = 0, mt = 0;
    if (a.centered) split_mean(mean[r], mh, mt);
    backward_sums(a, dy + r * h, x + r * h, gamma, mh, mt, static_cast<float>(rstd[r]),
                  stats + r * k, ahead(a, dy, r), ahead(a, x, r));
  }
}

template <class T, class P, class W, class S>
void row_apply_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                        const S* mean, const S* rstd, W* stats, double n, T* dx, P* dgamma,
                        P* dbeta) {
  const int64_t h = a.h;
  const int nt = thread_count(a.threads, a.rows);
  const bool params = dgamma || dbeta;
  // dgamma/dbeta summed here, or already by the partial (params_in_partial): then only written.
  const bool sum_params = params && !a.params_in_partial;
  // Per-thread column sums in double, added in a fixed order: deterministic for a thread count.
  // With final_stats: per-block sums instead (kFixedRows rows of the call), deterministic for
  // any thread count. A chunked call (a.param_acc) keeps them across its chunks.
  const bool fixed = params && a.final_stats;
  const int64_t span = fixed ? kFixedRows : 1;      // rows per work item
  const int64_t first = fixed ? a.row0 / span : 0;  // the call's block of this chunk's row 0
  const int64_t items = fixed ? (a.row0 + a.rows + span - 1) / span - first : a.rows;
  const int64_t slots = params ? param_slots(a) : 0;
  std::vector<double> own(params && !a.param_acc ? static_cast<size_t>(slots) * 2 * h : 0, 0.0);
  double* acc = a.param_acc ? a.param_acc : own.data();
  const bool stream = stream_rows<T>(a, 3);
  // The same arithmetic with the terms that are known to be +0 skipped (xhat_of): RMSNorm
  // without dbeta (x - 0, g - c1 with c1 = 0, sum g, dbeta), or the tail of a float32 mean.
  constexpr int kMean = std::is_same_v<S, float> ? kHead : kFull;
  const BackwardRows<kMean, T, P, W, S> k{a, dy, x, gamma, mean, rstd, stats, n, dx, stream};
  const BackwardRows<kRms, T, P, W, S> kr{a, dy, x, gamma, mean, rstd, stats, n, dx, stream};
  const bool rms = !a.centered && !dbeta;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    // This thread's items: OpenMP's static schedule (contiguous, the first items % nt threads
    // one more), so that the per-thread sums do not change with this loop's form.
    const int64_t q = items / nt, extra = items % nt;
    const int64_t i0 = t * q + std::min<int64_t>(t, extra), i1 = i0 + q + (t < extra ? 1 : 0);
    ParamSums ps(sum_params ? h : 0);
    for (int64_t item = i0; item < i1;) {
      // A segment: one fixed block of the call (its own slot; this chunk's rows of it), or the
      // thread's whole range (its slot t).
      const int64_t slot = fixed ? first + item : t, last = fixed ? item + 1 : i1;
      const int64_t r0 = fixed ? std::max<int64_t>(0, (first + item) * span - a.row0) : item;
      const int64_t r1 = fixed ? std::min(a.rows, (first + item + 1) * span - a.row0) : last;
      if (sum_params) ps.bind(acc + static_cast<size_t>(slot) * 2 * h);
      if (rms)
        kr.segment(r0, r1, sum_params ? &ps : nullptr);
      else
        k.segment(r0, r1, sum_params ? &ps : nullptr);
      item = last;
    }
    if (stream) stream_fence();
  }
  if (!params || (a.param_acc && !a.param_last)) return;
  for (int64_t j = 0; j < h; ++j) {
    double g = 0, b = 0;
    for (int64_t t = 0; t < slots; ++t) {
      g += acc[static_cast<size_t>(t) * 2 * h + j];
      b += acc[static_cast<size_t>(t) * 2 * h + h + j];
    }
    if (dgamma) dgamma[j] = from_float<P>(static_cast<float>(g));
    if (dbeta) dbeta[j] = from_float<P>(static_cast<float>(b));
  }
}

size_t row_param_acc_size(const RowNormArgs& a) {
  return static_cast<size_t>(param_slots(a)) * 2 * static_cast<size_t>(a.h);
}

#define TPNORM_ROW_W(T, W) \
  template void row_partial_forward<T, W>(const RowNormArgs&, const T*, W*);
#define TPNORM_ROW_PWS(T, P, W, S)                                                                 \
  template void row_apply_forward<T, P, W, S>(const RowNormArgs&, const T*, const P*, const P*,    \
                                              W*, double, double, T*, S*, S*);                     \
  template void row_partial_backward<T, P, W, S>(const RowNormArgs&, const T*, const T*, const P*, \
                                                 const S*, const S*, W*);                          \
  template void row_apply_backward<T, P, W, S>(const RowNormArgs&, const T*, const T*, const P*,   \
                                               const S*, const S*, W*, double, T*, P*, P*);
// Parameters in the storage type, and float32 parameters with fp16/bf16 activations.
#define TPNORM_ROW_WS(T, W, S) TPNORM_ROW_PWS(T, T, W, S)
#define TPNORM_ROW_WS_F32(T, W, S) TPNORM_ROW_PWS(T, float, W, S)
#define TPNORM_ROW(T) TPNORM_FOR_EACH_W(TPNORM_ROW_W, T) TPNORM_FOR_EACH_WS(TPNORM_ROW_WS, T)
TPNORM_FOR_EACH_STORAGE(TPNORM_ROW)
TPNORM_FOR_EACH_WS(TPNORM_ROW_WS_F32, f16)
TPNORM_FOR_EACH_WS(TPNORM_ROW_WS_F32, bf16)

}  // namespace tpnorm::kernels::cpu
