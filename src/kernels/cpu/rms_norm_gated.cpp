// rms_norm_gated.cpp — CPU kernels of the gated RMSNorm; see rms_norm_gated.h.
//
// Scalar loops over each row's group runs: the op is memory-bound next to its one collective,
// and the element formulas (silu, its derivative) are the same code for every storage type, so
// a term's bits never depend on where its channel sits (what Stats::kExact needs).
#include "kernels/cpu/rms_norm_gated.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/exact_sum.h"
#include "common/half.h"
#include "kernels/cpu/exact_bins.h"
#include "kernels/cpu/exact_rows.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {
namespace {

// The compute type: float32, float64 for fp64 storage.
template <class T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
inline Acc<T> load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, double>)
    return p[i];
  else
    return to_float(p[i]);
}
template <class T>
inline T store(Acc<T> v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return from_float<T>(v);
}
template <class A, class P>
inline A param(const P* w, int64_t c) {
  if (!w) return A(1);
  if constexpr (std::is_same_v<P, double> || std::is_same_v<P, float>)
    return static_cast<A>(w[c]);
  else
    return to_float(w[c]);
}

// The gate's sigmoid s, silu(z) = z * s and silu'(z) = s * (1 + z * (1 - s)).
template <class A>
struct Gate {
  A silu, dsilu;
};
template <class A>
inline Gate<A> gate(A z) {
  const A s = A(1) / (A(1) + std::exp(-z));
  return {z * s, s * (A(1) + z * (A(1) - s))};
}

// One contiguous run of a row's local channels inside one group: local columns [j0, j1).
struct Run {
  int64_t g, j0, j1;
};
// fn(Run) for each group run of a row, in channel order.
template <class Fn>
inline void for_each_run(const GatedArgs& a, Fn&& fn) {
  for (int64_t j = 0; j < a.c_local;) {
    const int64_t g = (a.c0 + j) / a.group_size;
    const int64_t end = std::min(a.c_local, (g + 1) * a.group_size - a.c0);
    fn(Run{g, j, end});
    j = end;
  }
}

// u, the normalized input: x * silu(z) gate first, else x.
template <class T>
inline Acc<T> input(const GatedArgs& a, const T* xr, const T* zr, int64_t j) {
  const Acc<T> x = load(xr, j);
  return zr && !a.norm_before_gate ? x * gate(load(zr, j)).silu : x;
}

// The backward's per-element terms: g (the gradient reaching uhat), uhat, and the dweight term.
template <class A>
struct Terms {
  A g, uhat, dw;
  Gate<A> gt;
};
template <class T, class P>
inline Terms<Acc<T>> terms(const GatedArgs& a, const T* dyr, const T* xr, const T* zr, const P* w,
                           Acc<T> rs, int64_t j) {
  using A = Acc<T>;
  Terms<A> t{};
  const A dy = load(dyr, j), x = load(xr, j), wj = param<A>(w, j);
  if (zr) t.gt = gate(load(zr, j));
  if (!zr) {
    t.uhat = x * rs;
    t.g = dy * wj;
    t.dw = dy * t.uhat;
  } else if (a.norm_before_gate) {
    t.uhat = x * rs;
    t.g = (dy * wj) * t.gt.silu;
    t.dw = (dy * t.uhat) * t.gt.silu;
  } else {
    t.uhat = (x * t.gt.silu) * rs;
    t.g = dy * wj;
    t.dw = dy * t.uhat;
  }
  return t;
}

// dw[j] += the dweight terms of column j over all rows, in row order: threads own column
// blocks, so neither the split nor the thread count changes the order of the additions.
template <class T, class P, class S>
void dweight_sums(const GatedArgs& a, const T* dy, const T* x, const T* z, const P* w,
                  const S* rstd, double* dw) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (a.c_local + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(thread_count(a.threads, blocks)) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kBlock, j1 = std::min(a.c_local, j0 + kBlock);
    for (int64_t j = j0; j < j1; ++j) dw[j] = 0;
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t off = r * a.c_local;
      const T* zr = z ? z + off : nullptr;
      for (int64_t j = j0; j < j1; ++j) {
        const auto rs = static_cast<Acc<T>>(rstd[r * a.groups + (a.c0 + j) / a.group_size]);
        dw[j] += static_cast<double>(terms(a, dy + off, x + off, zr, w, rs, j).dw);
      }
    }
  }
}

}  // namespace

template <class T, class W>
void gated_partial_forward(const GatedArgs& a, const T* x, const T* z, W* stats) {
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = x + r * a.c_local;
    const T* zr = z ? z + r * a.c_local : nullptr;
    for_each_run(a, [&](Run run) {
      W s = 0;
      for (int64_t j = run.j0; j < run.j1; ++j) {
        const W u = static_cast<W>(input(a, xr, zr, j));
        s += u * u;
      }
      stats[r * a.groups + run.g] = s;
    });
  }
}

template <class T>
void gated_exact_partial_forward(const GatedArgs& a, const T* x, const T* z, int64_t* limbs) {
  const int k = exact_row_limbs(false, true);
#pragma omp parallel num_threads(thread_count(a.threads, a.rows))
  {
    std::vector<float> u(static_cast<size_t>(std::min(a.c_local, a.group_size)));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const T* xr = x + r * a.c_local;
      const T* zr = z ? z + r * a.c_local : nullptr;
      for_each_run(a, [&](Run run) {
        for (int64_t j = run.j0; j < run.j1; ++j) u[j - run.j0] = input(a, xr, zr, j);
        exact::Sum1 s1;
        exact::Sum2 s2;
        int64_t* out = limbs + (r * a.groups + run.g) * k;
        exact_accumulate(u.data(), run.j1 - run.j0, s1, &s2, out[0]);
        exact::pack(s2, out + k - exact::kLimbs2, exact::kLimbs2);
      });
    }
  }
}

template <class T, class P, class W, class S>
void gated_apply_forward(const GatedArgs& a, const T* x, const T* z, const P* w, const W* stats,
                         double n, double eps, T* y, S* rstd) {
  using A = Acc<T>;
  auto rstd_of = [&](int64_t slot) {
    const double ms =
        a.final_stats ? static_cast<double>(stats[slot]) : static_cast<double>(stats[slot]) / n;
    return 1.0 / std::sqrt(ms + eps);
  };
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    if (rstd)
      for (int64_t g = 0; g < a.groups; ++g)
        rstd[r * a.groups + g] = static_cast<S>(rstd_of(r * a.groups + g));
    const T* xr = x + r * a.c_local;
    const T* zr = z ? z + r * a.c_local : nullptr;
    T* yr = y + r * a.c_local;
    for_each_run(a, [&](Run run) {
      const auto rs = static_cast<A>(rstd_of(r * a.groups + run.g));
      for (int64_t j = run.j0; j < run.j1; ++j) {
        A v = (input(a, xr, zr, j) * rs) * param<A>(w, j);
        if (zr && a.norm_before_gate) v = v * gate(load(zr, j)).silu;
        yr[j] = store<T>(v);
      }
    });
  }
}

template <class T, class P, class W, class S>
void gated_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const P* w,
                            const S* rstd, W* stats, double* dw) {
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t off = r * a.c_local;
    const T* zr = z ? z + off : nullptr;
    for_each_run(a, [&](Run run) {
      const auto rs = static_cast<Acc<T>>(rstd[r * a.groups + run.g]);
      W s = 0;
      for (int64_t j = run.j0; j < run.j1; ++j) {
        const auto t = terms(a, dy + off, x + off, zr, w, rs, j);
        s += static_cast<W>(t.g * t.uhat);
      }
      stats[r * a.groups + run.g] = s;
    });
  }
  if (dw) dweight_sums(a, dy, x, z, w, rstd, dw);
}

template <class T, class P, class S>
void gated_exact_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z,
                                  const P* w, const S* rstd, int64_t* limbs, double* dw) {
  const int k = exact_row_limbs(false, false);
#pragma omp parallel num_threads(thread_count(a.threads, a.rows))
  {
    std::vector<float> gu(static_cast<size_t>(std::min(a.c_local, a.group_size)));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t off = r * a.c_local;
      const T* zr = z ? z + off : nullptr;
      for_each_run(a, [&](Run run) {
        const auto rs = static_cast<float>(rstd[r * a.groups + run.g]);
        for (int64_t j = run.j0; j < run.j1; ++j) {
          const auto t = terms(a, dy + off, x + off, zr, w, rs, j);
          gu[j - run.j0] = t.g * t.uhat;
        }
        exact::Sum1 t1;
        int64_t* out = limbs + (r * a.groups + run.g) * k;
        exact_accumulate(gu.data(), run.j1 - run.j0, t1, nullptr, out[0]);
        exact::pack(t1, out + k - exact::kLimbs1, exact::kLimbs1);
      });
    }
  }
  if (dw) dweight_sums(a, dy, x, z, w, rstd, dw);
}

template <class T, class P, class W, class S>
void gated_apply_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const P* w,
                          const S* rstd, const W* stats, double n, const double* dw, T* dx, T* dz,
                          P* dweight) {
  using A = Acc<T>;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t off = r * a.c_local;
    const T* zr = z ? z + off : nullptr;
    for_each_run(a, [&](Run run) {
      const int64_t slot = r * a.groups + run.g;
      const auto rs = static_cast<A>(rstd[slot]);
      const auto m = static_cast<A>(a.final_stats ? static_cast<double>(stats[slot])
                                                  : static_cast<double>(stats[slot]) / n);
      for (int64_t j = run.j0; j < run.j1; ++j) {
        const auto t = terms(a, dy + off, x + off, zr, w, rs, j);
        const A d = rs * (t.g - t.uhat * m);  // the gradient reaching the normalized input
        if (!zr) {
          dx[off + j] = store<T>(d);
        } else if (a.norm_before_gate) {
          dx[off + j] = store<T>(d);
          dz[off + j] = store<T>(((load(dy + off, j) * param<A>(w, j)) * t.uhat) * t.gt.dsilu);
        } else {
          dx[off + j] = store<T>(d * t.gt.silu);
          dz[off + j] = store<T>((d * load(x + off, j)) * t.gt.dsilu);
        }
      }
    });
  }
  if (dweight)
    for (int64_t j = 0; j < a.c_local; ++j) {
      if constexpr (std::is_same_v<P, float> || std::is_same_v<P, double>)
        dweight[j] = static_cast<P>(dw[j]);
      else
        dweight[j] = from_float<P>(static_cast<float>(dw[j]));
    }
}

// Storage T with parameters P (T, or float next to fp16/bf16: mixed precision), wire W and
// saved statistics S in float and double.
#define TPNORM_GATED_PWS(T, P, W, S)                                                               \
  template void gated_apply_forward<T, P, W, S>(const GatedArgs&, const T*, const T*, const P*,    \
                                                const W*, double, double, T*, S*);                 \
  template void gated_partial_backward<T, P, W, S>(const GatedArgs&, const T*, const T*, const T*, \
                                                   const P*, const S*, W*, double*);               \
  template void gated_apply_backward<T, P, W, S>(const GatedArgs&, const T*, const T*, const T*,   \
                                                 const P*, const S*, const W*, double,             \
                                                 const double*, T*, T*, P*);
#define TPNORM_GATED_P(T, P)            \
  TPNORM_GATED_PWS(T, P, float, float)  \
  TPNORM_GATED_PWS(T, P, float, double) \
  TPNORM_GATED_PWS(T, P, double, float) TPNORM_GATED_PWS(T, P, double, double)
#define TPNORM_GATED_EXACT_P(T, P)                                                                \
  template void gated_exact_partial_backward<T, P, float>(                                        \
      const GatedArgs&, const T*, const T*, const T*, const P*, const float*, int64_t*, double*); \
  template void gated_exact_partial_backward<T, P, double>(                                       \
      const GatedArgs&, const T*, const T*, const T*, const P*, const double*, int64_t*, double*);
#define TPNORM_GATED(T)                                                                          \
  template void gated_partial_forward<T, float>(const GatedArgs&, const T*, const T*, float*);   \
  template void gated_partial_forward<T, double>(const GatedArgs&, const T*, const T*, double*); \
  TPNORM_GATED_P(T, T)
TPNORM_GATED(float)
TPNORM_GATED(f16)
TPNORM_GATED(bf16)
TPNORM_GATED(double)
TPNORM_GATED_P(f16, float)
TPNORM_GATED_P(bf16, float)
template void gated_exact_partial_forward<float>(const GatedArgs&, const float*, const float*,
                                                 int64_t*);
template void gated_exact_partial_forward<f16>(const GatedArgs&, const f16*, const f16*, int64_t*);
template void gated_exact_partial_forward<bf16>(const GatedArgs&, const bf16*, const bf16*,
                                                int64_t*);
TPNORM_GATED_EXACT_P(float, float)
TPNORM_GATED_EXACT_P(f16, f16)
TPNORM_GATED_EXACT_P(bf16, bf16)
TPNORM_GATED_EXACT_P(f16, float)
TPNORM_GATED_EXACT_P(bf16, float)

}  // namespace tpnorm::kernels::cpu
