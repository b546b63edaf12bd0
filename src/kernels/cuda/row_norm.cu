// row_norm.cu — CUDA kernels for LayerNorm / RMSNorm rows; see row_norm.h.
//
// Kernels: partial_fwd / apply_fwd / partial_bwd / apply_bwd work row-wise (a warp or a block
// per row, `tpr` threads); dgamma_part / dgamma_final are the two-stage column reduction of
// dgamma and dbeta (32-column tiles x row chunks into scratch, then a fixed-order sum over the
// chunks). Template parameters are only the storage type and the pack width (1 or 16 bytes),
// so each entry point has six instantiations; everything else is a run-time argument.
#include <algorithm>
#include <type_traits>

#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/row_norm.h"

namespace tpnorm::kernels::cuda {
namespace {

struct Geo {
  int64_t rows = 0, h = 0;
  int tpr = 32;  // threads per row: 32 (a warp) or blockDim.x (the block)
};

__device__ __forceinline__ int64_t row_of(const Geo& g) {
  return static_cast<int64_t>(blockIdx.x) * (blockDim.x / g.tpr) + threadIdx.x / g.tpr;
}

// The two kernels that apply a summed payload (apply_fwd, apply_bwd) start the same way, so
// they share this: a failed call marks err and a thread past the last row leaves. Returns
// false when the thread has nothing more to do; else rc holds its row's context.
struct RowCall {
  double n;         // the global count of elements per row, from the header
  int64_t r;        // this thread's row
  int lane;         // this thread's place among the row's g.tpr threads
  const void* pay;  // the summed payload
};

__device__ __forceinline__ bool row_call(const Geo& g, const Header& hd, int* err, RowCall& rc) {
  if (!header_ok(hd, &rc.n)) {
    mark_failed(err);
    return false;
  }
  rc.r = row_of(g);
  if (rc.r >= g.rows) return false;
  rc.lane = threadIdx.x % g.tpr;
  rc.pay = payload_of(hd);
  return true;
}

// ---- kernels ----------------------------------------------------------------------------

template <class T, int V>
__global__ void __launch_bounds__(256)
    partial_fwd(Geo g, const T* __restrict__ x, bool pivoted, bool centered, bool w64, void* out) {
  const int64_t r = row_of(g);
  if (r >= g.rows) return;  // warp-uniform: a block per row never takes this branch
  const int lane = threadIdx.x % g.tpr;
  const T* xr = x + r * g.h;
  // Around the robust pivot of the row, so 1e4 + N(0,1) keeps its variance (as on CPU).
  const float pivot = pivoted ? detail::robust_pivot(xr, g.h) : 0.0f;
  float v[2] = {0.0f, 0.0f};
  for (int64_t i = lane; i < g.h / V; i += g.tpr) {
    const Pack<T, V> p = load_pack<T, V>(xr, i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d = to_f(p.v[k]) - pivot;
      v[0] += d;
      v[1] += d * d;
    }
  }
  group_sum<2>(v, g.tpr);
  if (lane != 0) return;
  const double p = pivot, n = static_cast<double>(g.h);
  const double s1 = p * n + v[0], s2 = v[1] + 2.0 * p * v[0] + p * p * n;
  if (centered) {
    store_fd(out, 2 * r, w64, s1);
    store_fd(out, 2 * r + 1, w64, s2);
  } else {
    store_fd(out, r, w64, s2);
  }
}

// Row statistics from the summed payload, in the wire type's precision (as on CPU).
template <class W>
__device__ __forceinline__ void row_moments(const void* pay, int64_t r, bool centered, double n,
                                            double& mu, double& var) {
  const W* s = static_cast<const W*>(pay);
  W m = 0, v = 0;
  if (n > 0) {
    if (centered) {
      m = s[2 * r] / static_cast<W>(n);
      v = s[2 * r + 1] / static_cast<W>(n) - m * m;
      v = v > W(0) ? v : W(0);
    } else {
      v = s[r] / static_cast<W>(n);
    }
  }
  mu = m;
  var = v;
}

template <class T, int V>
__global__ void __launch_bounds__(256)
    apply_fwd(Geo g, const T* __restrict__ x, const T* __restrict__ gamma,
              const T* __restrict__ beta, Header hd, double eps, bool centered, bool s64,
              T* __restrict__ y, void* mean, void* rstd, int* err) {
  RowCall rc;
  if (!row_call(g, hd, err, rc)) return;
  const auto& [n, r, lane, pay] = rc;
  double mu, var, rs_w;
  if (hd.w64) {
    row_moments<double>(pay, r, centered, n, mu, var);
    rs_w = 1.0 / sqrt(var + eps);
  } else {
    row_moments<float>(pay, r, centered, n, mu, var);
    rs_w = 1.0f / sqrtf(static_cast<float>(var) + static_cast<float>(eps));
  }
  if (lane == 0) {
    if (mean) store_fd(mean, r, s64, mu);
    if (rstd) store_fd(rstd, r, s64, rs_w);
  }
  // The mean in the wire type's precision, split into float head + tail (as on CPU).
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
      const float xhat = ((to_f(xp.v[k]) - mh) - mt) * rs;
      const float gv = gamma ? to_f(gp.v[k]) : 1.0f;
      const float bv = beta ? to_f(bp.v[k]) : 0.0f;
      yp.v[k] = from_f<T>(xhat * gv + bv);
    }
    store_pack<T, V>(yr, i, yp);
  }
}

template <class T, int V>
__global__ void __launch_bounds__(256)
    partial_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x,
                const T* __restrict__ gamma, const void* mean, const void* rstd, bool s64,
                bool centered, bool w64, void* out) {
  const int64_t r = row_of(g);
  if (r >= g.rows) return;
  const int lane = threadIdx.x % g.tpr;
  float mh = 0.0f, mt = 0.0f;
  if (centered) split_mean(load_fd(mean, r, s64), mh, mt);
  const float rs = static_cast<float>(load_fd(rstd, r, s64));
  const T* xr = x + r * g.h;
  const T* dyr = dy + r * g.h;
  float v[2] = {0.0f, 0.0f};
  for (int64_t i = lane; i < g.h / V; i += g.tpr) {
    const Pack<T, V> xp = load_pack<T, V>(xr, i), dp = load_pack<T, V>(dyr, i);
    Pack<T, V> gp;
    if (gamma) gp = load_pack<T, V>(gamma, i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = ((to_f(xp.v[k]) - mh) - mt) * rs;
      const float gv = to_f(dp.v[k]) * (gamma ? to_f(gp.v[k]) : 1.0f);
      v[0] += gv;
      v[1] += gv * xhat;
    }
  }
  group_sum<2>(v, g.tpr);
  if (lane != 0) return;
  if (centered) {
    store_fd(out, 2 * r, w64, v[0]);
    store_fd(out, 2 * r + 1, w64, v[1]);
  } else {
    store_fd(out, r, w64, v[1]);
  }
}

template <class T, int V>
__global__ void __launch_bounds__(256)
    apply_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
              const void* mean, const void* rstd, bool s64, Header hd, bool centered,
              T* __restrict__ dx, int* err) {
  RowCall rc;
  if (!row_call(g, hd, err, rc)) return;
  const auto& [n, r, lane, pay] = rc;
  const int64_t k1 = centered ? 2 * r + 1 : r;
  float c1, c2;
  if (hd.w64) {
    const double* s = static_cast<const double*>(pay);
    c1 = centered ? static_cast<float>(s[2 * r] / n) : 0.0f;
    c2 = static_cast<float>(s[k1] / n);
  } else {
    const float* s = static_cast<const float*>(pay);
    const float nf = static_cast<float>(n);
    c1 = centered ? s[2 * r] / nf : 0.0f;
    c2 = s[k1] / nf;
  }
  float mh = 0.0f, mt = 0.0f;
  if (centered) split_mean(load_fd(mean, r, s64), mh, mt);
  const float rs = static_cast<float>(load_fd(rstd, r, s64));
  const T* xr = x + r * g.h;
  const T* dyr = dy + r * g.h;
  T* dxr = dx + r * g.h;
  for (int64_t i = lane; i < g.h / V; i += g.tpr) {
    const Pack<T, V> xp = load_pack<T, V>(xr, i), dp = load_pack<T, V>(dyr, i);
    Pack<T, V> gp, out;
    if (gamma) gp = load_pack<T, V>(gamma, i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = ((to_f(xp.v[k]) - mh) - mt) * rs;
      const float gv = to_f(dp.v[k]) * (gamma ? to_f(gp.v[k]) : 1.0f);
      out.v[k] = from_f<T>(rs * (gv - c1 - xhat * c2));
    }
    store_pack<T, V>(dxr, i, out);
  }
}

// Stage 1: block (32, 8) sums dy*xhat and dy over rows [chunk*rpc, ...) for 32 columns.
constexpr int kTileCols = kDgammaTileCols, kTileRows = kDgammaTileRows;

template <class T>
__global__ void __launch_bounds__(256)
    dgamma_part(int64_t rows, int64_t h, const T* __restrict__ dy, const T* __restrict__ x,
                const void* mean, const void* rstd, bool s64, bool centered, int64_t rpc,
                float* part) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x;
  const int64_t c = blockIdx.y, r0 = c * rpc, r1 = min(rows, r0 + rpc);
  float ag = 0.0f, ab = 0.0f;
  if (j < h) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kTileRows) {
      float mh = 0.0f, mt = 0.0f;
      if (centered) split_mean(load_fd(mean, r, s64), mh, mt);
      const float rs = static_cast<float>(load_fd(rstd, r, s64));
      const float xhat = ((to_f(x[r * h + j]) - mh) - mt) * rs;
      const float d = to_f(dy[r * h + j]);
      ag += d * xhat;
      ab += d;
    }
  }
  __shared__ float sg[kTileRows][kTileCols + 1], sb[kTileRows][kTileCols + 1];
  sg[threadIdx.y][threadIdx.x] = ag;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y != 0 || j >= h) return;
  float tg = 0.0f, tb = 0.0f;
  for (int i = 0; i < kTileRows; ++i) {
    tg += sg[i][threadIdx.x];
    tb += sb[i][threadIdx.x];
  }
  part[(2 * c) * h + j] = tg;
  part[(2 * c + 1) * h + j] = tb;
}

// Stage 2: column j = the chunks' partial sums in chunk order (deterministic).
template <class T>
__global__ void dgamma_final(int64_t h, int64_t chunks, const float* part, Header hd, T* dgamma,
                             T* dbeta, int* err) {
  double n;
  if (!header_ok(hd, &n)) return mark_failed(err);
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= h) return;
  double tg = 0, tb = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    tg += part[(2 * c) * h + j];
    tb += part[(2 * c + 1) * h + j];
  }
  if (dgamma) dgamma[j] = from_f<T>(static_cast<float>(tg));
  if (dbeta) dbeta[j] = from_f<T>(static_cast<float>(tb));
}

// ---- launchers ----------------------------------------------------------------------------

struct Launch {
  Geo g;
  RowPlan p;
};

// The plan of kernels/cuda/plan.h for rows of D (vector width from h and every pointer).
template <class D>
Launch choose(const RowArgs& a, std::initializer_list<const void*> ptrs) {
  Launch l;
  l.g.rows = a.rows;
  l.g.h = a.h;
  l.p = plan_rows(a.rows, a.h, sizeof(D), ptrs);
  l.g.tpr = l.p.tpr;
  return l;
}

// Calls body(std::integral_constant<int, V>) with V the plan's vector width; widths above
// 16 bytes do not exist for D (plan_rows never picks them).
template <class D, class Body>
void with_pack(const Launch& l, Body&& body) {
  constexpr int kMax = static_cast<int>(16 / sizeof(D));
  switch (l.p.vec) {
    case 8:
      if constexpr (kMax >= 8) return body(std::integral_constant<int, 8>{});
      break;
    case 4:
      if constexpr (kMax >= 4) return body(std::integral_constant<int, 4>{});
      break;
    case 2:
      return body(std::integral_constant<int, 2>{});
    default:
      break;
  }
  body(std::integral_constant<int, 1>{});
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
dim3 grid_of(const Launch& l) { return dim3(static_cast<unsigned>(l.p.blocks)); }

}  // namespace

template <class T>
void row_partial_forward(const RowArgs& a, const T* x, bool robust, bool w64, void* payload) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {x});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("row partial_fwd", partial_fwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
           st(a.stream), l.g, reinterpret_cast<const D*>(x), robust && a.centered, a.centered, w64,
           payload);
  });
}

template <class T>
void row_apply_forward(const RowArgs& a, const T* x, const T* gamma, const T* beta,
                       const Header& hd, double eps, T* y, void* mean, void* rstd, int* err) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {x, gamma, beta, y});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("row apply_fwd", apply_fwd<D, decltype(v)::value>, grid_of(l), l.p.threads, st(a.stream),
           l.g, reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma),
           reinterpret_cast<const D*>(beta), hd, eps, a.centered, a.s64, reinterpret_cast<D*>(y),
           mean, rstd, err);
  });
}

template <class T>
void row_partial_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma,
                          const void* mean, const void* rstd, bool w64, void* payload) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {dy, x, gamma});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v) {
    launch("row partial_bwd", partial_bwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
           st(a.stream), l.g, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
           reinterpret_cast<const D*>(gamma), mean, rstd, a.s64, a.centered, w64, payload);
  });
}

size_t row_norm_scratch_bytes(int64_t rows, int64_t h, bool params) {
  if (!params) return 0;
  int64_t rpc = 0;
  const int64_t chunks = dgamma_chunks(rows, h, &rpc);
  return static_cast<size_t>(2 * chunks * std::max<int64_t>(h, 0)) * sizeof(float);
}

template <class T>
void row_apply_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma, const void* mean,
                        const void* rstd, const Header& hd, T* dx, T* dgamma, T* dbeta,
                        void* scratch, int* err) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {dy, x, gamma, dx});
  if (l.p.blocks > 0) {
    with_pack<D>(l, [&](auto v) {
      launch("row apply_bwd", apply_bwd<D, decltype(v)::value>, grid_of(l), l.p.threads,
             st(a.stream), l.g, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
             reinterpret_cast<const D*>(gamma), mean, rstd, a.s64, hd, a.centered,
             reinterpret_cast<D*>(dx), err);
    });
  }
  if ((!dgamma && !dbeta) || a.h <= 0) return;
  int64_t rpc = 0;
  const int64_t chunks = dgamma_chunks(a.rows, a.h, &rpc);
  float* part = static_cast<float*>(scratch);
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>((a.h + kTileCols - 1) / kTileCols),
                    static_cast<unsigned>(chunks));
    launch("row dgamma_part", dgamma_part<D>, grid, dim3(kTileCols, kTileRows), st(a.stream),
           a.rows, a.h, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x), mean, rstd,
           a.s64, a.centered, rpc, part);
  }
  launch("row dgamma_final", dgamma_final<D>, dim3(static_cast<unsigned>((a.h + 255) / 256)),
         dim3(256), st(a.stream), a.h, chunks, static_cast<const float*>(part), hd,
         reinterpret_cast<D*>(dgamma), reinterpret_cast<D*>(dbeta), err);
}

#define TPNORM_CUDA_ROW_INSTANTIATE(T)                                                             \
  template void row_partial_forward<T>(const RowArgs&, const T*, bool, bool, void*);               \
  template void row_apply_forward<T>(const RowArgs&, const T*, const T*, const T*, const Header&,  \
                                     double, T*, void*, void*, int*);                              \
  template void row_partial_backward<T>(const RowArgs&, const T*, const T*, const T*, const void*, \
                                        const void*, bool, void*);                                 \
  template void row_apply_backward<T>(const RowArgs&, const T*, const T*, const T*, const void*,   \
                                      const void*, const Header&, T*, T*, T*, void*, int*);
TPNORM_CUDA_ROW_INSTANTIATE(float)
TPNORM_CUDA_ROW_INSTANTIATE(f16)
TPNORM_CUDA_ROW_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
