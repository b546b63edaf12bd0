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
//   measured faster; its first 4 KiB were prefetched by the previous row's apply loop.)
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
inline void forward_sums(const RowNormArgs& a, const T* xr, W* st) {
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
          d1, d2);
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
          s1, s2);
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

}  // namespace

template <class T, class W>
void row_partial_forward(const RowNormArgs& a, const T* x, W* stats) {
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) forward_sums(a, x + r * a.h, stats + r * k);
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
      write_row(y + r * h, h, stream, ahead(a, x, r), static_cast<const T*>(nullptr),
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
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    float mh = 0, mt = 0;
    if (a.centered) split_mean(mean[r], mh, mt);
    backward_sums(a, dy + r * h, x + r * h, gamma, mh, mt, static_cast<float>(rstd[r]),
                  stats + r * k);
  }
}

template <class T, class P, class W, class S>
void row_apply_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                        const S* mean, const S* rstd, W* stats, double n, T* dx, P* dgamma,
                        P* dbeta) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
  const int nt = thread_count(a.threads, a.rows);
  const bool params = dgamma || dbeta;
  const bool stream = stream_rows<T>(a, 3);
  // Per-thread column sums in double, added in a fixed order: deterministic for a thread count.
  // With final_stats: per-block sums instead (kFixedRows rows of the call), deterministic for
  // any thread count. A chunked call (a.param_acc) keeps them across its chunks.
  const bool fixed = params && a.final_stats;
  const int64_t span = fixed ? kFixedRows : 1;  // rows per work item of the loop
  const int64_t first = fixed ? a.row0 / span : 0;  // the call's block of this chunk's row 0
  const int64_t items = fixed ? (a.row0 + a.rows + span - 1) / span - first : a.rows;
  const int64_t slots = params ? param_slots(a) : 0;
  std::vector<double> own(params && !a.param_acc ? static_cast<size_t>(slots) * 2 * h : 0, 0.0);
  double* acc = a.param_acc ? a.param_acc : own.data();
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    double* dg = params ? acc + static_cast<size_t>(t) * 2 * h : nullptr;
    double* db = params ? dg + h : nullptr;
    // This thread's float32 sums over its last (< kParamRows) rows.
    // dbf is 64 bytes further than h on: with h a multiple of 1024, dgf[j] and dbf[j] would be
    // a multiple of 4 KiB apart, and the store to one would stall the load of the other.
    std::vector<float> part(params ? static_cast<size_t>(2) * h + 16 : 0, 0.0f);
    float* dgf = part.data();
    float* dbf = dgf + (params ? h + 16 : 0);
    int pending = 0;
    auto flush = [&] {
      for (int64_t j = 0; j < h; ++j) {
        dg[j] += dgf[j];
        db[j] += dbf[j];
        dgf[j] = 0;
        dbf[j] = 0;
      }
      pending = 0;
    };
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      int64_t r0 = item, r1 = item + 1;  // this chunk's rows of the item
      if (fixed) {
        dg = acc + static_cast<size_t>(first + item) * 2 * h;
        db = dg + h;
        r0 = std::max<int64_t>(0, (first + item) * span - a.row0);
        r1 = std::min(a.rows, (first + item + 1) * span - a.row0);
      }
      for (int64_t r = r0; r < r1; ++r) {
        float mh = 0, mt = 0;
        if (a.centered) split_mean(mean[r], mh, mt);
        const float rs = static_cast<float>(rstd[r]);
        const T* xr = x + r * h;
        const T* dyr = dy + r * h;
        W* st = stats + r * k;
        if (a.fused && a.final_stats)
          fused_exact_backward(a, dyr, xr, gamma, mh, mt, rs, st);
        else if (a.fused)
          backward_sums(a, dyr, xr, gamma, mh, mt, rs, st, ahead(a, dy, r), ahead(a, x, r));
        const W div = a.final_stats ? W(1) : static_cast<W>(n);
        const float c1 = a.centered ? static_cast<float>(st[0] / div) : 0.0f;
        const float c2 = static_cast<float>(st[k - 1] / div);
        write_row(dx + r * h, h, stream, ahead(a, x, r), ahead(a, dy, r), [=](int64_t j, auto tag) {
          using V = decltype(tag);
          const V xhat = xhat_at<V>(xr, j, mh, mt, rs);
          const V d = load_as<V>(dyr + j);
          const V g = gamma ? d * load_as<V>(gamma + j) : d;
          if (params) {  // both loads before the stores (these may alias)
            const V g0 = load_as<V>(dgf + j), b0 = load_as<V>(dbf + j);
            store_as(dgf + j, fmadd(d, xhat, g0));
            store_as(dbf + j, b0 + d);
          }
          return splat<V>(rs) * ((g - splat<V>(c1)) - xhat * splat<V>(c2));
        });
        if (params && ++pending == kParamRows) flush();
      }
      if (fixed && pending > 0) flush();
    }
    if (params && pending > 0) flush();
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
