// group_norm.cu — CUDA kernels of GroupNorm / InstanceNorm; see group_norm.h.
//
// Kernels: the row kernels' partials over the planes (row_norm.cu), fold (a thread per
// (sample, group) slot adds its planes in channel order, as the CPU's serial loop does),
// channel_sums (a thread per local channel adds its planes in sample order: dgamma / dbeta),
// expand (each plane's group mean / rstd, which the row backward partial takes per row),
// slot_stats / bwd_consts (a thread per slot: the float constants the applies read, the saved
// statistics), then the element-wise apply kernels (SyncBatchNorm's planes walk, plan.h: a
// block per (local channel, split), accesses of up to 16 bytes, no division per element) and
// param_grads. Products and sums of the folds are rounded like the CPU's (no fused
// multiply-add). All indices are 64-bit.
#include <algorithm>

#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/group_norm.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"

namespace tpnorm::kernels::cuda {
namespace {

__device__ __forceinline__ int64_t slot_of(const GroupArgs& a, int64_t plane) {
  return (plane / a.c_local) * a.groups + (a.c0 + plane % a.c_local) / a.cpg;
}

__device__ __forceinline__ double mul_add(double t, double f, double v) {
  return __dadd_rn(t, __dmul_rn(f, v));
}
__device__ __forceinline__ float mul_add(float t, float f, float v) {
  return __fadd_rn(t, __fmul_rn(f, v));
}

// payload[2k], [2k+1] = sum over the slot's local planes, in channel order, of g * rows.
template <class W, class T>
__global__ void fold(GroupArgs a, const W* rows, const T* gamma, W* payload) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= a.n * a.groups) return;
  const int64_t s = k / a.groups, g = k % a.groups;
  const int64_t lo = max(int64_t{0}, g * a.cpg - a.c0);
  const int64_t hi = min(a.c_local, (g + 1) * a.cpg - a.c0);
  W t0 = 0, t1 = 0;
  for (int64_t cl = lo; cl < hi; ++cl) {
    const int64_t r = s * a.c_local + cl;
    const W f = gamma ? static_cast<W>(to_f(gamma[cl])) : W(1);
    t0 = mul_add(t0, f, rows[2 * r]);
    t1 = mul_add(t1, f, rows[2 * r + 1]);
  }
  payload[2 * k] = t0;
  payload[2 * k + 1] = t1;
}

// dparams[c] = sum over samples of sum dy*xhat; dparams[c_local + c] = of sum dy.
template <class W>
__global__ void channel_sums(GroupArgs a, const W* rows, double* dparams) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.c_local) return;
  double dg = 0, db = 0;
  for (int64_t s = 0; s < a.n; ++s) {
    const int64_t r = s * a.c_local + c;
    dg += static_cast<double>(rows[2 * r + 1]);
    db += static_cast<double>(rows[2 * r]);
  }
  dparams[c] = dg;
  dparams[a.c_local + c] = db;
}

__global__ void expand(GroupArgs a, const void* mean, const void* rstd, void* pm, void* pr) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.n * a.c_local) return;
  const int64_t k = slot_of(a, r);
  store_fd(pm, r, a.s64, load_fd(mean, k, a.s64));
  store_fd(pr, r, a.s64, load_fd(rstd, k, a.s64));
}

// The summed header is fine and the ranks' channels add up to all channels.
__device__ __forceinline__ bool group_call_ok(const GroupArgs& a, const Header& hd) {
  double n;
  return header_ok(hd, &n) && n == static_cast<double>(a.channels);
}

// The block's verdict on the call (every thread must call it, before any divergence).
__device__ __forceinline__ bool group_block_ok(const GroupArgs& a, const Header& hd, int* err) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = group_call_ok(a, hd) ? 1 : 0;
    if (!ok) atomicExch(err, 1);
  }
  __syncthreads();
  return ok != 0;
}

// Forward slot constants (float4 per slot: mean head, mean tail, rstd, 0) and the saved
// statistics; the apply reads them per plane (the values the apply computed per element before).
__global__ void slot_stats(GroupArgs a, Header hd, double count, double eps, float4* consts,
                           void* mean, void* rstd, int* err) {
  if (!group_call_ok(a, hd)) return mark_failed(err);
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= a.n * a.groups) return;
  const void* pay = payload_of(hd);
  double mu = 0, var = 0;
  if (count > 0) {
    mu = load_fd(pay, 2 * k, hd.w64) / count;
    var = max(load_fd(pay, 2 * k + 1, hd.w64) / count - mu * mu, 0.0);
  }
  const double rs = 1.0 / sqrt(var + eps);
  float4 c;
  split_mean(mu, c.x, c.y);
  c.z = static_cast<float>(rs);
  c.w = 0.0f;
  consts[k] = c;
  if (mean) store_fd(mean, k, a.s64, mu);
  if (rstd) store_fd(rstd, k, a.s64, rs);
}

// Backward slot constants, two float4 per slot: (mean head, mean tail, rstd, c1), (c2, 0, 0, 0)
// with c1 = sum(g dy) / count, c2 = sum(g dy xhat) / count of the summed payload.
__global__ void bwd_consts(GroupArgs a, Header hd, double count, const void* mean, const void* rstd,
                           float4* consts, int* err) {
  if (!group_call_ok(a, hd)) return mark_failed(err);
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= a.n * a.groups) return;
  const void* pay = payload_of(hd);
  float4 c0, c1 = {0.0f, 0.0f, 0.0f, 0.0f};
  split_mean(load_fd(mean, k, a.s64), c0.x, c0.y);
  c0.z = static_cast<float>(load_fd(rstd, k, a.s64));
  c0.w = static_cast<float>(load_fd(pay, 2 * k, hd.w64) / count);
  c1.x = static_cast<float>(load_fd(pay, 2 * k + 1, hd.w64) / count);
  consts[2 * k] = c0;
  consts[2 * k + 1] = c1;
}

// The element-wise applies walk the planes as SyncBatchNorm's do (plan.h: BnWalk over
// [n, c_local, spatial]): block (local channel, split), gamma / beta in registers, accesses of
// up to 16 bytes, kBnLoads in flight; the slot of a vector is plane * groups + the block's
// group (no division per element), its constants read once per vector.
template <class T, int V>
__global__ void __launch_bounds__(kBnThreads)
    apply_fwd(BnPlan p, GroupArgs a, Header hd, const T* __restrict__ x,
              const T* __restrict__ gamma, const T* __restrict__ beta, const float4* consts,
              T* __restrict__ y, int* err) {
  if (!group_block_ok(a, hd, err)) return;
  const int64_t c = blockIdx.x, g = (a.c0 + c) / a.cpg;  // once per block
  const float gm = gamma ? to_f(gamma[c]) : 1.0f, b = beta ? to_f(beta[c]) : 0.0f;
  BnWalk w = BnWalk::start(p, a.c_local, c, blockIdx.y, threadIdx.x);
  while (w.left > 0) {
    Pack<T, V> u[kBnLoads];
    int64_t at[kBnLoads], slot[kBnLoads];
    bool on[kBnLoads];
#pragma unroll
    for (int k = 0; k < kBnLoads; ++k) {
      on[k] = w.left > 0;
      if (on[k]) {
        at[k] = w.at;
        slot[k] = w.plane * a.groups + g;
        u[k] = load_pack<T, V>(x, w.at);
        w.next(p);
      }
    }
#pragma unroll
    for (int k = 0; k < kBnLoads; ++k) {
      if (!on[k]) continue;
      const float4 m = consts[slot[k]];
      const float s = m.z * gm;
      Pack<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(fmaf((to_f(u[k].v[j]) - m.x) - m.y, s, b));
      store_pack<T, V>(y, at[k], o);
    }
  }
}

template <class T, int V>
__global__ void __launch_bounds__(kBnThreads)
    apply_bwd(BnPlan p, GroupArgs a, Header hd, const T* __restrict__ dy, const T* __restrict__ x,
              const T* __restrict__ gamma, const float4* consts, T* __restrict__ dx, int* err) {
  if (!group_block_ok(a, hd, err)) return;
  const int64_t c = blockIdx.x, g = (a.c0 + c) / a.cpg;
  const float gm = gamma ? to_f(gamma[c]) : 1.0f;
  BnWalk w = BnWalk::start(p, a.c_local, c, blockIdx.y, threadIdx.x);
  while (w.left > 0) {
    Pack<T, V> u[kBnLoads], v[kBnLoads];
    int64_t at[kBnLoads], slot[kBnLoads];
    bool on[kBnLoads];
#pragma unroll
    for (int k = 0; k < kBnLoads; ++k) {
      on[k] = w.left > 0;
      if (on[k]) {
        at[k] = w.at;
        slot[k] = w.plane * a.groups + g;
        u[k] = load_pack<T, V>(dy, w.at);
        v[k] = load_pack<T, V>(x, w.at);
        w.next(p);
      }
    }
#pragma unroll
    for (int k = 0; k < kBnLoads; ++k) {
      if (!on[k]) continue;
      const float4 m = consts[2 * slot[k]], n = consts[2 * slot[k] + 1];
      const float rs = m.z, c1 = m.w, c2 = n.x;
      Pack<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xhat = ((to_f(v[k].v[j]) - m.x) - m.y) * rs;
        o.v[j] = from_f<T>(rs * ((gm * to_f(u[k].v[j]) - c1) - xhat * c2));
      }
      store_pack<T, V>(dx, at[k], o);
    }
  }
}

template <class T>
__global__ void param_grads(GroupArgs a, Header hd, const double* dparams, T* dgamma, T* dbeta,
                            int* err) {
  if (!group_call_ok(a, hd)) return mark_failed(err);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.c_local) return;
  if (dgamma) dgamma[c] = from_f<T>(static_cast<float>(dparams[c]));
  if (dbeta) dbeta[c] = from_f<T>(static_cast<float>(dparams[a.c_local + c]));
}

// ---- launchers ----------------------------------------------------------------------------

size_t up(size_t b) { return (b + 255) / 256 * 256; }
size_t nonneg(int64_t v) { return static_cast<size_t>(std::max<int64_t>(v, 0)); }

// Scratch: plane sums [planes][2] (8-byte slots) | plane mean | plane rstd (8-byte slots) |
// dparams double [2 c_local] | slot constants float4 [n groups][2] (the forward uses one).
struct Scratch {
  void* rows;
  void* pm;
  void* pr;
  double* dparams;
  float4* consts;
};
Scratch carve(const GroupArgs& a, void* s) {
  const size_t planes = nonneg(a.n * a.c_local);
  char* p = static_cast<char*>(s);
  Scratch sc;
  sc.rows = p;
  p += up(planes * 2 * 8);
  sc.pm = p;
  p += up(planes * 8);
  sc.pr = p;
  p += up(planes * 8);
  sc.dparams = reinterpret_cast<double*>(p);
  p += up(nonneg(2 * a.c_local) * 8);
  sc.consts = reinterpret_cast<float4*>(p);
  return sc;
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
dim3 grid_of(const BnPlan& p) {  // the planes walk: (local channel, split)
  return dim3(static_cast<unsigned>(p.blocks_x), static_cast<unsigned>(p.splits));
}
dim3 blocks_for(int64_t n, int64_t cap = INT32_MAX) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min((n + 255) / 256, cap))));
}
RowArgs plane_rows(const GroupArgs& a) {
  return {a.n * a.c_local, a.spatial, true, a.s64, a.stream};
}

template <class D, class W>
void fold_into(const GroupArgs& a, const void* rows, const D* gamma, void* payload) {
  if (a.n * a.groups <= 0) return;
  launch("group fold", fold<W, D>, blocks_for(a.n * a.groups), dim3(256), st(a.stream), a,
         static_cast<const W*>(rows), gamma, static_cast<W*>(payload));
}

}  // namespace

size_t group_scratch_bytes(const GroupArgs& a) {
  const size_t planes = nonneg(a.n * a.c_local);
  return up(planes * 2 * 8) + 2 * up(planes * 8) + up(nonneg(2 * a.c_local) * 8) +
         up(nonneg(2 * a.n * a.groups) * sizeof(float4));
}

template <class T>
void group_partial_forward(const GroupArgs& a, const T* x, bool robust, bool w64, void* payload,
                           void* scratch) {
  using D = typename Dev<T>::type;
  const Scratch s = carve(a, scratch);
  row_partial_forward<T>(plane_rows(a), x, robust, w64, s.rows);
  const D* none = nullptr;
  if (w64)
    fold_into<D, double>(a, s.rows, none, payload);
  else
    fold_into<D, float>(a, s.rows, none, payload);
}

template <class T>
void group_apply_forward(const GroupArgs& a, const Header& hd, double count, double eps, const T* x,
                         const T* gamma, const T* beta, T* y, void* mean, void* rstd, void* scratch,
                         int* err) {
  using D = typename Dev<T>::type;
  const Scratch s = carve(a, scratch);
  if (a.n * a.groups > 0)
    launch("group slot_stats", slot_stats, blocks_for(a.n * a.groups), dim3(256), st(a.stream), a,
           hd, count, eps, s.consts, mean, rstd, err);
  const D *xd = reinterpret_cast<const D*>(x), *gd = reinterpret_cast<const D*>(gamma);
  const D* bd = reinterpret_cast<const D*>(beta);
  const BnPlan p = plan_channels(a.n, a.c_local, a.spatial, sizeof(D), {x, y}, true);
  if (p.splits > 0)
    with_vec<D>(p.vec, [&](auto v) {
      launch("group apply_fwd", apply_fwd<D, decltype(v)::value>, grid_of(p), dim3(kBnThreads),
             st(a.stream), p, a, hd, xd, gd, bd, static_cast<const float4*>(s.consts),
             reinterpret_cast<D*>(y), err);
    });
}

template <class T>
void group_partial_backward(const GroupArgs& a, const T* dy, const T* x, const T* gamma,
                            const void* mean, const void* rstd, bool w64, void* payload,
                            void* scratch) {
  using D = typename Dev<T>::type;
  const Scratch s = carve(a, scratch);
  const int64_t planes = a.n * a.c_local;
  if (planes > 0)
    launch("group expand", expand, blocks_for(planes), dim3(256), st(a.stream), a, mean, rstd, s.pm,
           s.pr);
  const T* none = nullptr;
  row_partial_backward<T>(plane_rows(a), dy, x, none, s.pm, s.pr, w64, s.rows);
  const D* g = reinterpret_cast<const D*>(gamma);
  if (w64)
    fold_into<D, double>(a, s.rows, g, payload);
  else
    fold_into<D, float>(a, s.rows, g, payload);
  if (a.c_local > 0) {
    if (w64)
      launch("group channel_sums", channel_sums<double>, blocks_for(a.c_local), dim3(256),
             st(a.stream), a, static_cast<const double*>(s.rows), s.dparams);
    else
      launch("group channel_sums", channel_sums<float>, blocks_for(a.c_local), dim3(256),
             st(a.stream), a, static_cast<const float*>(s.rows), s.dparams);
  }
}

template <class T>
void group_apply_backward(const GroupArgs& a, const Header& hd, double count, const T* dy,
                          const T* x, const T* gamma, const void* mean, const void* rstd, T* dx,
                          T* dgamma, T* dbeta, void* scratch, int* err) {
  using D = typename Dev<T>::type;
  const Scratch s = carve(a, scratch);
  if (a.n * a.groups > 0)
    launch("group bwd_consts", bwd_consts, blocks_for(a.n * a.groups), dim3(256), st(a.stream), a,
           hd, count, mean, rstd, s.consts, err);
  const BnPlan p = plan_channels(a.n, a.c_local, a.spatial, sizeof(D), {dy, x, dx}, true);
  if (p.splits > 0)
    with_vec<D>(p.vec, [&](auto v) {
      launch("group apply_bwd", apply_bwd<D, decltype(v)::value>, grid_of(p), dim3(kBnThreads),
             st(a.stream), p, a, hd, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
             reinterpret_cast<const D*>(gamma), static_cast<const float4*>(s.consts),
             reinterpret_cast<D*>(dx), err);
    });
  if ((dgamma || dbeta) && a.c_local > 0)
    launch("group param_grads", param_grads<D>, blocks_for(a.c_local), dim3(256), st(a.stream), a,
           hd, static_cast<const double*>(s.dparams), reinterpret_cast<D*>(dgamma),
           reinterpret_cast<D*>(dbeta), err);
}

#define TPNORM_CUDA_GROUP_INSTANTIATE(T)                                                          \
  template void group_partial_forward<T>(const GroupArgs&, const T*, bool, bool, void*, void*);   \
  template void group_apply_forward<T>(const GroupArgs&, const Header&, double, double, const T*, \
                                       const T*, const T*, T*, void*, void*, void*, int*);        \
  template void group_partial_backward<T>(const GroupArgs&, const T*, const T*, const T*,         \
                                          const void*, const void*, bool, void*, void*);          \
  template void group_apply_backward<T>(const GroupArgs&, const Header&, double, const T*,        \
                                        const T*, const T*, const void*, const void*, T*, T*, T*, \
                                        void*, int*);
TPNORM_CUDA_GROUP_INSTANTIATE(float)
TPNORM_CUDA_GROUP_INSTANTIATE(f16)
TPNORM_CUDA_GROUP_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
