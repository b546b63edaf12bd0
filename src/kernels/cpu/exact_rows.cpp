// exact_rows.cpp — CPU kernels of Stats::kExact for row norms; see exact_rows.h.
//
// A row is summed in one pass through an ExactStream (kernels/cpu/exact_bins.h): the values
// (x, or the backward's terms g and g*xhat, formed with the vector formula of every rank so the
// integers do not depend on where a column sits) go from registers into the exact sums, with
// the inputs prefetched ahead as the robust kernels do. The sums are exact, so the vector
// width, the tails and the thread count change nothing.
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

struct RowSums {
  exact::Sum1 s1, t1;  // sum x (forward) or sum g (backward); sum g*xhat (backward)
  exact::Sum2 s2;      // sum x^2 (forward)
  int64_t bad = 0;
};

// Prefetches p + j + kAheadBytes (the element read kAheadBytes later) while that stays inside
// `room` elements from p (the partial kernels pass the rest of the tensor; the one-rank path
// the row, whose next row the apply loop prefetches).
template <class T>
inline void prefetch_ahead(const T* p, int64_t j, int64_t room) {
  const int64_t d = kAheadBytes / static_cast<int64_t>(sizeof(T));
  if (j + d < room) prefetch_l2(p + j + d);
}

// A row's sums: sum x and sum x^2 (forward) of h values, in one pass.
template <class T>
RowSums forward_row_sums(const T* xr, int64_t h, int64_t room) {
  RowSums s;
  ExactStream<true> sums(s.s1, &s.s2, s.bad);
  const int64_t full = h / vf::L, j0 = full * vf::L;
  sums.add_n(full, [&](int64_t i) {
    prefetch_ahead(xr, i * vf::L, room);
    return load_as<vf>(xr + i * vf::L);
  });
  if (j0 < h) {
    float t[vf::L];
    for (int64_t j = j0; j < h; ++j) t[j - j0] = to_float(xr[j]);
    sums.add_partial(t, static_cast<int>(h - j0));
  }
  sums.finish();
  return s;
}

// A row's backward sums: sum g (centred) and sum g*xhat, with the terms formed as the apply
// kernels form them: xhat = ((x - mh) - mt) * rs, g = dy * gamma (lane-wise; no contraction, so
// a tail element gets the bits it would get in a vector), summed in the same pass.
template <class T, class P>
RowSums backward_row_sums(bool centered, const T* dyr, const T* xr, const P* gamma, float mh,
                          float mt, float rs, int64_t h, int64_t room) {
  RowSums s;
  ExactStream<false> sg(s.s1, nullptr, s.bad), sgx(s.t1, nullptr, s.bad);
  auto terms = [&](int64_t j, auto tag) {
    using V = decltype(tag);
    const V xhat = ((load_as<V>(xr + j) - splat<V>(mh)) - splat<V>(mt)) * splat<V>(rs);
    const V d = load_as<V>(dyr + j);
    const V g = gamma ? d * load_as<V>(gamma + j) : d;
    return Two<V>{g, g * xhat};
  };
  auto vector = [&](int64_t i) {
    prefetch_ahead(xr, i * vf::L, room);
    prefetch_ahead(dyr, i * vf::L, room);
    return terms(i * vf::L, vf{});
  };
  const int64_t full = h / vf::L, j0 = full * vf::L;
  if (centered)
    exact_add_both(sg, sgx, full, vector);
  else
    sgx.add_n(full, [&](int64_t i) { return vector(i).b; });
  if (j0 < h) {
    float g[vf::L], gx[vf::L];
    for (int64_t j = j0; j < h; ++j) {
      const Two<float> t = terms(j, 0.0f);
      g[j - j0] = t.a;
      gx[j - j0] = t.b;
    }
    if (centered) sg.add_partial(g, static_cast<int>(h - j0));
    sgx.add_partial(gx, static_cast<int>(h - j0));
  }
  sg.finish();
  sgx.finish();
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
    const RowSums s = forward_row_sums(x + r * a.h, a.h, (a.rows - r) * a.h);
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
                                        static_cast<float>(rstd[r]), a.h, (a.rows - r) * a.h);
    int64_t* out = limbs + r * k;
    out[0] = s.bad;
    if (a.centered) exact::pack(s.s1, out + 1, exact::kLimbs1);
    exact::pack(s.t1, out + k - exact::kLimbs1, exact::kLimbs1);
  }
}

template <class T>
void exact_row_final_forward(bool centered, const T* xr, int64_t h, double* st) {
  const RowSums s = forward_row_sums(xr, h, h);
  finish_row(centered, true, s.bad, s.s1, s.s2, s.t1, static_cast<uint64_t>(h), st);
}

template <class T, class P>
void exact_row_final_backward(bool centered, const T* dyr, const T* xr, const P* gamma, float mh,
                              float mt, float rs, int64_t h, double* st) {
  const RowSums s = backward_row_sums(centered, dyr, xr, gamma, mh, mt, rs, h, h);
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
