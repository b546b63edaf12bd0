// exact_groups.cu — CUDA kernels of Stats::kExact for GroupNorm / InstanceNorm; see
// exact_groups.h. Every formula is the CPU's (kernels/cpu/exact_groups.cpp, group_norm.cpp);
// the comments name the CPU code each kernel mirrors. Simple on purpose: a 256-thread block per
// slot / channel / plane (grid-stride, block-uniform loops), two passes for the exponent window.
#include <algorithm>

#include "common/exact_sum.h"
#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/exact_acc.h"
#include "kernels/cuda/exact_device.cuh"
#include "kernels/cuda/exact_groups.h"
#include "kernels/cuda/launch.cuh"

namespace tpnorm::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kFwdLimbs = 1 + exact::kLimbs1 + exact::kLimbs2;  // exact::moment_limbs(true)
constexpr int kBwdLimbs = 1 + 2 * exact::kLimbs1;               // exact::moment_limbs(false)

// exact_groups.cpp local_channels: this rank's local channels [lo, hi) of group g.
__device__ __forceinline__ void local_run(const GroupArgs& a, int64_t g, int64_t& lo, int64_t& hi) {
  lo = max(g * a.cpg - a.c0, int64_t{0});
  hi = min((g + 1) * a.cpg - a.c0, a.c_local);
}

// The (sample, group) slot of local plane r (sample r / c_local, local channel r % c_local).
__device__ __forceinline__ int64_t slot_of_plane(const GroupArgs& a, int64_t r) {
  return (r / a.c_local) * a.groups + (a.c0 + r % a.c_local) / a.cpg;
}

// The summed int64 header is fine and the ranks' channels add up to all channels.
__device__ __forceinline__ bool exact_group_ok(const GroupArgs& a, const Header& hd) {
  int64_t n;
  return exact_header_ok(hd, &n) && n == a.channels;
}

__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }

// xhat = ((x - mh) - mt) * rs, as the CPU forms it in float32.
__device__ __forceinline__ float xhat_of(float xv, float mh, float mt, float rs) {
  return __fmul_rn(__fsub_rn(__fsub_rn(xv, mh), mt), rs);
}

// ---- partials ---------------------------------------------------------------------------

// group_exact_partial_forward: a slot's run of (hi - lo) * spatial values, sum x and sum x^2.
template <class T>
__global__ void __launch_bounds__(kThreads)
    part_fwd(GroupArgs a, const T* __restrict__ x, int64_t* __restrict__ out) {
  const int64_t slots = a.n * a.groups;
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {  // block-uniform
    int64_t lo, hi;
    local_run(a, s % a.groups, lo, hi);
    const int64_t m = hi > lo ? (hi - lo) * a.spatial : 0;
    const T* run = x + ((s / a.groups) * a.c_local + (hi > lo ? lo : 0)) * a.spatial;
    int emax = 0;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x)
      emax = max(emax, exact_good_exponent(bits_of(to_f(run[i]))));
    emax = group_max(emax, blockDim.x);
    ExactAcc<true> acc(emax);
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) acc.add(bits_of(to_f(run[i])));
    acc.flush();
    int64_t l[kFwdLimbs];
    l[0] = acc.bad;
    exact::pack(acc.s1, l + 1, exact::kLimbs1);
    exact::pack(acc.s2, l + 1 + exact::kLimbs1, exact::kLimbs2);
    group_sum(l, blockDim.x);  // int64 adds: exact and order-free
    if (threadIdx.x == 0) write_row_limbs<exact::kLimbs2>(l, out + s * kFwdLimbs, kFwdLimbs);
  }
}

// The exact sums of two terms over elements [0, m) shared by the block's threads (every thread
// must call: block barriers), in two passes (each term's largest exponent, then the sums): l =
// {bad terms, limbs of sum first, limbs of sum second}, added over the block with int64 adds
// (exact and order-free), the same in every thread. terms(i, first, second) forms element i's.
template <class Terms>
__device__ __forceinline__ void block_exact_pair(int64_t m, Terms terms, int64_t (&l)[kBwdLimbs]) {
  int e1 = 0, e2 = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    float t1, t2;
    terms(i, t1, t2);
    e1 = max(e1, exact_good_exponent(bits_of(t1)));
    e2 = max(e2, exact_good_exponent(bits_of(t2)));
  }
  e1 = group_max(e1, blockDim.x);
  e2 = group_max(e2, blockDim.x);
  ExactAcc<false> a1(e1), a2(e2);
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    float t1, t2;
    terms(i, t1, t2);
    a1.add(bits_of(t1));
    a2.add(bits_of(t2));
  }
  a1.flush();
  a2.flush();
  l[0] = a1.bad + a2.bad;
  exact::pack(a1.s1, l + 1, exact::kLimbs1);
  exact::pack(a2.s1, l + 1 + exact::kLimbs1, exact::kLimbs1);
  group_sum(l, blockDim.x);
}

// group_exact_partial_backward, slots: g = gamma[c] * dy and g * xhat over the slot's run.
template <class T>
__global__ void __launch_bounds__(kThreads)
    part_bwd(GroupArgs a, const T* __restrict__ dy, const T* __restrict__ x,
             const T* __restrict__ gamma, const void* mean, const void* rstd,
             int64_t* __restrict__ out) {
  const int64_t slots = a.n * a.groups;
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {  // block-uniform
    int64_t lo, hi;
    local_run(a, s % a.groups, lo, hi);
    const int64_t m = hi > lo ? (hi - lo) * a.spatial : 0;
    const int64_t base = ((s / a.groups) * a.c_local + (hi > lo ? lo : 0)) * a.spatial;
    float mh, mt;
    split_mean(load_fd(mean, s, a.s64), mh, mt);
    const float rs = static_cast<float>(load_fd(rstd, s, a.s64));
    auto terms = [&](int64_t i, float& g, float& gx) {
      const float gm = gamma ? to_f(gamma[lo + i / a.spatial]) : 1.0f;
      g = __fmul_rn(gm, to_f(dy[base + i]));
      gx = __fmul_rn(g, xhat_of(to_f(x[base + i]), mh, mt, rs));
    };
    int64_t l[kBwdLimbs];
    block_exact_pair(m, terms, l);
    if (threadIdx.x == 0) write_row_limbs<exact::kLimbs1>(l, out + s * kBwdLimbs, kBwdLimbs);
  }
}

// group_exact_partial_backward, channels: sum dy * xhat and sum dy of local channel c over
// this rank's samples, exact, each rounded once (NaN when a term was bad).
template <class T>
__global__ void __launch_bounds__(kThreads)
    channel_sums(GroupArgs a, const T* __restrict__ dy, const T* __restrict__ x, const void* mean,
                 const void* rstd, double* __restrict__ dparams) {
  const int64_t m = a.n * a.spatial;
  for (int64_t c = blockIdx.x; c < a.c_local; c += gridDim.x) {  // block-uniform
    auto terms = [&](int64_t i, float& dx, float& d) {
      const int64_t b = i / a.spatial, j = i % a.spatial;
      const int64_t k = b * a.groups + (a.c0 + c) / a.cpg;
      float mh, mt;
      split_mean(load_fd(mean, k, a.s64), mh, mt);
      const float rs = static_cast<float>(load_fd(rstd, k, a.s64));
      const int64_t o = (b * a.c_local + c) * a.spatial + j;
      d = to_f(dy[o]);
      dx = __fmul_rn(d, xhat_of(to_f(x[o]), mh, mt, rs));
    };
    int64_t l[kBwdLimbs];
    block_exact_pair(m, terms, l);
    if (threadIdx.x == 0) {
      const double nan = __longlong_as_double(0x7ff8000000000000LL);
      const exact::Sum1 t1 = exact::unpack<4>(l + 1, exact::kLimbs1);
      const exact::Sum1 t2 = exact::unpack<4>(l + 1 + exact::kLimbs1, exact::kLimbs1);
      dparams[c] = l[0] != 0 ? nan : exact::mean(t1, uint64_t{1});
      dparams[a.c_local + c] = l[0] != 0 ? nan : exact::mean(t2, uint64_t{1});
    }
  }
}

// ---- finish -----------------------------------------------------------------------------

// exact_group_finish (+ group_apply_forward's per-slot loop): a thread per slot; the slot's
// two doubles overwrite the start of its limbs: forward {mean, rstd = 1 / sqrt(var + eps)}
// (and the saved mean / rstd), backward {sum g / count, sum g*xhat / count}.
__global__ void __launch_bounds__(128) finish(GroupArgs a, Header hd, bool forward, double count,
                                              double eps, void* mean, void* rstd, int* err) {
  if (!exact_group_ok(a, hd)) return mark_failed(err);
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= a.n * a.groups) return;
  int64_t* in = exact_payload(hd) + k * (forward ? kFwdLimbs : kBwdLimbs);
  const auto n = static_cast<uint64_t>(count);
  double st[2] = {0.0, 0.0};
  if (in[0] != 0) {
    st[0] = st[1] = __longlong_as_double(0x7ff8000000000000LL);  // quiet NaN
  } else if (n != 0) {
    const exact::Sum1 s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
    st[0] = exact::mean(s1, n);
    st[1] = forward
                ? exact::variance(s1, exact::unpack<8>(in + 1 + exact::kLimbs1, exact::kLimbs2), n)
                : exact::mean(exact::unpack<4>(in + 1 + exact::kLimbs1, exact::kLimbs1), n);
  }
  if (forward) {
    st[1] = __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(st[1], eps)));
    if (mean) store_fd(mean, k, a.s64, st[0]);
    if (rstd) store_fd(rstd, k, a.s64, st[1]);
  }
  double* o = reinterpret_cast<double*>(in);
  o[0] = st[0];
  o[1] = st[1];
}

// ---- applies ----------------------------------------------------------------------------

// group_apply_forward with final_stats: y = fma((x - mh) - mt, float(rstd) * gamma, beta).
template <class T>
__global__ void __launch_bounds__(kThreads)
    apply_fwd(GroupArgs a, Header hd, const T* __restrict__ x, const T* __restrict__ gamma,
              const T* __restrict__ beta, T* __restrict__ y, int* err) {
  if (!exact_group_ok(a, hd)) return mark_failed(err);
  for (int64_t r = blockIdx.x; r < a.n * a.c_local; r += gridDim.x) {
    const int64_t c = r % a.c_local;
    const double* st =
        reinterpret_cast<const double*>(exact_payload(hd) + slot_of_plane(a, r) * kFwdLimbs);
    float mh, mt;
    split_mean(st[0], mh, mt);
    const float s = __fmul_rn(static_cast<float>(st[1]), gamma ? to_f(gamma[c]) : 1.0f);
    const float b = beta ? to_f(beta[c]) : 0.0f;
    const T* xr = x + r * a.spatial;
    T* yr = y + r * a.spatial;
    for (int64_t j = threadIdx.x; j < a.spatial; j += blockDim.x)
      yr[j] = from_f<T>(__fmaf_rn(__fsub_rn(__fsub_rn(to_f(xr[j]), mh), mt), s, b));
  }
}

// group_apply_backward with count 1: dx = rs * ((gamma * dy - c1) - xhat * c2).
template <class T>
__global__ void __launch_bounds__(kThreads)
    apply_bwd(GroupArgs a, Header hd, const T* __restrict__ dy, const T* __restrict__ x,
              const T* __restrict__ gamma, const void* mean, const void* rstd, T* __restrict__ dx,
              int* err) {
  if (!exact_group_ok(a, hd)) return mark_failed(err);
  for (int64_t r = blockIdx.x; r < a.n * a.c_local; r += gridDim.x) {
    const int64_t c = r % a.c_local, k = slot_of_plane(a, r);
    const double* st = reinterpret_cast<const double*>(exact_payload(hd) + k * kBwdLimbs);
    const float c1 = static_cast<float>(st[0]), c2 = static_cast<float>(st[1]);
    float mh, mt;
    split_mean(load_fd(mean, k, a.s64), mh, mt);
    const float rs = static_cast<float>(load_fd(rstd, k, a.s64));
    const float gm = gamma ? to_f(gamma[c]) : 1.0f;
    const T* xr = x + r * a.spatial;
    const T* dyr = dy + r * a.spatial;
    T* dxr = dx + r * a.spatial;
    for (int64_t j = threadIdx.x; j < a.spatial; j += blockDim.x) {
      const float xhat = xhat_of(to_f(xr[j]), mh, mt, rs);
      const float g = __fmul_rn(gm, to_f(dyr[j]));
      dxr[j] = from_f<T>(__fmul_rn(rs, __fsub_rn(__fsub_rn(g, c1), __fmul_rn(xhat, c2))));
    }
  }
}

// group_apply_backward's last loop: dgamma / dbeta from this rank's rounded sums.
template <class T>
__global__ void __launch_bounds__(kThreads)
    param_grads(GroupArgs a, Header hd, const double* __restrict__ dparams, T* __restrict__ dgamma,
                T* __restrict__ dbeta, int* err) {
  if (!exact_group_ok(a, hd)) return mark_failed(err);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.c_local) return;
  if (dgamma) dgamma[c] = from_f<T>(static_cast<float>(dparams[c]));
  if (dbeta) dbeta[c] = from_f<T>(static_cast<float>(dparams[a.c_local + c]));
}

// ---- launchers ----------------------------------------------------------------------------

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }

// Blocks for a grid-stride loop over `items` (the loops above stay correct for any count).
dim3 grid_for(int64_t items) {
  return dim3(static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(items, 1), 1 << 20)));
}

// At least one block, so that a call without slots still checks its header.
dim3 threads_for(int64_t items, int per) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, (items + per - 1) / per)));
}

}  // namespace

template <class T>
void exact_group_partial_forward(const GroupArgs& a, const T* x, int64_t* limbs) {
  const int64_t slots = a.n * a.groups;
  if (slots <= 0) return;
  launch("exact group part_fwd", part_fwd<DevT<T>>, grid_for(slots), dim3(kThreads), st(a.stream), a,
         dv(x), limbs);
}

template <class T>
void exact_group_apply_forward(const GroupArgs& a, const Header& hd, double count, double eps,
                               const T* x, const T* gamma, const T* beta, T* y, void* mean,
                               void* rstd, int* err) {
  launch("exact group finish", finish, threads_for(a.n * a.groups, 128), dim3(128), st(a.stream), a,
         hd, true, count, eps, mean, rstd, err);
  if (a.n * a.c_local * a.spatial <= 0) return;
  launch("exact group apply_fwd", apply_fwd<DevT<T>>, grid_for(a.n * a.c_local), dim3(kThreads),
         st(a.stream), a, hd, dv(x), dv(gamma), dv(beta), dv(y), err);
}

template <class T>
void exact_group_partial_backward(const GroupArgs& a, const T* dy, const T* x, const T* gamma,
                                  const void* mean, const void* rstd, int64_t* limbs,
                                  double* dparams) {
  const int64_t slots = a.n * a.groups;
  if (slots > 0)
    launch("exact group part_bwd", part_bwd<DevT<T>>, grid_for(slots), dim3(kThreads), st(a.stream), a,
           dv(dy), dv(x), dv(gamma), mean, rstd, limbs);
  if (a.c_local > 0)
    launch("exact group channel_sums", channel_sums<DevT<T>>, grid_for(a.c_local), dim3(kThreads),
           st(a.stream), a, dv(dy), dv(x), mean, rstd, dparams);
}

template <class T>
void exact_group_apply_backward(const GroupArgs& a, const Header& hd, double count, const T* dy,
                                const T* x, const T* gamma, const void* mean, const void* rstd,
                                T* dx, T* dgamma, T* dbeta, const double* dparams, int* err) {
  launch("exact group finish", finish, threads_for(a.n * a.groups, 128), dim3(128), st(a.stream), a,
         hd, false, count, 0.0, static_cast<void*>(nullptr), static_cast<void*>(nullptr), err);
  if (a.n * a.c_local * a.spatial > 0)
    launch("exact group apply_bwd", apply_bwd<DevT<T>>, grid_for(a.n * a.c_local), dim3(kThreads),
           st(a.stream), a, hd, dv(dy), dv(x), dv(gamma), mean, rstd, dv(dx), err);
  if ((dgamma || dbeta) && a.c_local > 0)
    launch("exact group param_grads", param_grads<DevT<T>>, threads_for(a.c_local, kThreads),
           dim3(kThreads), st(a.stream), a, hd, dparams, dv(dgamma), dv(dbeta), err);
}

#define TPNORM_CUDA_EXACT_GROUP_INSTANTIATE(T)                                                   \
  template void exact_group_partial_forward<T>(const GroupArgs&, const T*, int64_t*);            \
  template void exact_group_apply_forward<T>(const GroupArgs&, const Header&, double, double,    \
                                             const T*, const T*, const T*, T*, void*, void*,     \
                                             int*);                                              \
  template void exact_group_partial_backward<T>(const GroupArgs&, const T*, const T*, const T*,  \
                                                const void*, const void*, int64_t*, double*);    \
  template void exact_group_apply_backward<T>(const GroupArgs&, const Header&, double, const T*, \
                                              const T*, const T*, const void*, const void*, T*,  \
                                              T*, T*, const double*, int*);
TPNORM_CUDA_EXACT_GROUP_INSTANTIATE(float)
TPNORM_CUDA_EXACT_GROUP_INSTANTIATE(f16)
TPNORM_CUDA_EXACT_GROUP_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
