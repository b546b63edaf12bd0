// exact_channels.cu — CUDA kernels of Stats::kExact for SyncBatchNorm; see exact_channels.h.
// The arithmetic is exact_channels_math.h's (the CPU's formulas, host-tested); these kernels
// only deal the work out: a block per (channel, split) for the sums, a thread per channel for
// the constants, a grid-stride loop for the elements. Simple on purpose: two passes over the
// data in the partials (the block's largest exponent, then the sums); channels-last partials
// read a channel's column (strided); not tuned.
#include <algorithm>
#include <stdexcept>

#include "common/exact_sum.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/exact_acc.h"
#include "kernels/cuda/exact_channels.h"
#include "kernels/cuda/exact_channels_math.h"
#include "kernels/cuda/exact_device.cuh"
#include "kernels/cuda/launch.cuh"

namespace tpnorm::kernels::cuda {
namespace {

constexpr int kThreads = kBnExactThreads;

// Scratch: consts floats [5c] | local doubles [2c] | split limbs int64 [c][splits][kBnFwdLimbs].
size_t up(size_t b) { return (b + 255) / 256 * 256; }
struct Scratch {
  float* consts;
  double* local;
  int64_t* parts;
};
Scratch carve(const BnExactPlan& p, void* s) {
  char* b = static_cast<char*>(s);
  const auto c = static_cast<size_t>(p.c);
  const size_t k = up(5 * c * sizeof(float)), l = up(2 * c * sizeof(double));
  return {reinterpret_cast<float*>(b), reinterpret_cast<double*>(b + k),
          reinterpret_cast<int64_t*>(b + k + l)};
}

BnExactPlan plan_of(const BnArgs& a) { return bn_exact_plan(a.outer, a.c, a.inner); }

__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }

// The call may go on: no header (eval), or the summed int64 header is fine (and n > 1 where
// batch statistics are made). *n: the global count per channel (0 without a header).
__device__ __forceinline__ bool bn_exact_ok(const Header& hd, bool need_two, int64_t* n) {
  *n = 0;
  if (!hd.base) return true;
  return exact_header_ok(hd, n) && (!need_two || *n > 1);
}

// ---- partials ---------------------------------------------------------------------------

// Block (ch, sp): the split's limbs into parts[(ch * splits + sp) * kBnFwdLimbs]. N = 1: x
// (forward); N = 2: dy and dy * xmu (backward, mean: the saved mean). Every thread reaches
// every barrier (group_max, group_sum): the walks only decide how many elements a thread adds.
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    part(BnExactPlan p, const T* __restrict__ x, const T* __restrict__ dy, const void* mean,
         bool s64, int64_t* __restrict__ parts) {
  const int64_t ch = blockIdx.x, sp = blockIdx.y;
  float mh = 0.0f, mt = 0.0f;
  if (N == 2) bn_split_mean(load_fd(mean, ch, s64), &mh, &mt);
  auto load = [&](int64_t o, uint32_t(&u)[N]) {
    if constexpr (N == 1) {
      u[0] = bits_of(to_f(x[o]));
    } else {
      float a, b;
      bn_bwd_terms(to_f(dy[o]), to_f(x[o]), mh, mt, &a, &b);
      u[0] = bits_of(a);
      u[1] = bits_of(b);
    }
  };
  int emax[N];
  bn_thread_emax<N>(p, ch, sp, threadIdx.x, blockDim.x, load, emax);
#pragma unroll
  for (int j = 0; j < N; ++j) emax[j] = group_max(emax[j], blockDim.x);
  constexpr int K = N == 1 ? kBnFwdLimbs : kBnBwdLimbs;
  int64_t l[K];
  bn_thread_limbs<N>(p, ch, sp, threadIdx.x, blockDim.x, load, emax, l);
  group_sum(l, blockDim.x);  // int64 adds: exact and order-free
  if (threadIdx.x == 0) {
    bn_normalize(l, K);
    int64_t* out = parts + (ch * p.splits + sp) * kBnFwdLimbs;
#pragma unroll
    for (int i = 0; i < K; ++i) out[i] = l[i];
  }
}

// A thread per channel: its splits' limbs added (int64) and normalized into the payload
// (when given), and (local, backward) this rank's sums rounded once, as the CPU's
// bn_exact_backward_sums(limbs, 1).
__global__ void combine(BnExactPlan p, int k, const int64_t* __restrict__ parts,
                        int64_t* __restrict__ payload, double* __restrict__ local) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= p.c) return;
  int64_t l[kBnFwdLimbs] = {};
  for (int64_t sp = 0; sp < p.splits; ++sp) {
    const int64_t* in = parts + (ch * p.splits + sp) * kBnFwdLimbs;
    for (int i = 0; i < k; ++i) l[i] += in[i];
  }
  bn_normalize(l, k);
  if (payload)
    for (int i = 0; i < k; ++i) payload[ch * k + i] = l[i];
  if (local) bn_exact_backward_sums(l, 1, &local[2 * ch], &local[2 * ch + 1]);
}

// ---- forward ------------------------------------------------------------------------------

// A thread per channel (BnForwardOp::apply): batch statistics from the summed limbs (and the
// running statistics' update) or, in eval, the running statistics; invstd; the saved
// statistics; the apply's constants {h, t, scale, shift} into consts[4c].
template <class T>
__global__ void fwd_consts(BnExactPlan p, BnForwardStats f, const T* gamma, const T* beta,
                           float* consts, int* err) {
  int64_t n;
  if (!bn_exact_ok(f.hd, true, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= p.c) return;
  double mean, var;
  if (f.hd.base) {
    bn_exact_moments(exact_payload(f.hd) + ch * kBnFwdLimbs, static_cast<uint64_t>(n), &mean, &var);
    if (f.update_running) {
      double rm = load_fd(f.running_mean, ch, f.r64), rv = load_fd(f.running_var, ch, f.r64);
      bn_update_running(mean, var, static_cast<double>(n), f.momentum, &rm, &rv);
      store_fd(f.running_mean, ch, f.r64, rm);
      store_fd(f.running_var, ch, f.r64, rv);
    }
  } else {
    mean = load_fd(f.running_mean, ch, f.r64);
    var = load_fd(f.running_var, ch, f.r64);
  }
  const double invstd = bn_invstd(var, f.eps);
  if (f.save_mean) store_fd(f.save_mean, ch, f.mean64, mean);
  if (f.save_invstd) store_fd(f.save_invstd, ch, f.invstd64, invstd);
  const BnFwdConsts k =
      bn_fwd_consts(mean, invstd, gamma ? to_f(gamma[ch]) : 1.0f, beta ? to_f(beta[ch]) : 0.0f);
  consts[ch] = k.h;
  consts[p.c + ch] = k.t;
  consts[2 * p.c + ch] = k.scale;
  consts[3 * p.c + ch] = k.shift;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    apply_fwd(BnExactPlan p, Header hd, const T* __restrict__ x, T* __restrict__ y,
              const float* __restrict__ consts, int* err) {
  int64_t n;
  if (!bn_exact_ok(hd, true, &n)) return mark_failed(err);
  const int64_t total = p.m * p.c, c = p.c;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (BnFlatWalk w =
           BnFlatWalk::start(i0, static_cast<int64_t>(gridDim.x) * blockDim.x, c, p.inner);
       w.i < total; w.next(c, p.inner)) {
    const BnFwdConsts k{consts[w.ch], consts[c + w.ch], consts[2 * c + w.ch], consts[3 * c + w.ch]};
    y[w.i] = from_f<T>(bn_exact_y(to_f(x[w.i]), k));
  }
}

// ---- backward -----------------------------------------------------------------------------

// A thread per channel (BnBackwardOp::exact_apply): the summed sums divided by the global count
// and rounded once (training; eval: zeros), then the constants {h, t, k, c1, c2} into consts[5c].
template <class T>
__global__ void bwd_consts(BnExactPlan p, Header hd, const T* gamma, const void* mean,
                           const void* invstd, bool s64, float* consts, int* err) {
  int64_t n;
  if (!bn_exact_ok(hd, false, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= p.c) return;
  double s0 = 0.0, s1 = 0.0;
  if (hd.base)
    bn_exact_backward_sums(exact_payload(hd) + ch * kBnBwdLimbs, static_cast<uint64_t>(n), &s0,
                           &s1);
  const BnBwdConsts k = bn_bwd_consts(load_fd(mean, ch, s64), load_fd(invstd, ch, s64),
                                      gamma ? to_f(gamma[ch]) : 1.0f, hd.base != nullptr, s0, s1);
  consts[ch] = k.h;
  consts[p.c + ch] = k.t;
  consts[2 * p.c + ch] = k.k;
  consts[3 * p.c + ch] = k.c1;
  consts[4 * p.c + ch] = k.c2;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    apply_bwd(BnExactPlan p, Header hd, const T* __restrict__ dy, const T* __restrict__ x,
              T* __restrict__ dx, const float* __restrict__ consts, int* err) {
  int64_t n;
  if (!bn_exact_ok(hd, false, &n)) return mark_failed(err);
  const int64_t total = p.m * p.c, c = p.c;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (BnFlatWalk w =
           BnFlatWalk::start(i0, static_cast<int64_t>(gridDim.x) * blockDim.x, c, p.inner);
       w.i < total; w.next(c, p.inner)) {
    const BnBwdConsts k{consts[w.ch], consts[c + w.ch], consts[2 * c + w.ch], consts[3 * c + w.ch],
                        consts[4 * c + w.ch]};
    dx[w.i] = from_f<T>(bn_exact_dx(to_f(dy[w.i]), to_f(x[w.i]), k));
  }
}

// bn_param_grads from this rank's sums rounded once (local).
template <class T>
__global__ void param_grads(BnExactPlan p, Header hd, const double* __restrict__ local,
                            const void* invstd, bool s64, T* dgamma, T* dbeta, int* err) {
  int64_t n;
  if (!bn_exact_ok(hd, false, &n)) return mark_failed(err);
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= p.c) return;
  if (dgamma) dgamma[ch] = from_f<T>(bn_dgamma(load_fd(invstd, ch, s64), local[2 * ch + 1]));
  if (dbeta) dbeta[ch] = from_f<T>(static_cast<float>(local[2 * ch]));
}

// ---- launchers ----------------------------------------------------------------------------

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
dim3 per_channel(int64_t c) { return dim3(static_cast<unsigned>((c + 127) / 128)); }

// The partial blocks, then the splits' sums per channel. With no element the blocks read
// nothing (their walks are empty) and write zero limbs.
template <class D, int N>
void sums(const BnArgs& a, const D* x, const D* dy, const void* mean, bool s64, int64_t* payload,
          void* scratch) {
  const BnExactPlan p = plan_of(a);
  if (p.c <= 0) return;
  if (p.c > INT32_MAX)
    throw std::length_error("tpnorm: too many channels for one CUDA launch");  // grid.x
  const Scratch s = carve(p, scratch);
  launch("exact bn part", part<D, N>,
         dim3(static_cast<unsigned>(p.c), static_cast<unsigned>(p.splits)), dim3(kThreads),
         st(a.stream), p, x, dy, mean, s64, s.parts);
  launch("exact bn combine", combine, per_channel(p.c), dim3(128), st(a.stream), p,
         N == 1 ? kBnFwdLimbs : kBnBwdLimbs, static_cast<const int64_t*>(s.parts), payload,
         N == 2 ? s.local : static_cast<double*>(nullptr));
}

}  // namespace

size_t exact_bn_scratch_bytes(const BnArgs& a) {
  const BnExactPlan p = plan_of(a);
  const auto c = static_cast<size_t>(p.c);
  return up(5 * c * sizeof(float)) + up(2 * c * sizeof(double)) +
         c * static_cast<size_t>(p.splits) * kBnFwdLimbs * sizeof(int64_t);
}

template <class T>
void exact_bn_partial_forward(const BnArgs& a, const T* x, int64_t* limbs, void* scratch) {
  sums<DevT<T>, 1>(a, dv(x), static_cast<const DevT<T>*>(nullptr), nullptr, false, limbs, scratch);
}

template <class T>
void exact_bn_apply_forward(const BnArgs& a, const BnForwardStats& f, const T* gamma, const T* beta,
                            const T* x, T* y, void* scratch, int* err) {
  const BnExactPlan p = plan_of(a);
  if (p.c <= 0) return;
  const Scratch s = carve(p, scratch);
  launch("exact bn fwd_consts", fwd_consts<DevT<T>>, per_channel(p.c), dim3(128), st(a.stream), p, f,
         dv(gamma), dv(beta), s.consts, err);
  if (p.m > 0)
    launch("exact bn apply_fwd", apply_fwd<DevT<T>>,
           dim3(static_cast<unsigned>(bn_apply_blocks(p.m * p.c))), dim3(kThreads), st(a.stream), p,
           f.hd, dv(x), dv(y), static_cast<const float*>(s.consts), err);
}

template <class T>
void exact_bn_partial_backward(const BnArgs& a, const T* dy, const T* x, const void* mean, bool s64,
                               int64_t* limbs, void* scratch) {
  sums<DevT<T>, 2>(a, dv(x), dv(dy), mean, s64, limbs, scratch);
}

template <class T>
void exact_bn_apply_backward(const BnArgs& a, const Header& hd, const T* dy, const T* x,
                             const T* gamma, const void* mean, const void* invstd, bool s64, T* dx,
                             T* dgamma, T* dbeta, void* scratch, int* err) {
  const BnExactPlan p = plan_of(a);
  if (p.c <= 0) return;
  const Scratch s = carve(p, scratch);
  launch("exact bn bwd_consts", bwd_consts<DevT<T>>, per_channel(p.c), dim3(128), st(a.stream), p, hd,
         dv(gamma), mean, invstd, s64, s.consts, err);
  if (p.m > 0)
    launch("exact bn apply_bwd", apply_bwd<DevT<T>>,
           dim3(static_cast<unsigned>(bn_apply_blocks(p.m * p.c))), dim3(kThreads), st(a.stream), p,
           hd, dv(dy), dv(x), dv(dx), static_cast<const float*>(s.consts), err);
  if (dgamma || dbeta)
    launch("exact bn param_grads", param_grads<DevT<T>>, per_channel(p.c), dim3(128), st(a.stream), p,
           hd, static_cast<const double*>(s.local), invstd, s64, dv(dgamma), dv(dbeta), err);
}

#define TPNORM_CUDA_EXACT_BN_INSTANTIATE(T)                                                        \
  template void exact_bn_partial_forward<T>(const BnArgs&, const T*, int64_t*, void*);             \
  template void exact_bn_apply_forward<T>(const BnArgs&, const BnForwardStats&, const T*,          \
                                          const T*, const T*, T*, void*, int*);                    \
  template void exact_bn_partial_backward<T>(const BnArgs&, const T*, const T*, const void*, bool, \
                                             int64_t*, void*);                                     \
  template void exact_bn_apply_backward<T>(const BnArgs&, const Header&, const T*, const T*,       \
                                           const T*, const void*, const void*, bool, T*, T*, T*,   \
                                           void*, int*);
TPNORM_CUDA_EXACT_BN_INSTANTIATE(float)
TPNORM_CUDA_EXACT_BN_INSTANTIATE(f16)
TPNORM_CUDA_EXACT_BN_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
