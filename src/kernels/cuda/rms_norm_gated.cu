// rms_norm_gated.cu — CUDA kernels of the gated RMSNorm; see rms_norm_gated.h.
//
// Slots are walked with a grid-stride loop over blocks (rows * groups may exceed a grid's y
// limit); every thread of a block runs the same iterations, so the block sums and barriers
// inside stay uniform. Element formulas are the CPU's in float32 (silu with expf); products
// are rounded like the CPU's (no fused multiply-add). All indices are 64-bit.
#include <algorithm>

#include "common/cuda_check.h"
#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/rms_norm_gated.h"

namespace tpnorm::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct Gate {
  float silu, dsilu;
};
__device__ __forceinline__ Gate gate(float z) {
  const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z)));
  return {__fmul_rn(z, s), __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(z, __fsub_rn(1.0f, s))))};
}

// The local columns [lo, hi) of group g (empty when the group holds none of this rank's).
__device__ __forceinline__ void run_of(const GatedArgs& a, int64_t g, int64_t& lo, int64_t& hi) {
  lo = max(int64_t{0}, g * a.group_size - a.c0);
  hi = min(a.c_local, (g + 1) * a.group_size - a.c0);
}

template <class D>
__device__ __forceinline__ float input(const GatedArgs& a, const D* x, const D* z, int64_t i) {
  const float xv = to_f(x[i]);
  return z && !a.norm_before_gate ? __fmul_rn(xv, gate(to_f(z[i])).silu) : xv;
}

// The backward's terms of element i: g (the gradient reaching uhat) and uhat.
template <class D>
__device__ __forceinline__ void terms(const GatedArgs& a, const D* dy, const D* x, const D* z,
                                      const D* w, float rs, int64_t i, int64_t c, float& g,
                                      float& uhat) {
  const float wc = w ? to_f(w[c]) : 1.0f, d = to_f(dy[i]);
  uhat = __fmul_rn(input(a, x, z, i), rs);
  g = __fmul_rn(d, wc);
  if (z && a.norm_before_gate) g = __fmul_rn(g, gate(to_f(z[i])).silu);
}

// The summed header is fine and the ranks' channels add up to all channels.
__device__ __forceinline__ bool gated_call_ok(const GatedArgs& a, const Header& hd, int* err) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    double n;
    ok = header_ok(hd, &n) && n == static_cast<double>(a.hidden) ? 1 : 0;
    if (!ok) atomicExch(err, 1);
  }
  __syncthreads();
  return ok != 0;
}

// The partials visit the slots (row, group) of the groups this rank holds only; the other slots
// are zeroed before them (zero_slots).
template <class D, class W>
__global__ void partial_fwd(GatedArgs a, GatedHeld h, const D* x, const D* z, W* payload) {
  for (int64_t k = blockIdx.x; k < a.rows * h.count; k += gridDim.x) {
    const int64_t r = k / h.count, g = h.first + k % h.count;
    int64_t lo, hi;
    run_of(a, g, lo, hi);
    W v[1] = {0};
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      const W u = static_cast<W>(input(a, x, z, r * a.c_local + j));
      v[0] += u * u;
    }
    group_sum<1>(v, blockDim.x);
    if (threadIdx.x == 0) payload[r * a.groups + g] = v[0];
  }
}

template <class D>
__global__ void apply_fwd(GatedArgs a, Header hd, double eps, const D* x, const D* z, const D* w,
                          D* y, void* rstd, int* err) {
  if (!gated_call_ok(a, hd, err)) return;
  const void* pay = payload_of(hd);
  for (int64_t k = blockIdx.x; k < a.rows * a.groups; k += gridDim.x) {
    const int64_t r = k / a.groups;
    const double rs = 1.0 / sqrt(load_fd(pay, k, hd.w64) / static_cast<double>(a.group_size) + eps);
    if (rstd && threadIdx.x == 0) store_fd(rstd, k, a.s64, rs);
    const float rf = static_cast<float>(rs);
    int64_t lo, hi;
    run_of(a, k % a.groups, lo, hi);
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      const int64_t i = r * a.c_local + j;
      float v = __fmul_rn(__fmul_rn(input(a, x, z, i), rf), w ? to_f(w[j]) : 1.0f);
      if (z && a.norm_before_gate) v = __fmul_rn(v, gate(to_f(z[i])).silu);
      y[i] = from_f<D>(v);
    }
  }
}

template <class D, class W>
__global__ void partial_bwd(GatedArgs a, GatedHeld h, const D* dy, const D* x, const D* z,
                            const D* w, const void* rstd, W* payload) {
  for (int64_t k = blockIdx.x; k < a.rows * h.count; k += gridDim.x) {
    const int64_t r = k / h.count, slot = r * a.groups + h.first + k % h.count;
    const float rs = static_cast<float>(load_fd(rstd, slot, a.s64));
    int64_t lo, hi;
    run_of(a, h.first + k % h.count, lo, hi);
    W v[1] = {0};
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      float g, uhat;
      terms(a, dy, x, z, w, rs, r * a.c_local + j, j, g, uhat);
      v[0] += static_cast<W>(__fmul_rn(g, uhat));
    }
    group_sum<1>(v, blockDim.x);
    if (threadIdx.x == 0) payload[slot] = v[0];
  }
}

// dw[c] = sum over rows of dy * uhat (* silu(z) norm first), in 2-D tiles: block (x, y) sums
// channels [x * blockDim.x, ...) over row tile y (rows in order) into part[y * c_local + c];
// dweight_total then adds each channel's tiles in tile order. The same bits every time.
template <class D>
__global__ void dweight_tiles(GatedArgs a, const D* dy, const D* x, const D* z, const void* rstd,
                              int64_t tile_rows, double* part) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.c_local) return;
  const int64_t g = (a.c0 + c) / a.group_size;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * tile_rows;
  const int64_t r1 = min(a.rows, r0 + tile_rows);
  double s = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * a.c_local + c;
    const float rs = static_cast<float>(load_fd(rstd, r * a.groups + g, a.s64));
    float t = __fmul_rn(to_f(dy[i]), __fmul_rn(input(a, x, z, i), rs));
    if (z && a.norm_before_gate) t = __fmul_rn(t, gate(to_f(z[i])).silu);
    s += static_cast<double>(t);
  }
  part[static_cast<int64_t>(blockIdx.y) * a.c_local + c] = s;
}

__global__ void dweight_total(GatedArgs a, int64_t tiles, const double* part, double* dw) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.c_local) return;
  double s = 0;
  for (int64_t t = 0; t < tiles; ++t) s += part[t * a.c_local + c];
  dw[c] = s;
}

template <class D>
__global__ void apply_bwd(GatedArgs a, Header hd, const D* dy, const D* x, const D* z, const D* w,
                          const void* rstd, D* dx, D* dz, int* err) {
  if (!gated_call_ok(a, hd, err)) return;
  const void* pay = payload_of(hd);
  for (int64_t k = blockIdx.x; k < a.rows * a.groups; k += gridDim.x) {
    const int64_t r = k / a.groups;
    const float rs = static_cast<float>(load_fd(rstd, k, a.s64));
    const float m = static_cast<float>(load_fd(pay, k, hd.w64) / static_cast<double>(a.group_size));
    int64_t lo, hi;
    run_of(a, k % a.groups, lo, hi);
    for (int64_t j = lo + threadIdx.x; j < hi; j += blockDim.x) {
      const int64_t i = r * a.c_local + j;
      float g, uhat;
      terms(a, dy, x, z, w, rs, i, j, g, uhat);
      const float d = __fmul_rn(rs, __fsub_rn(g, __fmul_rn(uhat, m)));
      if (!z) {
        dx[i] = from_f<D>(d);
      } else {
        const Gate gt = gate(to_f(z[i]));
        if (a.norm_before_gate) {
          dx[i] = from_f<D>(d);
          const float wc = w ? to_f(w[j]) : 1.0f;
          dz[i] = from_f<D>(__fmul_rn(__fmul_rn(__fmul_rn(to_f(dy[i]), wc), uhat), gt.dsilu));
        } else {
          dx[i] = from_f<D>(__fmul_rn(d, gt.silu));
          dz[i] = from_f<D>(__fmul_rn(__fmul_rn(d, to_f(x[i])), gt.dsilu));
        }
      }
    }
  }
}

template <class D>
__global__ void write_dweight(GatedArgs a, Header hd, const double* dw, D* dweight, int* err) {
  if (!gated_call_ok(a, hd, err)) return;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < a.c_local) dweight[c] = from_f<D>(static_cast<float>(dw[c]));
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
dim3 slot_blocks(const GatedArgs& a) {
  return dim3(
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows * a.groups, 1 << 20))));
}
dim3 held_blocks(const GatedArgs& a, const GatedHeld& h) {
  return dim3(
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(a.rows * h.count, 1 << 20))));
}
// The payload's slots start at zero when the rank holds fewer than all groups: the partials
// write only the held ones (the device payload is not zeroed for them, ops/packed_call.h).
void zero_slots(const GatedArgs& a, const GatedHeld& h, bool w64, void* payload) {
  if (h.count == a.groups) return;
  const size_t bytes = static_cast<size_t>(a.rows * a.groups) * (w64 ? 8 : 4);
  TPNORM_CHECK(CUDA, cudaMemsetAsync(payload, 0, bytes, st(a.stream)));
}
dim3 channel_blocks(const GatedArgs& a) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, (a.c_local + kThreads - 1) / kThreads)));
}

}  // namespace

// dw [c_local], then the dweight tiles' partials [tiles, c_local].
size_t gated_scratch_bytes(const GatedArgs& a) {
  const auto c = static_cast<size_t>(std::max<int64_t>(a.c_local, 0));
  return c * static_cast<size_t>(1 + gated_dw_row_tiles(a.rows)) * sizeof(double);
}

template <class T>
void gated_partial_forward(const GatedArgs& a, const T* x, const T* z, bool w64, void* payload) {
  using D = typename Dev<T>::type;
  if (a.rows * a.groups <= 0) return;
  const GatedHeld h = gated_held(a.c0, a.c_local, a.group_size, a.groups);
  zero_slots(a, h, w64, payload);
  if (h.count == 0) return;
  const D *xd = reinterpret_cast<const D*>(x), *zd = reinterpret_cast<const D*>(z);
  if (w64)
    launch("gated partial_fwd", partial_fwd<D, double>, held_blocks(a, h), dim3(kThreads),
           st(a.stream), a, h, xd, zd, static_cast<double*>(payload));
  else
    launch("gated partial_fwd", partial_fwd<D, float>, held_blocks(a, h), dim3(kThreads),
           st(a.stream), a, h, xd, zd, static_cast<float*>(payload));
}

template <class T>
void gated_apply_forward(const GatedArgs& a, const Header& hd, double eps, const T* x, const T* z,
                         const T* w, T* y, void* rstd, int* err) {
  using D = typename Dev<T>::type;
  launch("gated apply_fwd", apply_fwd<D>, slot_blocks(a), dim3(kThreads), st(a.stream), a, hd, eps,
         reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(z),
         reinterpret_cast<const D*>(w), reinterpret_cast<D*>(y), rstd, err);
}

template <class T>
void gated_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const T* w,
                            const void* rstd, bool w64, void* payload, bool dweight,
                            void* scratch) {
  using D = typename Dev<T>::type;
  const D *dyd = reinterpret_cast<const D*>(dy), *xd = reinterpret_cast<const D*>(x);
  const D *zd = reinterpret_cast<const D*>(z), *wd = reinterpret_cast<const D*>(w);
  const GatedHeld h = gated_held(a.c0, a.c_local, a.group_size, a.groups);
  if (a.rows * a.groups > 0) zero_slots(a, h, w64, payload);
  if (a.rows * h.count > 0) {
    if (w64)
      launch("gated partial_bwd", partial_bwd<D, double>, held_blocks(a, h), dim3(kThreads),
             st(a.stream), a, h, dyd, xd, zd, wd, rstd, static_cast<double*>(payload));
    else
      launch("gated partial_bwd", partial_bwd<D, float>, held_blocks(a, h), dim3(kThreads),
             st(a.stream), a, h, dyd, xd, zd, wd, rstd, static_cast<float*>(payload));
  }
  if (dweight && a.c_local > 0) {
    const int64_t tiles = gated_dw_row_tiles(a.rows);
    const int64_t tile_rows = (a.rows + tiles - 1) / tiles;
    double* dw = static_cast<double*>(scratch);
    double* part = dw + a.c_local;
    launch("gated dweight_tiles", dweight_tiles<D>,
           dim3(channel_blocks(a).x, static_cast<unsigned>(tiles)), dim3(kThreads), st(a.stream),
           a, dyd, xd, zd, rstd, tile_rows, part);
    launch("gated dweight_total", dweight_total, channel_blocks(a), dim3(kThreads), st(a.stream),
           a, tiles, static_cast<const double*>(part), dw);
  }
}

template <class T>
void gated_apply_backward(const GatedArgs& a, const Header& hd, const T* dy, const T* x, const T* z,
                          const T* w, const void* rstd, T* dx, T* dz, T* dweight,
                          const void* scratch, int* err) {
  using D = typename Dev<T>::type;
  launch("gated apply_bwd", apply_bwd<D>, slot_blocks(a), dim3(kThreads), st(a.stream), a, hd,
         reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
         reinterpret_cast<const D*>(z), reinterpret_cast<const D*>(w), rstd,
         reinterpret_cast<D*>(dx), reinterpret_cast<D*>(dz), err);
  if (dweight)
    launch("gated write_dweight", write_dweight<D>, channel_blocks(a), dim3(kThreads), st(a.stream),
           a, hd, static_cast<const double*>(scratch), reinterpret_cast<D*>(dweight), err);
}

#define TPNORM_GATED_CUDA(T)                                                                      \
  template void gated_partial_forward<T>(const GatedArgs&, const T*, const T*, bool, void*);      \
  template void gated_apply_forward<T>(const GatedArgs&, const Header&, double, const T*,         \
                                       const T*, const T*, T*, void*, int*);                      \
  template void gated_partial_backward<T>(const GatedArgs&, const T*, const T*, const T*,         \
                                          const T*, const void*, bool, void*, bool, void*);       \
  template void gated_apply_backward<T>(const GatedArgs&, const Header&, const T*, const T*,      \
                                        const T*, const T*, const void*, T*, T*, T*, const void*, \
                                        int*);
TPNORM_GATED_CUDA(float)
TPNORM_GATED_CUDA(f16)
TPNORM_GATED_CUDA(bf16)

}  // namespace tpnorm::kernels::cuda
