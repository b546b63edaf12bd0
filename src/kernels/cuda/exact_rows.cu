// exact_rows.cu — CUDA kernels of Stats::kExact for LayerNorm / RMSNorm rows; see
// exact_rows.h. Every formula below is the CPU's (kernels/cpu/exact_rows.cpp, row_norm.cpp);
// the comments name the CPU line each one mirrors.
//
// Kernels: partial_fwd / partial_bwd (a warp or a 256-thread block per row: two passes over
// the row, the first for the window's exponent, the second for the sums; the threads' limbs
// are added as int64 and normalized by the row's first thread), finish (a thread per row: the
// summed limbs -> final statistics, in place), apply_fwd / apply_bwd (element-wise, as the
// CPU), dgamma_part / dgamma_final (the CPU's fixed row blocks, a thread per column and block).
#include <algorithm>
#include <type_traits>

#include "common/exact_sum.h"
#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/exact_acc.h"
#include "kernels/cuda/exact_device.cuh"
#include "kernels/cuda/exact_rows.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"

namespace tpnorm::kernels::cuda {
namespace {

struct Geo {
  int64_t rows = 0, h = 0;
  int tpr = 32;  // threads per row: 32 (a warp) or blockDim.x (the block)
};

__device__ __forceinline__ int64_t row_of(const Geo& g) {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / g.tpr) + threadIdx.x / g.tpr;
}

__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }

// ---- partials ---------------------------------------------------------------------------

// exact_rows.cpp forward_row_sums: sum x and sum x^2 of the row's values (as float32).
template <class T, int V>
__global__ void __launch_bounds__(256)
    partial_fwd(Geo g, const T* __restrict__ x, int limbs, int64_t* __restrict__ out) {
  const int64_t r = row_of(g);
  if (r >= g.rows) return;  // warp-uniform; a block per row never takes it
  const int lane = threadIdx.x % g.tpr;
  const T* xr = x + r * g.h;
  const int64_t nv = g.h / V;
  int emax = 0;
  for (int64_t i = lane; i < nv; i += g.tpr) {
    const Pack<T, V> p = load_pack<T, V>(xr, i);
#pragma unroll
    for (int k = 0; k < V; ++k) emax = max(emax, exact_good_exponent(bits_of(to_f(p.v[k]))));
  }
  emax = group_max(emax, g.tpr);
  ExactAcc<true> acc(emax);
  for (int64_t i = lane; i < nv; i += g.tpr) {
    const Pack<T, V> p = load_pack<T, V>(xr, i);
#pragma unroll
    for (int k = 0; k < V; ++k) acc.add(bits_of(to_f(p.v[k])));
  }
  acc.flush();
  constexpr int K = 1 + exact::kLimbs1 + exact::kLimbs2;
  int64_t l[K];
  l[0] = acc.bad;
  exact::pack(acc.s1, l + 1, exact::kLimbs1);
  exact::pack(acc.s2, l + 1 + exact::kLimbs1, exact::kLimbs2);
  group_sum(l, g.tpr);  // int64 adds: exact and order-free; limbs stay below 256 * 2^52
  if (lane == 0) write_row_limbs<exact::kLimbs2>(l, out + r * limbs, limbs);
}

// exact_rows.cpp backward_row_sums: xhat = ((x - mh) - mt) * rs, g = dy * gamma, and the terms
// g (centred only) and g * xhat, each rounded to float32 as the CPU forms them.
struct BwdTerms {
  float mh, mt, rs;
  __device__ __forceinline__ void operator()(float xv, float dv, const float* gm, float& g,
                                             float& gx) const {
    const float xhat = __fmul_rn(__fsub_rn(__fsub_rn(xv, mh), mt), rs);
    g = gm ? __fmul_rn(dv, *gm) : dv;
    gx = __fmul_rn(g, xhat);
  }
};

__device__ __forceinline__ void saved_stats(const void* mean, const void* rstd, int64_t r, bool s64,
                                            bool centered, float& mh, float& mt, float& rs) {
  mh = 0.0f, mt = 0.0f;
  if (centered) split_mean(load_fd(mean, r, s64), mh, mt);
  rs = static_cast<float>(load_fd(rstd, r, s64));
}

template <class T, int V>
__global__ void __launch_bounds__(256)
    partial_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x,
                const T* __restrict__ gamma, const void* mean, const void* rstd, bool s64,
                bool centered, int limbs, int64_t* __restrict__ out) {
  const int64_t r = row_of(g);
  if (r >= g.rows) return;
  const int lane = threadIdx.x % g.tpr;
  BwdTerms t;
  saved_stats(mean, rstd, r, s64, centered, t.mh, t.mt, t.rs);
  const T* xr = x + r * g.h;
  const T* dyr = dy + r * g.h;
  const int64_t nv = g.h / V;
  // fn(g, g*xhat) for each of this thread's columns.
  auto each = [&](auto&& fn) {
    for (int64_t i = lane; i < nv; i += g.tpr) {
      const Pack<T, V> xp = load_pack<T, V>(xr, i), dp = load_pack<T, V>(dyr, i);
      Pack<T, V> gp;
      if (gamma) gp = load_pack<T, V>(gamma, i);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float gm = gamma ? to_f(gp.v[k]) : 0.0f;
        float tg, tgx;
        t(to_f(xp.v[k]), to_f(dp.v[k]), gamma ? &gm : nullptr, tg, tgx);
        fn(tg, tgx);
      }
    }
  };
  int eg = 0, ex = 0;
  each([&](float tg, float tgx) {
    eg = max(eg, exact_good_exponent(bits_of(tg)));
    ex = max(ex, exact_good_exponent(bits_of(tgx)));
  });
  eg = group_max(eg, g.tpr);
  ex = group_max(ex, g.tpr);
  ExactAcc<false> ag(eg), ax(ex);
  each([&](float tg, float tgx) {
    if (centered) ag.add(bits_of(tg));  // the CPU sums g only when centred
    ax.add(bits_of(tgx));
  });
  ag.flush();
  ax.flush();
  constexpr int K = 1 + 2 * exact::kLimbs1;
  int64_t l[K];
  l[0] = ag.bad + ax.bad;
  exact::pack(ag.s1, l + 1, exact::kLimbs1);
  exact::pack(ax.s1, l + 1 + exact::kLimbs1, exact::kLimbs1);
  group_sum(l, g.tpr);  // int64 adds: exact and order-free; limbs stay below 256 * 2^52
  if (lane == 0) write_row_limbs<exact::kLimbs1>(l, out + r * limbs, limbs);
}

// ---- finish -----------------------------------------------------------------------------

// exact_rows.cpp exact_row_finish / finish_row: a thread per row; the final statistics
// (doubles, `centered ? 2 : 1` of them) overwrite the start of the row's limbs, which only
// this thread reads.
__global__ void __launch_bounds__(128)
    finish(int64_t rows, Header hd, bool centered, bool forward, int limbs, int* err) {
  int64_t n;
  if (!exact_header_ok(hd, &n)) return mark_failed(err);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  int64_t* in = exact_payload(hd) + r * limbs;
  const int w = centered ? 2 : 1;
  const int64_t bad = in[0];
  double st[2] = {0.0, 0.0};
  const auto count = static_cast<uint64_t>(n);
  if (bad != 0) {
    st[0] = st[1] = __longlong_as_double(0x7ff8000000000000LL);  // quiet NaN
  } else if (count != 0) {
    exact::Sum1 s1, t1;
    exact::Sum2 s2;
    if (centered) s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
    if (forward) {
      s2 = exact::unpack<8>(in + limbs - exact::kLimbs2, exact::kLimbs2);
      if (centered) {
        st[0] = exact::mean(s1, count);
        st[1] = exact::variance(s1, s2, count);
      } else {
        st[0] = exact::mean_square(s2, count);
      }
    } else {
      t1 = exact::unpack<4>(in + limbs - exact::kLimbs1, exact::kLimbs1);
      if (centered) st[0] = exact::mean(s1, count);
      st[w - 1] = exact::mean(t1, count);
    }
  }
  double* o = reinterpret_cast<double*>(in);
  for (int i = 0; i < w; ++i) o[i] = st[i];
}

// ---- applies ----------------------------------------------------------------------------

// row_norm.cpp row_apply_forward with final_stats: rs_w = 1 / sqrt(var + eps) in double,
// mean/rstd saved as S, y = fma(xhat, gamma, beta) in float32.
template <class T, int V>
__global__ void __launch_bounds__(256)
    apply_fwd(Geo g, const T* __restrict__ x, const T* __restrict__ gamma,
              const T* __restrict__ beta, Header hd, int limbs, double eps, bool centered, bool s64,
              T* __restrict__ y, void* mean, void* rstd, int* err) {
  int64_t n;
  if (!exact_header_ok(hd, &n)) return mark_failed(err);
  const int64_t r = row_of(g);
  if (r >= g.rows) return;
  const int lane = threadIdx.x % g.tpr;
  const double* st = reinterpret_cast<const double*>(exact_payload(hd) + r * limbs);
  const double mu = centered ? st[0] : 0.0;
  const double var = st[centered ? 1 : 0];
  const double rs_w = __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, eps)));
  if (lane == 0) {
    if (mean) store_fd(mean, r, s64, mu);
    if (rstd) store_fd(rstd, r, s64, rs_w);
  }
  float mh, mt;
  split_mean(mu, mh, mt);
  const float rs = static_cast<float>(rs_w);
  const T* xr = x + r * g.h;
  T* yr = y + r * g.h;
  for (int64_t i = lane; i < g.h / V; i += g.tpr) {
    const Pack<T, V> xp = load_pack<T, V>(xr, i);
    Pack<T, V> gp, bp, yp;
    if (gamma) gp = load_pack<T, V>(gamma, i);
    if (beta) bp = load_pack<T, V>(beta, i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = __fmul_rn(__fsub_rn(__fsub_rn(to_f(xp.v[k]), mh), mt), rs);
      const float gv = gamma ? to_f(gp.v[k]) : 1.0f;
      const float bv = beta ? to_f(bp.v[k]) : 0.0f;
      yp.v[k] = from_f<T>(__fmaf_rn(xhat, gv, bv));
    }
    store_pack<T, V>(yr, i, yp);
  }
}

// row_norm.cpp row_apply_backward with final_stats: c1 = float(sum g / n), c2 =
// float(sum g*xhat / n), dx = rs * ((g - c1) - xhat * c2).
template <class T, int V>
__global__ void __launch_bounds__(256)
    apply_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
              const void* mean, const void* rstd, bool s64, Header hd, int limbs, bool centered,
              T* __restrict__ dx, int* err) {
  int64_t n;
  if (!exact_header_ok(hd, &n)) return mark_failed(err);
  const int64_t r = row_of(g);
  if (r >= g.rows) return;
  const int lane = threadIdx.x % g.tpr;
  const double* st = reinterpret_cast<const double*>(exact_payload(hd) + r * limbs);
  const float c1 = centered ? static_cast<float>(st[0]) : 0.0f;
  const float c2 = static_cast<float>(st[centered ? 1 : 0]);
  float mh, mt, rs;
  saved_stats(mean, rstd, r, s64, centered, mh, mt, rs);
  const T* xr = x + r * g.h;
  const T* dyr = dy + r * g.h;
  T* dxr = dx + r * g.h;
  for (int64_t i = lane; i < g.h / V; i += g.tpr) {
    const Pack<T, V> xp = load_pack<T, V>(xr, i), dp = load_pack<T, V>(dyr, i);
    Pack<T, V> gp, out;
    if (gamma) gp = load_pack<T, V>(gamma, i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = __fmul_rn(__fsub_rn(__fsub_rn(to_f(xp.v[k]), mh), mt), rs);
      const float d = to_f(dp.v[k]);
      const float gv = gamma ? __fmul_rn(d, to_f(gp.v[k])) : d;
      out.v[k] = from_f<T>(__fmul_rn(rs, __fsub_rn(__fsub_rn(gv, c1), __fmul_rn(xhat, c2))));
    }
    store_pack<T, V>(dxr, i, out);
  }
}

// row_norm.cpp row_apply_backward's fixed blocks: column j of row block b (kExactParamBlock
// rows) sums dy * xhat by fma and dy in float32 over kExactParamRows rows at a time, each such
// sum added into a double; part[2b][j], part[2b+1][j] = the block's dgamma, dbeta.
template <class T>
__global__ void __launch_bounds__(256)
    dgamma_part(int64_t rows, int64_t h, int64_t blocks, const T* __restrict__ dy,
                const T* __restrict__ x, const void* mean, const void* rstd, bool s64,
                bool centered, double* __restrict__ part) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  for (int64_t b = blockIdx.y; b < blocks; b += gridDim.y) {
    const int64_t r0 = b * kExactParamBlock, r1 = min(rows, r0 + kExactParamBlock);
    double dg = 0.0, db = 0.0;
    float gf = 0.0f, bf = 0.0f;
    int pending = 0;
    for (int64_t r = r0; r < r1; ++r) {
      float mh, mt, rs;
      saved_stats(mean, rstd, r, s64, centered, mh, mt, rs);
      const float xhat = __fmul_rn(__fsub_rn(__fsub_rn(to_f(x[r * h + j]), mh), mt), rs);
      const float d = to_f(dy[r * h + j]);
      gf = __fmaf_rn(d, xhat, gf);
      bf = __fadd_rn(bf, d);
      if (++pending == kExactParamRows) {
        dg = __dadd_rn(dg, static_cast<double>(gf));
        db = __dadd_rn(db, static_cast<double>(bf));
        gf = bf = 0.0f;
        pending = 0;
      }
    }
    if (pending > 0) {
      dg = __dadd_rn(dg, static_cast<double>(gf));
      db = __dadd_rn(db, static_cast<double>(bf));
    }
    part[(2 * b) * h + j] = dg;
    part[(2 * b + 1) * h + j] = db;
  }
}

// The blocks' sums in block order, from 0 (row_norm.cpp's last loop).
template <class T>
__global__ void __launch_bounds__(256)
    dgamma_final(int64_t h, int64_t blocks, const double* __restrict__ part, Header hd,
                 T* __restrict__ dgamma, T* __restrict__ dbeta, int* err) {
  int64_t n;
  if (!exact_header_ok(hd, &n)) return mark_failed(err);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  double tg = 0.0, tb = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    tg = __dadd_rn(tg, part[(2 * b) * h + j]);
    tb = __dadd_rn(tb, part[(2 * b + 1) * h + j]);
  }
  if (dgamma) dgamma[j] = from_f<T>(static_cast<float>(tg));
  if (dbeta) dbeta[j] = from_f<T>(static_cast<float>(tb));
}

// ---- launchers ----------------------------------------------------------------------------

struct Launch {
  Geo g;
  ExactRowPlan p;
};

template <class D>
Launch choose(const ExactRowArgs& a, std::initializer_list<const void*> ptrs) {
  Launch l;
  l.g.rows = a.rows;
  l.g.h = a.h;
  l.p = exact_row_plan(a.rows, a.h, sizeof(D), ptrs);
  l.g.tpr = l.p.tpr;
  return l;
}

// body(std::integral_constant<int, V>) with V the plan's vector width (at most 16 bytes).
template <class D, class Body>
void with_pack(const Launch& l, Body&& body) {
  with_vec<D>(l.p.vec, body);
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
dim3 grid_of(const Launch& l) { return dim3(static_cast<unsigned>(l.p.blocks)); }

int64_t param_blocks(int64_t rows) {
  return rows > 0 ? (rows + kExactParamBlock - 1) / kExactParamBlock : 0;
}

void launch_finish(const ExactRowArgs& a, const Header& hd, bool forward, int* err) {
  // At least one block, so that a call without rows still checks its header.
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, (a.rows + 127) / 128));
  launch("exact row finish", finish, dim3(blocks), dim3(128), st(a.stream), a.rows, hd, a.centered,
         forward, exact_row_limbs(a.centered, forward), err);
}

}  // namespace

template <class T>
void exact_row_partial_forward(const ExactRowArgs& a, const T* x, int64_t* limbs) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {x});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("exact row partial_fwd", partial_fwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
           st(a.stream), l.g, reinterpret_cast<const D*>(x), exact_row_limbs(a.centered, true),
           limbs);
  });
}

template <class T>
void exact_row_partial_backward(const ExactRowArgs& a, const T* dy, const T* x, const T* gamma,
                                const void* mean, const void* rstd, int64_t* limbs) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {dy, x, gamma});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("exact row partial_bwd", partial_bwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
           st(a.stream), l.g, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
           reinterpret_cast<const D*>(gamma), mean, rstd, a.s64, a.centered,
           exact_row_limbs(a.centered, false), limbs);
  });
}

template <class T>
void exact_row_apply_forward(const ExactRowArgs& a, const T* x, const T* gamma, const T* beta,
                             const Header& hd, double eps, T* y, void* mean, void* rstd, int* err) {
  using D = typename Dev<T>::type;
  launch_finish(a, hd, true, err);
  const Launch l = choose<D>(a, {x, gamma, beta, y});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("exact row apply_fwd", apply_fwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
           st(a.stream), l.g, reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma),
           reinterpret_cast<const D*>(beta), hd, exact_row_limbs(a.centered, true), eps, a.centered,
           a.s64, reinterpret_cast<D*>(y), mean, rstd, err);
  });
}

size_t exact_row_scratch_bytes(int64_t rows, int64_t h, bool params) {
  if (!params || h <= 0) return 0;
  return static_cast<size_t>(2 * param_blocks(rows) * h) * sizeof(double);
}

template <class T>
void exact_row_apply_backward(const ExactRowArgs& a, const T* dy, const T* x, const T* gamma,
                              const void* mean, const void* rstd, const Header& hd, T* dx,
                              T* dgamma, T* dbeta, void* scratch, int* err) {
  using D = typename Dev<T>::type;
  launch_finish(a, hd, false, err);
  const Launch l = choose<D>(a, {dy, x, gamma, dx});
  if (l.p.blocks > 0) {
    with_pack<D>(l, [&](auto v) {
      launch("exact row apply_bwd", apply_bwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
             st(a.stream), l.g, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
             reinterpret_cast<const D*>(gamma), mean, rstd, a.s64, hd,
             exact_row_limbs(a.centered, false), a.centered, reinterpret_cast<D*>(dx), err);
    });
  }
  if ((!dgamma && !dbeta) || a.h <= 0) return;
  const int64_t blocks = param_blocks(a.rows);
  double* part = static_cast<double*>(scratch);
  const unsigned cols = static_cast<unsigned>((a.h + 255) / 256);
  if (blocks > 0)
    launch("exact row dgamma_part", dgamma_part<D>,
           dim3(cols, static_cast<unsigned>(std::min<int64_t>(blocks, 65535))), dim3(256),
           st(a.stream), a.rows, a.h, blocks, reinterpret_cast<const D*>(dy),
           reinterpret_cast<const D*>(x), mean, rstd, a.s64, a.centered, part);
  launch("exact row dgamma_final", dgamma_final<D>, dim3(cols), dim3(256), st(a.stream), a.h,
         blocks, static_cast<const double*>(part), hd, reinterpret_cast<D*>(dgamma),
         reinterpret_cast<D*>(dbeta), err);
}

#define TPNORM_CUDA_EXACT_ROW_INSTANTIATE(T)                                                     \
  template void exact_row_partial_forward<T>(const ExactRowArgs&, const T*, int64_t*);           \
  template void exact_row_partial_backward<T>(const ExactRowArgs&, const T*, const T*, const T*, \
                                              const void*, const void*, int64_t*);               \
  template void exact_row_apply_forward<T>(const ExactRowArgs&, const T*, const T*, const T*,    \
                                           const Header&, double, T*, void*, void*, int*);       \
  template void exact_row_apply_backward<T>(const ExactRowArgs&, const T*, const T*, const T*,   \
                                            const void*, const void*, const Header&, T*, T*, T*, \
                                            void*, int*);
TPNORM_CUDA_EXACT_ROW_INSTANTIATE(float)
TPNORM_CUDA_EXACT_ROW_INSTANTIATE(f16)
TPNORM_CUDA_EXACT_ROW_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
