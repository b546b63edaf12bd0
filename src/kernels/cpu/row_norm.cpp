// row_norm.cpp — CPU kernels for LayerNorm / RMSNorm rows; see row_norm.h.
//
// Precision: element work is float32 (8 lanes); statistics are W (double in the robust mode).
// x - mean is formed as (x - float(mean)) - float(mean - float(mean)): the first difference is
// exact or one rounding of a small number, so xhat keeps float accuracy even when |mean| is
// 1e4 times the standard deviation. Reductions use `omp simd` lanes, which the compiler may
// reassociate (no -ffast-math needed).
#include "kernels/cpu/row_norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/half.h"

namespace tpnorm::kernels::cpu {
namespace {

int thread_count(const RowNormArgs& a) {
  const int t = a.threads > 0 ? a.threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, a.rows)));
}

// The exact split of a mean into float head + float tail.
template <class S>
inline void split_mean(S mean, float& head, float& tail) {
  head = static_cast<float>(mean);
  tail = static_cast<float>(static_cast<double>(mean) - static_cast<double>(head));
}

}  // namespace

template <class T, class W>
void row_partial_forward(const RowNormArgs& a, const T* x, W* stats) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = x + r * h;
    W s1 = 0, s2 = 0;
    if (h > 0) {
      if constexpr (std::is_same_v<W, double>) {
        // Accumulate around a pivot from the row itself, then shift back exactly enough.
        const double pivot = a.centered ? to_float(xr[0]) : 0.0;
        double d1 = 0, d2 = 0;
#pragma omp simd reduction(+ : d1, d2)
        for (int64_t j = 0; j < h; ++j) {
          const double d = static_cast<double>(to_float(xr[j])) - pivot;
          d1 += d;
          d2 += d * d;
        }
        s1 = pivot * static_cast<double>(h) + d1;
        s2 = d2 + 2.0 * pivot * d1 + pivot * pivot * static_cast<double>(h);
      } else {
        float f1 = 0, f2 = 0;
#pragma omp simd reduction(+ : f1, f2)
        for (int64_t j = 0; j < h; ++j) {
          const float v = to_float(xr[j]);
          f1 += v;
          f2 += v * v;
        }
        s1 = f1;
        s2 = f2;
      }
    }
    if (a.centered) {
      stats[r * k] = s1;
      stats[r * k + 1] = s2;
    } else {
      stats[r] = s2;
    }
  }
}

template <class T, class W, class S>
void row_apply_forward(const RowNormArgs& a, const T* x, const T* gamma, const T* beta,
                       const W* stats, double n, double eps, T* y, S* mean, S* rstd) {
  const int64_t h = a.h;
#pragma omp parallel for num_threads(thread_count(a)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    W mu = 0, var = 0;
    if (n > 0) {
      if (a.centered) {
        mu = stats[2 * r] / static_cast<W>(n);
        var = stats[2 * r + 1] / static_cast<W>(n) - mu * mu;
        var = var > 0 ? var : W(0);
      } else {
        var = stats[r] / static_cast<W>(n);
      }
    }
    const W rs_w = W(1) / std::sqrt(var + static_cast<W>(eps));
    if (mean) mean[r] = static_cast<S>(mu);
    if (rstd) rstd[r] = static_cast<S>(rs_w);
    float mh, mt;
    split_mean(mu, mh, mt);
    const float rs = static_cast<float>(rs_w);
    const T* xr = x + r * h;
    T* yr = y + r * h;
    for (int64_t j = 0; j < h; ++j) {
      const float xhat = ((to_float(xr[j]) - mh) - mt) * rs;
      const float g = gamma ? to_float(gamma[j]) : 1.0f;
      const float b = beta ? to_float(beta[j]) : 0.0f;
      yr[j] = from_float<T>(xhat * g + b);
    }
  }
}

template <class T, class W, class S>
void row_partial_backward(const RowNormArgs& a, const T* dy, const T* x, const T* gamma,
                          const S* mean, const S* rstd, W* stats) {
  const int64_t h = a.h;
#pragma omp parallel for num_threads(thread_count(a)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    float mh = 0, mt = 0;
    if (a.centered) split_mean(mean[r], mh, mt);
    const float rs = static_cast<float>(rstd[r]);
    const T* xr = x + r * h;
    const T* dyr = dy + r * h;
    W sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
    for (int64_t j = 0; j < h; ++j) {
      const float xhat = ((to_float(xr[j]) - mh) - mt) * rs;
      const float g = to_float(dyr[j]) * (gamma ? to_float(gamma[j]) : 1.0f);
      sg += g;
      sgx += static_cast<W>(g * xhat);
    }
    if (a.centered) {
      stats[2 * r] = sg;
      stats[2 * r + 1] = sgx;
    } else {
      stats[r] = sgx;
    }
  }
}

template <class T, class W, class S>
void row_apply_backward(const RowNormArgs& a, const T* dy, const T* x, const T* gamma,
                        const S* mean, const S* rstd, const W* stats, double n, T* dx,
                        T* dgamma, T* dbeta) {
  const int64_t h = a.h;
  const int nt = thread_count(a);
  const bool params = dgamma || dbeta;
  // Per-thread column sums in double, added in a fixed order: deterministic for a thread count.
  std::vector<double> acc(params ? static_cast<size_t>(nt) * 2 * h : 0, 0.0);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    double* dg = params ? acc.data() + static_cast<size_t>(t) * 2 * h : nullptr;
    double* db = params ? dg + h : nullptr;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      float mh = 0, mt = 0;
      if (a.centered) split_mean(mean[r], mh, mt);
      const float rs = static_cast<float>(rstd[r]);
      const float c1 = a.centered ? static_cast<float>(stats[2 * r] / static_cast<W>(n)) : 0.0f;
      const float c2 = static_cast<float>(stats[a.centered ? 2 * r + 1 : r] / static_cast<W>(n));
      const T* xr = x + r * h;
      const T* dyr = dy + r * h;
      T* dxr = dx + r * h;
      for (int64_t j = 0; j < h; ++j) {
        const float xhat = ((to_float(xr[j]) - mh) - mt) * rs;
        const float d = to_float(dyr[j]);
        const float g = d * (gamma ? to_float(gamma[j]) : 1.0f);
        dxr[j] = from_float<T>(rs * (g - c1 - xhat * c2));
        if (params) {
          dg[j] += static_cast<double>(d * xhat);
          db[j] += d;
        }
      }
    }
  }
  if (!params) return;
  for (int64_t j = 0; j < h; ++j) {
    double g = 0, b = 0;
    for (int t = 0; t < nt; ++t) {
      g += acc[static_cast<size_t>(t) * 2 * h + j];
      b += acc[static_cast<size_t>(t) * 2 * h + h + j];
    }
    if (dgamma) dgamma[j] = from_float<T>(static_cast<float>(g));
    if (dbeta) dbeta[j] = from_float<T>(static_cast<float>(b));
  }
}

#define TPNORM_ROW_INSTANTIATE_WS(T, W, S)                                                      \
  template void row_apply_forward<T, W, S>(const RowNormArgs&, const T*, const T*, const T*,    \
                                           const W*, double, double, T*, S*, S*);               \
  template void row_partial_backward<T, W, S>(const RowNormArgs&, const T*, const T*, const T*, \
                                              const S*, const S*, W*);                          \
  template void row_apply_backward<T, W, S>(const RowNormArgs&, const T*, const T*, const T*,   \
                                            const S*, const S*, const W*, double, T*, T*, T*);
#define TPNORM_ROW_INSTANTIATE(T)                                                  \
  template void row_partial_forward<T, float>(const RowNormArgs&, const T*, float*);   \
  template void row_partial_forward<T, double>(const RowNormArgs&, const T*, double*); \
  TPNORM_ROW_INSTANTIATE_WS(T, float, float)                                       \
  TPNORM_ROW_INSTANTIATE_WS(T, float, double)                                      \
  TPNORM_ROW_INSTANTIATE_WS(T, double, float)                                      \
  TPNORM_ROW_INSTANTIATE_WS(T, double, double)

TPNORM_ROW_INSTANTIATE(float)
TPNORM_ROW_INSTANTIATE(f16)
TPNORM_ROW_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cpu
