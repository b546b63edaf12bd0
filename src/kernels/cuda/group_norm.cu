// group_norm.cu — CUDA kernels of GroupNorm / InstanceNorm; see group_norm.h.
//
// Kernels: the row kernels' partials over the planes (row_norm.cu), fold (a thread per
// (sample, group) slot adds its planes in channel order, as the CPU's serial loop does),
// channel_sums (a thread per local channel adds its planes in sample order: dgamma / dbeta),
// expand (each plane's group mean / rstd, which the row backward partial takes per row),
// slot_stats (a thread per slot: mean, rstd, the saved statistics), then the element-wise
// apply kernels and param_grads. Products and sums of the folds are rounded like the CPU's
// (no fused multiply-add). All indices are 64-bit.
#include <algorithm>

#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/group_norm.h"
#include "kernels/cuda/launch.cuh"

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

// consts[2k] = mean, consts[2k+1] = rstd of slot k (double); saved statistics.
__global__ void slot_stats(GroupArgs a, Header hd, double count, double eps, double* consts,
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
  consts[2 * k] = mu;
  consts[2 * k + 1] = rs;
  if (mean) store_fd(mean, k, a.s64, mu);
  if (rstd) store_fd(rstd, k, a.s64, rs);
}

template <class T>
__global__ void __launch_bounds__(256)
    apply_fwd(GroupArgs a, Header hd, const T* __restrict__ x, const T* __restrict__ gamma,
              const T* __restrict__ beta, const double* consts, T* __restrict__ y, int* err) {
  if (!group_call_ok(a, hd)) return mark_failed(err);
  const int64_t total = a.n * a.c_local * a.spatial;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.spatial, k = slot_of(a, r), c = r % a.c_local;
    float mh, mt;
    split_mean(consts[2 * k], mh, mt);
    const float s = static_cast<float>(consts[2 * k + 1]) * (gamma ? to_f(gamma[c]) : 1.0f);
    const float b = beta ? to_f(beta[c]) : 0.0f;
    y[i] = from_f<T>(fmaf((to_f(x[i]) - mh) - mt, s, b));
  }
}

template <class T>
__global__ void __launch_bounds__(256)
    apply_bwd(GroupArgs a, Header hd, double count, const T* __restrict__ dy,
              const T* __restrict__ x, const T* __restrict__ gamma, const void* mean,
              const void* rstd, T* __restrict__ dx, int* err) {
  if (!group_call_ok(a, hd)) return mark_failed(err);
  const void* pay = payload_of(hd);
  const int64_t total = a.n * a.c_local * a.spatial;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.spatial, k = slot_of(a, r), c = r % a.c_local;
    float mh, mt;
    split_mean(load_fd(mean, k, a.s64), mh, mt);
    const float rs = static_cast<float>(load_fd(rstd, k, a.s64));
    const float c1 = static_cast<float>(load_fd(pay, 2 * k, hd.w64) / count);
    const float c2 = static_cast<float>(load_fd(pay, 2 * k + 1, hd.w64) / count);
    const float gm = gamma ? to_f(gamma[c]) : 1.0f;
    const float xhat = ((to_f(x[i]) - mh) - mt) * rs;
    dx[i] = from_f<T>(rs * ((gm * to_f(dy[i]) - c1) - xhat * c2));
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
// dparams double [2 c_local] | slot constants double [2 n groups].
struct Scratch {
  void* rows;
  void* pm;
  void* pr;
  double* dparams;
  double* consts;
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
  sc.consts = reinterpret_cast<double*>(p);
  return sc;
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
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
         up(nonneg(2 * a.n * a.groups) * 8);
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
  const int64_t total = a.n * a.c_local * a.spatial;
  if (total > 0)
    launch("group apply_fwd", apply_fwd<D>, blocks_for(total, 8192), dim3(256), st(a.stream), a, hd,
           reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma),
           reinterpret_cast<const D*>(beta), static_cast<const double*>(s.consts),
           reinterpret_cast<D*>(y), err);
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
  const int64_t total = a.n * a.c_local * a.spatial;
  if (total > 0)
    launch("group apply_bwd", apply_bwd<D>, blocks_for(total, 8192), dim3(256), st(a.stream), a, hd,
           count, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
           reinterpret_cast<const D*>(gamma), mean, rstd, reinterpret_cast<D*>(dx), err);
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
