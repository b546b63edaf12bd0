// exact_rows.cpp — CPU kernels of Stats::kExact for row norms; see exact_rows.h.
//
// A row is summed in pieces of kPiece values through exact_accumulate (kernels/cpu/
// exact_bins.h): fp16/bf16 rows and the backward's terms g and g*xhat are first formed as
// float32 in a small buffer (the terms with the vector formula of every rank, so the integers
// do not depend on where a column sits). The sums are exact, so the pieces, the vector width
// and the thread count change nothing.
#include "kernels/cpu/exact_rows.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "common/exact_sum.h"
#include "common/half.h"
#include "kernels/cpu/exact_bins.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {
namespace {

constexpr int64_t kPiece = 2048;  // float32 values formed at a time (8 KiB a buffer)

struct RowSums {
  exact::Sum1 s1, t1;  // sum x (forward) or sum g (backward); sum g*xhat (backward)
  exact::Sum2 s2;      // sum x^2 (forward)
  int64_t bad = 0;
};

// A row's sums: sum x and sum x^2 (forward) of h values.
template <class T>
RowSums forward_row_sums(const T* xr, int64_t h) {
  RowSums s;
  if constexpr (std::is_same_v<T, float>) {
    exact_accumulate(xr, h, s.s1, &s.s2, s.bad);
  } else {
    alignas(64) float buf[kPiece];
    for (int64_t j0 = 0; j0 < h; j0 += kPiece) {
      const int64_t n = std::min(kPiece, h - j0);
      for (int64_t j = 0; j < n; ++j) buf[j] = to_float(xr[j0 + j]);
      exact_accumulate(buf, n, s.s1, &s.s2, s.bad);
    }
  }
  return s;
}

// A row's backward sums: sum g (centred) and sum g*xhat, with the terms formed as the apply
// kernels form them: xhat = ((x - mh) - mt) * rs, g = dy * gamma.
template <class T, class P>
RowSums backward_row_sums(bool centered, const T* dyr, const T* xr, const P* gamma, float mh,
                          float mt, float rs, int64_t h) {
  RowSums s;
  alignas(64) float g[kPiece], gx[kPiece];
  for (int64_t j0 = 0; j0 < h; j0 += kPiece) {
    const int64_t n = std::min(kPiece, h - j0);
    auto terms = [&](int64_t j, auto tag) {
      using V = decltype(tag);
      const V xhat = ((load_as<V>(xr + j0 + j) - splat<V>(mh)) - splat<V>(mt)) * splat<V>(rs);
      const V d = load_as<V>(dyr + j0 + j);
      const V gg = gamma ? d * load_as<V>(gamma + j0 + j) : d;
      store_as(g + j, gg);
      store_as(gx + j, gg * xhat);
    };
    int64_t j = 0;
    for (; j + vf::L <= n; j += vf::L) terms(j, vf{});
    for (; j < n; ++j) terms(j, 0.0f);
    if (centered) exact_accumulate(g, n, s.s1, nullptr, s.bad);
    exact_accumulate(gx, n, s.t1, nullptr, s.bad);
  }
  return s;
}

// The final statistics of a row from its (summed) integers; see exact_row_finish.
void finish_row(bool centered, bool forward, int64_t bad, const exact::Sum1& s1,
                const exact::Sum2& s2, const exact::Sum1& t1, uint64_t count, double* st) {
  const int w = centered ? 2 : 1;
  if (bad != 0 || count == 0) {  // a bad value somewhere in the row, on some rank; or no values
    for (int i = 0; i < w; ++i) st[i] = bad != 0 ? std::numeric_limits<double>::quiet_NaN() : 0.0;
    return;
  }
  if (forward) {
    if (centered) {
      st[0] = exact::mean(s1, count);
      st[1] = exact::variance(s1, s2, count);
    } else {
      st[0] = exact::mean_square(s2, count);
    }
  } else {
    if (centered) st[0] = exact::mean(s1, count);
    st[w - 1] = exact::mean(t1, count);
  }
}

}  // namespace

int exact_row_limbs(bool centered, bool forward) {
  const int second = forward ? exact::kLimbs2 : exact::kLimbs1;
  return 1 + (centered ? exact::kLimbs1 : 0) + second;
}

template <class T>
void row_exact_partial_forward(const RowNormArgs& a, const T* x, int64_t* limbs) {
  const int k = exact_row_limbs(a.centered, true);
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const RowSums s = forward_row_sums(x + r * a.h, a.h);
    int64_t* out = limbs + r * k;
    out[0] = s.bad;
    if (a.centered) exact::pack(s.s1, out + 1, exact::kLimbs1);
    exact::pack(s.s2, out + k - exact::kLimbs2, exact::kLimbs2);
  }
}

template <class T, class P, class S>
void row_exact_partial_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                                const S* mean, const S* rstd, int64_t* limbs) {
  const int k = exact_row_limbs(a.centered, false);
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    float mh = 0, mt = 0;
    if (a.centered) split_mean(mean[r], mh, mt);
    const RowSums s = backward_row_sums(a.centered, dy + r * a.h, x + r * a.h, gamma, mh, mt,
                                        static_cast<float>(rstd[r]), a.h);
    int64_t* out = limbs + r * k;
    out[0] = s.bad;
    if (a.centered) exact::pack(s.s1, out + 1, exact::kLimbs1);
    exact::pack(s.t1, out + k - exact::kLimbs1, exact::kLimbs1);
  }
}

template <class T>
void exact_row_final_forward(bool centered, const T* xr, int64_t h, double* st) {
  const RowSums s = forward_row_sums(xr, h);
  finish_row(centered, true, s.bad, s.s1, s.s2, s.t1, static_cast<uint64_t>(h), st);
}

template <class T, class P>
void exact_row_final_backward(bool centered, const T* dyr, const T* xr, const P* gamma, float mh,
                              float mt, float rs, int64_t h, double* st) {
  const RowSums s = backward_row_sums(centered, dyr, xr, gamma, mh, mt, rs, h);
  finish_row(centered, false, s.bad, s.s1, s.s2, s.t1, static_cast<uint64_t>(h), st);
}

void exact_row_finish(const RowNormArgs& a, bool forward, const int64_t* limbs, double n,
                      double* stats) {
  const int k = exact_row_limbs(a.centered, forward);
  const int w = a.centered ? 2 : 1;
  const auto count = static_cast<uint64_t>(n);
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t* in = limbs + r * k;
    exact::Sum1 s1, t1;
    exact::Sum2 s2;
    if (forward) {
      s2 = exact::unpack<8>(in + k - exact::kLimbs2, exact::kLimbs2);
      if (a.centered) s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
    } else {
      if (a.centered) s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
      t1 = exact::unpack<4>(in + k - exact::kLimbs1, exact::kLimbs1);
    }
    finish_row(a.centered, forward, in[0], s1, s2, t1, count, stats + r * w);
  }
}

// gamma in the storage type, and float32 gamma next to fp16/bf16 x (mixed precision).
#define TPNORM_EXACT_ROW_PS(T, P, S)                                                        \
  template void row_exact_partial_backward<T, P, S>(const RowNormArgs&, const T*, const T*, \
                                                    const P*, const S*, const S*, int64_t*);
#define TPNORM_EXACT_ROW_P(T, P)                                                                 \
  template void exact_row_final_backward<T, P>(bool, const T*, const T*, const P*, float, float, \
                                               float, int64_t, double*);                         \
  TPNORM_EXACT_ROW_PS(T, P, float) TPNORM_EXACT_ROW_PS(T, P, double)
#define TPNORM_EXACT_ROW(T)                                                           \
  template void row_exact_partial_forward<T>(const RowNormArgs&, const T*, int64_t*); \
  template void exact_row_final_forward<T>(bool, const T*, int64_t, double*);         \
  TPNORM_EXACT_ROW_P(T, T)
TPNORM_FOR_EACH_STORAGE(TPNORM_EXACT_ROW)
TPNORM_EXACT_ROW_P(f16, float)
TPNORM_EXACT_ROW_P(bf16, float)

}  // namespace tpnorm::kernels::cpu
