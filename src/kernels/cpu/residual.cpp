// residual.cpp — see residual.h.
#include "kernels/cpu/residual.h"

#include <omp.h>

#include <algorithm>

#include "common/half.h"

namespace tpnorm::kernels::cpu {

template <class T, class W>
void residual_partial_forward(const RowNormArgs& a, const T* x, const T* f, float alpha, T* h,
                              W* stats) {
  const int k = a.centered ? 2 : 1;
  const int nt = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(a.threads > 0 ? a.threads : omp_get_max_threads(), a.rows)));
  // One row per step: the row kernel runs serially on a row that is hot in cache.
  const RowNormArgs one{1, a.h, a.centered, 1};
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = x + r * a.h;
    const T* fr = f + r * a.h;
    T* hr = h + r * a.h;
    for (int64_t j = 0; j < a.h; ++j)
      hr[j] = from_float<T>(alpha * to_float(xr[j]) + to_float(fr[j]));
    row_partial_forward<T, W>(one, hr, stats + r * k);
  }
}

template <class T>
void residual_backward_epilogue(int64_t n, const T* dh_extra, float alpha, T* df, T* dx,
                                int threads) {
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // dh is rounded to T once (as df); dx is alpha times that stored value.
    const float dh = to_float(df[i]) + (dh_extra ? to_float(dh_extra[i]) : 0.0f);
    df[i] = from_float<T>(dh);
    dx[i] = from_float<T>(alpha * dh);
  }
}

#define TPNORM_RESIDUAL_INSTANTIATE(T)                                                             \
  template void residual_partial_forward<T, float>(const RowNormArgs&, const T*, const T*, float,  \
                                                   T*, float*);                                    \
  template void residual_partial_forward<T, double>(const RowNormArgs&, const T*, const T*, float, \
                                                    T*, double*);                                  \
  template void residual_backward_epilogue<T>(int64_t, const T*, float, T*, T*, int);

TPNORM_RESIDUAL_INSTANTIATE(float)
TPNORM_RESIDUAL_INSTANTIATE(f16)
TPNORM_RESIDUAL_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cpu
