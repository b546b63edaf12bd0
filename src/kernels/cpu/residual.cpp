// residual.cpp — see residual.h.
#include "kernels/cpu/residual.h"

#include "common/half.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {

template <class T, class W>
void residual_partial_forward(const RowNormArgs& a, const T* x, const T* f, float alpha, T* h,
                              W* stats) {
  const int k = a.centered ? 2 : 1;
  const int nt = thread_count(a.threads, a.rows);
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
#pragma omp parallel for num_threads(thread_count(threads, n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // dh is rounded to T once (as df); dx is alpha times that stored value.
    const float dh = to_float(df[i]) + (dh_extra ? to_float(dh_extra[i]) : 0.0f);
    df[i] = from_float<T>(dh);
    dx[i] = from_float<T>(alpha * dh);
  }
}

#define TPNORM_RESIDUAL_W(T, W)                                                                   \
  template void residual_partial_forward<T, W>(const RowNormArgs&, const T*, const T*, float, T*, \
                                               W*);
#define TPNORM_RESIDUAL(T)                \
  TPNORM_FOR_EACH_W(TPNORM_RESIDUAL_W, T) \
  template void residual_backward_epilogue<T>(int64_t, const T*, float, T*, T*, int);
TPNORM_FOR_EACH_STORAGE(TPNORM_RESIDUAL)

}  // namespace tpnorm::kernels::cpu
