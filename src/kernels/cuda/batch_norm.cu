// batch_norm.cu — CUDA kernels of SyncBatchNorm; see batch_norm.h.
//
// Kernels: sums_wide (a 256-thread block per (channel, split), for inner >= 32, coalesced along
// inner) and sums_narrow (32 channels x 8 rows per block, for channels-last and small inner)
// make the per-split partial sums; combine adds the splits in order per channel; fwd_consts /
// bwd_consts make the per-channel constants; apply_fwd / apply_bwd are element-wise;
// param_grads writes dgamma / dbeta. Templates: only the storage type (and the pass).
#include <algorithm>

#include "common/half.h"
#include "kernels/cuda/batch_norm.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"

namespace tpnorm::kernels::cuda {
namespace {

constexpr int kWide = kBnWide, kTileC = kBnTileC, kTileR = kBnTileR;

struct Geo {
  int64_t outer, c, inner;
  bool channels_last = false;  // only the pivot's span depends on it (as on CPU)
  bool has_values = false;     // outer * inner > 0: only then may x be read
};

// The robust pivot of channel ch on this rank: the CPU kernels' (common/pivot.h); a
// channels-last tensor here is [outer = n * inner, c, 1].
template <class T>
__device__ __forceinline__ float channel_pivot(const Geo& g, const T* x, int64_t ch) {
  if (!g.has_values) return 0.0f;
  return detail::channel_pivot(x, g.outer, g.c, g.inner, g.channels_last, ch);
}

// The values a pass sums per element: forward {d, d^2} with d = x - pivot; backward
// {dy, dy * (x - mean)}.
template <class T, bool kBwd>
struct Term {
  const T* x;
  const T* dy;
  __device__ __forceinline__ void add(int64_t i, float a, float b, float (&v)[2]) const {
    if (kBwd) {
      const float g = to_f(dy[i]);
      v[0] += g;
      v[1] += g * ((to_f(x[i]) - a) - b);
    } else {
      const float d = to_f(x[i]) - a;
      v[0] += d;
      v[1] += d * d;
    }
  }
};

// Per channel: the pivot (forward) or the split mean (backward) as (a, b).
template <class T, bool kBwd>
__device__ __forceinline__ void channel_ref(const Geo& g, const T* x, const void* mean, bool s64,
                                            bool robust, int64_t ch, float& a, float& b) {
  if (kBwd) {
    split_mean(load_fd(mean, ch, s64), a, b);
  } else {
    a = robust ? channel_pivot(g, x, ch) : 0.0f;
    b = 0.0f;
  }
}

template <class T, bool kBwd>
__global__ void __launch_bounds__(kWide)
    sums_wide(Geo g, Term<T, kBwd> t, const void* mean, bool s64, bool robust, int64_t per,
              float* part) {
  const int64_t ch = blockIdx.x, sp = blockIdx.y;
  float a, b;
  channel_ref<T, kBwd>(g, t.x, mean, s64, robust, ch, a, b);
  float v[2] = {0.0f, 0.0f};
  const int64_t o1 = min(g.outer, (sp + 1) * per);
  for (int64_t o = sp * per; o < o1; ++o) {
    const int64_t base = (o * g.c + ch) * g.inner;
    for (int64_t s = threadIdx.x; s < g.inner; s += blockDim.x) t.add(base + s, a, b, v);
  }
  group_sum<2>(v, blockDim.x);
  if (threadIdx.x == 0) {
    part[(2 * sp) * g.c + ch] = v[0];
    part[(2 * sp + 1) * g.c + ch] = v[1];
  }
}

template <class T, bool kBwd>
__global__ void __launch_bounds__(kTileC* kTileR)
    sums_narrow(Geo g, Term<T, kBwd> t, const void* mean, bool s64, bool robust, int64_t per,
                float* part) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * kTileC + threadIdx.x, sp = blockIdx.y;
  float v[2] = {0.0f, 0.0f};
  if (ch < g.c) {
    float a, b;
    channel_ref<T, kBwd>(g, t.x, mean, s64, robust, ch, a, b);
    const int64_t o1 = min(g.outer, (sp + 1) * per);
    for (int64_t o = sp * per + threadIdx.y; o < o1; o += kTileR)
      for (int64_t s = 0; s < g.inner; ++s) t.add((o * g.c + ch) * g.inner + s, a, b, v);
  }
  __shared__ float s0[kTileR][kTileC + 1], s1[kTileR][kTileC + 1];
  s0[threadIdx.y][threadIdx.x] = v[0];
  s1[threadIdx.y][threadIdx.x] = v[1];
  __syncthreads();
  if (threadIdx.y != 0 || ch >= g.c) return;
  float t0 = 0.0f, t1 = 0.0f;
  for (int i = 0; i < kTileR; ++i) t0 += s0[i][threadIdx.x], t1 += s1[i][threadIdx.x];
  part[(2 * sp) * g.c + ch] = t0;
  part[(2 * sp + 1) * g.c + ch] = t1;
}

// Splits in order per channel; forward shifts the pivoted sums back (as on CPU).
template <class T, bool kBwd>
__global__ void combine(Geo g, const T* x, bool robust, int64_t splits, const float* part, bool w64,
                        void* payload, double* local) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= g.c) return;
  double t0 = 0, t1 = 0;
  for (int64_t sp = 0; sp < splits; ++sp) {
    t0 += part[(2 * sp) * g.c + ch];
    t1 += part[(2 * sp + 1) * g.c + ch];
  }
  if (!kBwd) {
    const double m = static_cast<double>(g.outer * g.inner);
    const double p = robust ? channel_pivot(g, x, ch) : 0.0f;
    const double d1 = t0, d2 = t1;
    t0 = p * m + d1;
    t1 = d2 + 2 * p * d1 + p * p * m;
  }
  if (payload) {
    store_fd(payload, 2 * ch, w64, t0);
    store_fd(payload, 2 * ch + 1, w64, t1);
  }
  if (local) {
    local[2 * ch] = t0;
    local[2 * ch + 1] = t1;
  }
}

// A call with a collective: header fine (and n > 1 for a training forward). Eval: true.
__device__ __forceinline__ bool call_ok(const Header& hd, bool need_two, double* n) {
  *n = 0;
  if (!hd.base) return true;
  return header_ok(hd, n) && (!need_two || *n > 1);
}

// consts: head[c], tail[c], scale[c], shift[c].
template <class T>
__global__ void fwd_consts(int64_t c, BnForwardStats f, const T* gamma, const T* beta,
                           float* consts, int* err) {
  double n;
  if (!call_ok(f.hd, true, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  double mu, var;
  if (f.hd.base) {
    const void* pay = payload_of(f.hd);
    mu = load_fd(pay, 2 * ch, f.hd.w64) / n;
    var = load_fd(pay, 2 * ch + 1, f.hd.w64) / n - mu * mu;
    var = var > 0 ? var : 0.0;
  } else {
    mu = load_fd(f.running_mean, ch, f.r64);
    var = load_fd(f.running_var, ch, f.r64);
  }
  const double invstd = 1.0 / sqrt(var + f.eps);
  split_mean(mu, consts[ch], consts[c + ch]);
  consts[2 * c + ch] = static_cast<float>(invstd) * (gamma ? to_f(gamma[ch]) : 1.0f);
  consts[3 * c + ch] = beta ? to_f(beta[ch]) : 0.0f;
  if (f.save_mean) store_fd(f.save_mean, ch, f.mean64, mu);
  if (f.save_invstd) store_fd(f.save_invstd, ch, f.invstd64, invstd);
  if (f.update_running) {
    const double m = f.momentum;
    const double rm = load_fd(f.running_mean, ch, f.r64), rv = load_fd(f.running_var, ch, f.r64);
    store_fd(f.running_mean, ch, f.r64, (1 - m) * rm + m * mu);
    store_fd(f.running_var, ch, f.r64, (1 - m) * rv + m * var * n / (n - 1));  // unbiased
  }
}

// The element-wise kernels index with I: uint32_t when the tensor has fewer than 2^31
// elements (i + the grid's stride, at most 2^21, then never wraps), so each element's channel
// costs 32-bit divisions instead of 64-bit ones; else int64_t. Every element gets the same
// float arithmetic either way.
// The element-wise kernels (apply_fwd, apply_bwd) share this grid-stride walk: f(i, ch) for
// every element i this thread owns, ch = its channel.
template <class I, class F>
__device__ __forceinline__ void for_each_element(const Geo& g, F&& f) {
  const I total = static_cast<I>(g.outer * g.c * g.inner), inner = static_cast<I>(g.inner);
  const I c = static_cast<I>(g.c);
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<I>(gridDim.x) * blockDim.x) {
    const I ch = (i / inner) % c;
    f(i, ch);
  }
}

template <class T, class I>
__global__ void apply_fwd(Geo g, Header hd, const T* __restrict__ x, T* __restrict__ y,
                          const float* consts, int* err) {
  double n;
  if (!call_ok(hd, true, &n)) return mark_failed(err);
  const I c = static_cast<I>(g.c);
  for_each_element<I>(g, [&](I i, I ch) {
    y[i] = from_f<T>(((to_f(x[i]) - consts[ch]) - consts[c + ch]) * consts[2 * c + ch] +
                     consts[3 * c + ch]);
  });
}

// consts: head[c], tail[c], k[c], c1[c], c2[c].
template <class T>
__global__ void bwd_consts(int64_t c, Header hd, const T* gamma, const void* mean,
                           const void* invstd, bool s64, float* consts, int* err) {
  double n;
  if (!call_ok(hd, false, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  const double is = load_fd(invstd, ch, s64);
  split_mean(load_fd(mean, ch, s64), consts[ch], consts[c + ch]);
  consts[2 * c + ch] = static_cast<float>(is * (gamma ? to_f(gamma[ch]) : 1.0f));
  float c1 = 0.0f, c2 = 0.0f;
  if (hd.base && n > 0) {
    const void* pay = payload_of(hd);
    c1 = static_cast<float>(load_fd(pay, 2 * ch, hd.w64) / n);
    c2 = static_cast<float>(is * is * load_fd(pay, 2 * ch + 1, hd.w64) / n);
  }
  consts[3 * c + ch] = c1;
  consts[4 * c + ch] = c2;
}

template <class T, class I>  // I: see apply_fwd
__global__ void apply_bwd(Geo g, Header hd, const T* __restrict__ dy, const T* __restrict__ x,
                          T* __restrict__ dx, const float* consts, int* err) {
  double n;
  if (!call_ok(hd, false, &n)) return mark_failed(err);
  const I c = static_cast<I>(g.c);
  for_each_element<I>(g, [&](I i, I ch) {
    const float xc = (to_f(x[i]) - consts[ch]) - consts[c + ch];
    dx[i] = from_f<T>(consts[2 * c + ch] *
                      (to_f(dy[i]) - consts[3 * c + ch] - xc * consts[4 * c + ch]));
  });
}

template <class T>
__global__ void param_grads(int64_t c, Header hd, const double* local, const void* invstd, bool s64,
                            T* dgamma, T* dbeta, int* err) {
  double n;
  if (!call_ok(hd, false, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  if (dgamma)
    dgamma[ch] = from_f<T>(static_cast<float>(load_fd(invstd, ch, s64) * local[2 * ch + 1]));
  if (dbeta) dbeta[ch] = from_f<T>(static_cast<float>(local[2 * ch]));
}

// ---- launchers ----------------------------------------------------------------------------

BnPlan plan(const BnArgs& a) { return plan_channels(a.outer, a.c, a.inner); }

size_t up(size_t b) { return (b + 255) / 256 * 256; }

// Scratch: part floats [splits][2][c] | local doubles [2c] | consts floats [5c].
struct Scratch {
  float* part;
  double* local;
  float* consts;
};
Scratch carve(const BnArgs& a, void* s) {
  char* p = static_cast<char*>(s);
  const size_t c = static_cast<size_t>(std::max<int64_t>(a.c, 0));
  const size_t part = up(static_cast<size_t>(plan(a).splits) * 2 * c * sizeof(float));
  return {reinterpret_cast<float*>(p), reinterpret_cast<double*>(p + part),
          reinterpret_cast<float*>(p + part + up(2 * c * sizeof(double)))};
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
Geo geo(const BnArgs& a) { return {a.outer, a.c, a.inner, a.channels_last, plan(a).has_values}; }
unsigned per_channel_blocks(int64_t c) { return static_cast<unsigned>((c + 255) / 256); }
unsigned elementwise_blocks(const BnArgs& a) {
  const int64_t total = a.outer * a.c * a.inner;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>((total + 255) / 256, 1), 8192));
}
// 32-bit element indices (see apply_fwd): below 2^31 elements (a grid of at most 8192 x 256
// threads) and below 2^31 per-channel constants (the index 4c + ch of the backward's c2).
bool index32(const BnArgs& a) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  return a.outer * a.c * a.inner < kLimit && 5 * a.c < kLimit;
}

template <class D, bool kBwd>
void channel_sums(const BnArgs& a, const D* x, const D* dy, const void* mean, bool s64, bool robust,
                  bool w64, void* payload, void* scratch) {
  if (a.c <= 0) return;
  const BnPlan p = plan(a);
  const Scratch s = carve(a, scratch);
  const Geo g = geo(a);
  const Term<D, kBwd> t{x, dy};
  if (p.splits > 0) {  // 0 when this rank has no element: nothing may read x
    if (p.wide)
      launch("bn sums_wide", sums_wide<D, kBwd>,
             dim3(static_cast<unsigned>(a.c), static_cast<unsigned>(p.splits)), dim3(kWide),
             st(a.stream), g, t, mean, s64, robust, p.per, s.part);
    else
      launch(
          "bn sums_narrow", sums_narrow<D, kBwd>,
          dim3(static_cast<unsigned>((a.c + kTileC - 1) / kTileC), static_cast<unsigned>(p.splits)),
          dim3(kTileC, kTileR), st(a.stream), g, t, mean, s64, robust, p.per, s.part);
  }
  launch("bn combine", combine<D, kBwd>, dim3(per_channel_blocks(a.c)), dim3(256), st(a.stream), g,
         x, robust, p.splits, static_cast<const float*>(s.part), w64, payload,
         kBwd ? s.local : nullptr);
}

}  // namespace

size_t bn_scratch_bytes(const BnArgs& a) {
  const size_t c = static_cast<size_t>(std::max<int64_t>(a.c, 0));
  return up(static_cast<size_t>(plan(a).splits) * 2 * c * sizeof(float)) +
         up(2 * c * sizeof(double)) + up(5 * c * sizeof(float));
}

template <class T>
void bn_partial_forward(const BnArgs& a, const T* x, bool robust, bool w64, void* payload,
                        void* scratch) {
  using D = typename Dev<T>::type;
  channel_sums<D, false>(a, reinterpret_cast<const D*>(x), nullptr, nullptr, false, robust, w64,
                         payload, scratch);
}

template <class T>
void bn_forward_stats(const BnArgs& a, const BnForwardStats& f, const T* gamma, const T* beta,
                      void* scratch, int* err) {
  using D = typename Dev<T>::type;
  if (a.c <= 0) return;
  launch("bn fwd_consts", fwd_consts<D>, dim3(per_channel_blocks(a.c)), dim3(256), st(a.stream),
         a.c, f, reinterpret_cast<const D*>(gamma), reinterpret_cast<const D*>(beta),
         carve(a, scratch).consts, err);
}

template <class T>
void bn_apply_forward(const BnArgs& a, const Header& hd, const T* x, T* y, void* scratch,
                      int* err) {
  using D = typename Dev<T>::type;
  if (a.outer * a.c * a.inner <= 0) return;
  launch("bn apply_fwd", index32(a) ? apply_fwd<D, uint32_t> : apply_fwd<D, int64_t>,
         dim3(elementwise_blocks(a)), dim3(256), st(a.stream), geo(a), hd,
         reinterpret_cast<const D*>(x), reinterpret_cast<D*>(y),
         static_cast<const float*>(carve(a, scratch).consts), err);
}

template <class T>
void bn_partial_backward(const BnArgs& a, const T* dy, const T* x, const void* mean, bool s64,
                         bool w64, void* payload, void* scratch) {
  using D = typename Dev<T>::type;
  channel_sums<D, true>(a, reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(dy), mean, s64,
                        false, w64, payload, scratch);
}

template <class T>
void bn_apply_backward(const BnArgs& a, const Header& hd, const T* dy, const T* x, const T* gamma,
                       const void* mean, const void* invstd, bool s64, T* dx, T* dgamma, T* dbeta,
                       void* scratch, int* err) {
  using D = typename Dev<T>::type;
  if (a.c <= 0) return;
  const Scratch s = carve(a, scratch);
  launch("bn bwd_consts", bwd_consts<D>, dim3(per_channel_blocks(a.c)), dim3(256), st(a.stream),
         a.c, hd, reinterpret_cast<const D*>(gamma), mean, invstd, s64, s.consts, err);
  if (a.outer * a.inner > 0) {
    launch("bn apply_bwd", index32(a) ? apply_bwd<D, uint32_t> : apply_bwd<D, int64_t>,
           dim3(elementwise_blocks(a)), dim3(256), st(a.stream), geo(a), hd,
           reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x), reinterpret_cast<D*>(dx),
           static_cast<const float*>(s.consts), err);
  }
  if (dgamma || dbeta) {
    launch("bn param_grads", param_grads<D>, dim3(per_channel_blocks(a.c)), dim3(256), st(a.stream),
           a.c, hd, static_cast<const double*>(s.local), invstd, s64, reinterpret_cast<D*>(dgamma),
           reinterpret_cast<D*>(dbeta), err);
  }
}

#define TPNORM_CUDA_BN_INSTANTIATE(T)                                                              \
  template void bn_partial_forward<T>(const BnArgs&, const T*, bool, bool, void*, void*);          \
  template void bn_forward_stats<T>(const BnArgs&, const BnForwardStats&, const T*, const T*,      \
                                    void*, int*);                                                  \
  template void bn_apply_forward<T>(const BnArgs&, const Header&, const T*, T*, void*, int*);      \
  template void bn_partial_backward<T>(const BnArgs&, const T*, const T*, const void*, bool, bool, \
                                       void*, void*);                                              \
  template void bn_apply_backward<T>(const BnArgs&, const Header&, const T*, const T*, const T*,   \
                                     const void*, const void*, bool, T*, T*, T*, void*, int*);
TPNORM_CUDA_BN_INSTANTIATE(float)
TPNORM_CUDA_BN_INSTANTIATE(f16)
TPNORM_CUDA_BN_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
