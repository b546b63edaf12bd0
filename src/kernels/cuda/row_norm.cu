// row_norm.cu — CUDA kernels for LayerNorm / RMSNorm rows; see row_norm.h.
//
// Kernels: partial_fwd / apply_fwd / partial_bwd / apply_bwd walk rows grid-stride, a warp or
// a block per row (`tpr` threads), chunk by chunk of np vector packs per thread (plan.h);
// partial_bwd also keeps per-column sums of dy * xhat and dy across the rows of its block and
// writes them to scratch, dgamma_final adds those block slices in block order. Template
// parameters are the storage type, the pack width V (1 to 16 bytes) and the elements per
// thread per chunk E (np = E / V loads); everything else is a run-time argument.
#include <algorithm>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "common/half.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/row_norm.h"

namespace tpnorm::kernels::cuda {
namespace {

struct Geo {
  int64_t rows = 0, h = 0;
  int packs = 0;  // h / V (h <= kRowMaxWidth: in-row offsets are 32-bit)
  int tpr = 32;   // threads per row: 32 (a warp) or blockDim.x (the block)
};

// The rows of this thread's row group: first, first + stride, ... (grid-stride), and the
// thread's place among the row's tpr threads. With a block per row every thread of a block
// has the same rows, so loops over them are uniform and may hold block barriers.
struct Rows {
  int64_t first, stride;
  int lane;
};
__device__ __forceinline__ Rows rows_of(const Geo& g) {
  const int per_block = blockDim.x / g.tpr;
  return {static_cast<int64_t>(blockIdx.x) * per_block + threadIdx.x / g.tpr,
          static_cast<int64_t>(gridDim.x) * per_block, static_cast<int>(threadIdx.x % g.tpr)};
}

// The NP packs a thread owns in one chunk of a row: pack c0 + k * tpr for k < NP (c0 = the
// chunk's first pack + lane), each loaded only when it exists (< packs). All NP loads are
// issued before any is used: the caller does its math after load_slice returns.
template <class T, int V, int NP>
__device__ __forceinline__ void load_slice(Pack<T, V> (&s)[NP], const T* p, int c0, const Geo& g) {
#pragma unroll
  for (int k = 0; k < NP; ++k)
    if (c0 + k * g.tpr < g.packs) s[k] = load_pack<T, V>(p, c0 + k * g.tpr);
}
__device__ __forceinline__ bool has_pack(int c0, int k, const Geo& g) {
  return c0 + k * g.tpr < g.packs;
}

// ---- kernels ----------------------------------------------------------------------------

template <class T, int V, int E>
__global__ void __launch_bounds__(kRowThreads)
    partial_fwd(Geo g, const T* __restrict__ x, bool pivoted, bool centered, bool w64, void* out,
                HeaderWrite hw) {
  constexpr int NP = E / V;
  write_header_values(hw);
  const Rows rw = rows_of(g);
  for (int64_t r = rw.first; r < g.rows; r += rw.stride) {
    const T* xr = x + r * g.h;
    // Around the robust pivot of the row, so 1e4 + N(0,1) keeps its variance (as on CPU).
    const float pivot = pivoted ? detail::robust_pivot(xr, g.h) : 0.0f;
    // Each chunk's few values in float, flushed into double per chunk (as the CPU flushes per
    // block): a thread's share of a wide row is thousands of values, which one float sum would
    // round too coarsely for the statistics' 1e-6 (tests/gpu/host_test_gpu_accumulation.cpp).
    double v[2] = {0.0, 0.0};
    for (int c0 = rw.lane; c0 < g.packs; c0 += g.tpr * NP) {
      Pack<T, V> xp[NP];
      load_slice(xp, xr, c0, g);
      float cv[2] = {0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        if (!has_pack(c0, k, g)) continue;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float d = to_f(xp[k].v[e]) - pivot;
          cv[0] += d;
          cv[1] += d * d;
        }
      }
      v[0] += cv[0];
      v[1] += cv[1];
    }
    group_sum<2>(v, g.tpr);
    if (rw.lane != 0) continue;
    const double p = pivot, n = static_cast<double>(g.h);
    const double s1 = p * n + v[0], s2 = v[1] + 2.0 * p * v[0] + p * p * n;
    if (centered) {
      store_fd(out, 2 * r, w64, s1);
      store_fd(out, 2 * r + 1, w64, s2);
    } else {
      store_fd(out, r, w64, s2);
    }
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

// gamma / beta of one chunk: loaded once before the row loop when a row is one chunk (the
// common case), else per chunk (then from L1/L2: the same columns for every row).
template <class T, int V, int NP>
struct Params {
  Pack<T, V> g[NP], b[NP];
  __device__ __forceinline__ void load(const T* gamma, const T* beta, int c0, const Geo& geo) {
    if (gamma) load_slice(g, gamma, c0, geo);
    if (beta) load_slice(b, beta, c0, geo);
  }
};

// A row's first chunk starts at pack `lane`: the chunk loops run while c0 < packs.
__device__ __forceinline__ bool one_chunk(const Geo& g, int np) { return g.packs <= g.tpr * np; }

template <class T, int V, int E>
__global__ void __launch_bounds__(kRowThreads)
    apply_fwd(Geo g, const T* __restrict__ x, const T* __restrict__ gamma,
              const T* __restrict__ beta, Header hd, double eps, bool centered, bool s64,
              T* __restrict__ y, void* mean, void* rstd, int* err) {
  constexpr int NP = E / V;
  double n;
  if (!header_ok(hd, &n)) return mark_failed(err);
  const void* pay = payload_of(hd);
  const Rows rw = rows_of(g);
  const bool one = one_chunk(g, NP);
  Params<T, V, NP> pm;
  if (one) pm.load(gamma, beta, rw.lane, g);
  for (int64_t r = rw.first; r < g.rows; r += rw.stride) {
    double mu, var, rs_w;
    if (hd.w64) {
      row_moments<double>(pay, r, centered, n, mu, var);
      rs_w = 1.0 / sqrt(var + eps);
    } else {
      row_moments<float>(pay, r, centered, n, mu, var);
      rs_w = 1.0f / sqrtf(static_cast<float>(var) + static_cast<float>(eps));
    }
    if (rw.lane == 0) {
      if (mean) store_fd(mean, r, s64, mu);
      if (rstd) store_fd(rstd, r, s64, rs_w);
    }
    // The mean in the wire type's precision, split into float head + tail (as on CPU).
    float mh, mt;
    split_mean(mu, mh, mt);
    const float rs = static_cast<float>(rs_w);
    const T* xr = x + r * g.h;
    T* yr = y + r * g.h;
    for (int c0 = rw.lane; c0 < g.packs; c0 += g.tpr * NP) {
      if (!one) pm.load(gamma, beta, c0, g);
      Pack<T, V> xp[NP];
      load_slice(xp, xr, c0, g);
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        if (!has_pack(c0, k, g)) continue;
        Pack<T, V> yp;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xhat = ((to_f(xp[k].v[e]) - mh) - mt) * rs;
          const float gv = gamma ? to_f(pm.g[k].v[e]) : 1.0f;
          const float bv = beta ? to_f(pm.b[k].v[e]) : 0.0f;
          yp.v[e] = from_f<T>(xhat * gv + bv);
        }
        store_pack<T, V>(yr, c0 + k * g.tpr, yp);
      }
    }
  }
}

// The block's column sums of one chunk into part[(2 b) h + j] (dy * xhat) and
// part[(2 b + 1) h + j] (dy), b = blockIdx.x. With a block per row each thread owns its
// columns and stores them; with a warp per row the block's warps hold sums of the same
// columns (different rows) and add them in warp order through shared memory. Every thread of
// the block calls this (block barriers inside, outside any divergent code).
template <int V, int NP>
__device__ __forceinline__ void store_column_sums(const float (&ag)[NP][V],
                                                  const float (&ab)[NP][V], int c, const Geo& g,
                                                  float* part, bool acc) {
  float* pg = part + static_cast<int64_t>(2 * blockIdx.x) * g.h;
  float* pb = pg + g.h;
  const int lane = threadIdx.x % g.tpr;
  if (g.tpr == static_cast<int>(blockDim.x)) {  // block per row
#pragma unroll
    for (int k = 0; k < NP; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int64_t j = int64_t{c + lane + k * g.tpr} * V + e;
        if (j < g.h) {
          pg[j] = acc ? pg[j] + ag[k][e] : ag[k][e];
          pb[j] = acc ? pb[j] + ab[k][e] : ab[k][e];
        }
      }
    return;
  }
  // Warp per row: a chunk is 32 * NP * V = E * 32 <= 1024 columns.
  __shared__ float sg[32 * kRowPerThread], sb[32 * kRowPerThread];
  const int w = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int turn = 0; turn < warps; ++turn) {
    __syncthreads();  // the previous turn's (or chunk's) accesses are done
    if (w == turn) {
#pragma unroll
      for (int k = 0; k < NP; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int t = (lane + k * 32) * V + e;
          sg[t] = (turn == 0 ? 0.0f : sg[t]) + ag[k][e];
          sb[t] = (turn == 0 ? 0.0f : sb[t]) + ab[k][e];
        }
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < 32 * NP * V; t += blockDim.x) {
    const int64_t j = int64_t{c} * V + t;
    if (j < g.h) {
      pg[j] = acc ? pg[j] + sg[t] : sg[t];
      pb[j] = acc ? pb[j] + sb[t] : sb[t];
    }
  }
}

// Row sums {Sg, Sgx} (RMS: {Sgx}) of dy * gamma and dy * gamma * xhat into the payload and,
// when `part` is set, the block's column sums of dy * xhat and dy (see store_column_sums).
// Chunks are the outer loop, so one chunk's column sums stay in registers while the block
// walks its rows; a row of several chunks adds its chunks' sums into the payload in chunk
// order (lane 0 of the row's group writes chunk 0 and adds the rest: the same thread).
// Every thread runs every chunk iteration (at least one, even when h = 0: the payload is
// written), and with a warp per row the column sums' barriers come after the row loop.
template <class T, int V, int E>
__global__ void __launch_bounds__(kRowThreads)
    partial_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x,
                const T* __restrict__ gamma, const void* mean, const void* rstd, bool s64,
                bool centered, bool w64, void* out, float* __restrict__ part, bool acc,
                HeaderWrite hw) {
  constexpr int NP = E / V;
  write_header_values(hw);
  const Rows rw = rows_of(g);
  for (int c = 0; c == 0 || c < g.packs; c += g.tpr * NP) {
    const int c0 = c + rw.lane;
    Pack<T, V> gp[NP];
    if (gamma) load_slice(gp, gamma, c0, g);
    float ag[NP][V], ab[NP][V];
#pragma unroll
    for (int k = 0; k < NP; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) ag[k][e] = ab[k][e] = 0.0f;
    for (int64_t r = rw.first; r < g.rows; r += rw.stride) {
      float mh = 0.0f, mt = 0.0f;
      if (centered) split_mean(load_fd(mean, r, s64), mh, mt);
      const float rs = static_cast<float>(load_fd(rstd, r, s64));
      Pack<T, V> xp[NP], dp[NP];
      load_slice(xp, x + r * g.h, c0, g);
      load_slice(dp, dy + r * g.h, c0, g);
      float v[2] = {0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        if (!has_pack(c0, k, g)) continue;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xhat = ((to_f(xp[k].v[e]) - mh) - mt) * rs;
          const float d = to_f(dp[k].v[e]);
          const float gv = d * (gamma ? to_f(gp[k].v[e]) : 1.0f);
          v[0] += gv;
          v[1] += gv * xhat;
          ag[k][e] += d * xhat;
          ab[k][e] += d;
        }
      }
      group_sum<2>(v, g.tpr);
      if (rw.lane != 0) continue;
      const int64_t i0 = centered ? 2 * r : r;
      const double s0 = centered ? v[0] : v[1];
      store_fd(out, i0, w64, c == 0 ? s0 : load_fd(out, i0, w64) + s0);
      if (centered) store_fd(out, i0 + 1, w64, c == 0 ? v[1] : load_fd(out, i0 + 1, w64) + v[1]);
    }
    if (part) store_column_sums<V, NP>(ag, ab, c, g, part, acc);
  }
}

template <class T, int V, int E>
__global__ void __launch_bounds__(kRowThreads)
    apply_bwd(Geo g, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ gamma,
              const void* mean, const void* rstd, bool s64, Header hd, bool centered,
              T* __restrict__ dx, int* err) {
  constexpr int NP = E / V;
  allow_dependent_launch();  // dgamma_final reads nothing this kernel writes
  double n;
  if (!header_ok(hd, &n)) return mark_failed(err);
  const void* pay = payload_of(hd);
  const Rows rw = rows_of(g);
  const bool one = one_chunk(g, NP);
  Params<T, V, NP> pm;
  if (one) pm.load(gamma, nullptr, rw.lane, g);
  for (int64_t r = rw.first; r < g.rows; r += rw.stride) {
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
    for (int c0 = rw.lane; c0 < g.packs; c0 += g.tpr * NP) {
      if (!one) pm.load(gamma, nullptr, c0, g);
      Pack<T, V> xp[NP], dp[NP];
      load_slice(xp, xr, c0, g);
      load_slice(dp, dyr, c0, g);
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        if (!has_pack(c0, k, g)) continue;
        Pack<T, V> out;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float xhat = ((to_f(xp[k].v[e]) - mh) - mt) * rs;
          const float gv = to_f(dp[k].v[e]) * (gamma ? to_f(pm.g[k].v[e]) : 1.0f);
          out.v[e] = from_f<T>(rs * (gv - c1 - xhat * c2));
        }
        store_pack<T, V>(dxr, c0 + k * g.tpr, out);
      }
    }
  }
}

// Column j = the blocks' column sums in block order (deterministic for a given shape).
// After apply_bwd it is a programmatic dependent launch (launch_dependent): it may run while
// apply_bwd still does, since it reads only the partial's scratch and the summed header, both
// complete before apply_bwd started; every thread waits for apply_bwd before it exits, so that
// this kernel's completion still implies dx's for whatever the stream runs next.
template <class T>
__global__ void dgamma_final(int64_t h, int64_t parts, const float* part, Header hd, T* dgamma,
                             T* dbeta, int* err) {
  double n;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!header_ok(hd, &n)) {
    mark_failed(err);
  } else if (j < h) {
    double tg = 0, tb = 0;
    for (int64_t b = 0; b < parts; ++b) {
      tg += part[(2 * b) * h + j];
      tb += part[(2 * b + 1) * h + j];
    }
    if (dgamma) dgamma[j] = from_f<T>(static_cast<float>(tg));
    if (dbeta) dbeta[j] = from_f<T>(static_cast<float>(tb));
  }
  wait_for_previous_grid();
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
  l.p = plan_rows(a.rows, a.h, sizeof(D), ptrs);
  l.g.rows = a.rows;
  l.g.h = a.h;
  l.g.packs = static_cast<int>(l.p.packs);
  l.g.tpr = l.p.tpr;
  return l;
}

// Calls body(std::integral_constant<int, V>{}, std::integral_constant<int, E>{}) with V the
// plan's vector width and E its elements per thread per chunk; widths above 16 bytes do not
// exist for D (plan_rows never picks them).
template <class D, class Body>
void with_pack(const Launch& l, Body&& body) {
  auto per = [&](auto v) {
    if (l.p.per_thread == kRowSmallPerThread)
      return body(v, std::integral_constant<int, kRowSmallPerThread>{});
    body(v, std::integral_constant<int, row_wide_per_thread(decltype(v)::value)>{});
  };
  with_vec<D>(l.p.vec, per);
}

// Blocks of `kernel` the current device keeps resident at once (occupancy x SMs), asked once
// per (kernel, device): the grid-stride row kernels need no more. 0 when the device cannot
// say (the launch then gets one block per row group, which is correct too).
template <class... P>
int64_t resident_blocks(void (*kernel)(P...), int threads) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> known;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return (void)cudaGetLastError(), 0;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  int per_sm = 0, sms = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return (void)cudaGetLastError(), 0;  // ours: the call that just failed
  const int64_t n = int64_t{per_sm} * sms;
  std::lock_guard<std::mutex> lock(mu);
  known[key] = n;
  return n;
}

// Launches a grid-stride row kernel on min(row groups, resident blocks) blocks.
template <class... P, class... Args>
void launch_rows(const char* what, void (*kernel)(P...), const Launch& l, void* stream,
                 Args&&... args) {
  const int64_t grid = row_grid(l.p, resident_blocks(kernel, l.p.threads));
  launch(what, kernel, dim3(static_cast<unsigned>(grid)), dim3(l.p.threads),
         static_cast<cudaStream_t>(stream), std::forward<Args>(args)...);
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

template <class T>
void row_partial_forward(const RowArgs& a, const T* x, bool robust, bool w64, void* payload,
                         const HeaderWrite& hw) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {x});
  if (l.p.blocks == 0) return write_header(hw, a.stream);
  with_pack<D>(l, [&](auto v, auto e) {
    launch_rows("row partial_fwd", partial_fwd<D, decltype(v)::value, decltype(e)::value>, l,
                a.stream, l.g, reinterpret_cast<const D*>(x), robust && a.centered, a.centered, w64,
                payload, hw);
  });
}

template <class T>
void row_apply_forward(const RowArgs& a, const T* x, const T* gamma, const T* beta,
                       const Header& hd, double eps, T* y, void* mean, void* rstd, int* err) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {x, gamma, beta, y});
  if (l.p.blocks == 0) return;
  with_pack<D>(l, [&](auto v, auto e) {
    launch_rows("row apply_fwd", apply_fwd<D, decltype(v)::value, decltype(e)::value>, l, a.stream,
                l.g, reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma),
                reinterpret_cast<const D*>(beta), hd, eps, a.centered, a.s64,
                reinterpret_cast<D*>(y), mean, rstd, err);
  });
}

template <class T>
void row_partial_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma,
                          const void* mean, const void* rstd, bool w64, void* payload,
                          void* scratch, const HeaderWrite& hw, bool accumulate) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {dy, x, gamma});
  if (l.p.blocks == 0) return write_header(hw, a.stream);
  float* part = static_cast<float*>(scratch);
  with_pack<D>(l, [&](auto v, auto e) {
    const auto kernel = partial_bwd<D, decltype(v)::value, decltype(e)::value>;
    if (part)  // exactly row_bwd_parts blocks: the scratch's slices, one per block
      launch("row partial_bwd", kernel, dim3(static_cast<unsigned>(row_bwd_parts(a.rows, a.h))),
             dim3(l.p.threads), st(a.stream), l.g, reinterpret_cast<const D*>(dy),
             reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma), mean, rstd, a.s64,
             a.centered, w64, payload, part, accumulate, hw);
    else
      launch_rows("row partial_bwd", kernel, l, a.stream, l.g, reinterpret_cast<const D*>(dy),
                  reinterpret_cast<const D*>(x), reinterpret_cast<const D*>(gamma), mean, rstd,
                  a.s64, a.centered, w64, payload, part, false, hw);
  });
}

size_t row_norm_scratch_bytes(int64_t rows, int64_t h, bool params) {
  return params ? row_bwd_scratch_bytes(rows, h) : 0;
}

template <class T>
void row_apply_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma, const void* mean,
                        const void* rstd, const Header& hd, T* dx, T* dgamma, T* dbeta,
                        void* scratch, int* err, int64_t parts) {
  using D = typename Dev<T>::type;
  const Launch l = choose<D>(a, {dy, x, gamma, dx});
  if (l.p.blocks > 0) {
    with_pack<D>(l, [&](auto v, auto e) {
      launch_rows("row apply_bwd", apply_bwd<D, decltype(v)::value, decltype(e)::value>, l,
                  a.stream, l.g, reinterpret_cast<const D*>(dy), reinterpret_cast<const D*>(x),
                  reinterpret_cast<const D*>(gamma), mean, rstd, a.s64, hd, a.centered,
                  reinterpret_cast<D*>(dx), err);
    });
  }
  if ((!dgamma && !dbeta) || a.h <= 0) return;
  // Overlapping apply_bwd only when apply_bwd runs (without rows the previous kernel is the
  // collective's, whose writes the header read must not race).
  const dim3 grid(static_cast<unsigned>((a.h + 255) / 256));
  if (parts < 0) parts = row_bwd_parts(a.rows, a.h);
  const float* part = static_cast<const float*>(scratch);
  D* dg = reinterpret_cast<D*>(dgamma);
  D* db = reinterpret_cast<D*>(dbeta);
  if (l.p.blocks > 0)
    launch_dependent("row dgamma_final", dgamma_final<D>, grid, dim3(256), st(a.stream), a.h, parts,
                     part, hd, dg, db, err);
  else
    launch("row dgamma_final", dgamma_final<D>, grid, dim3(256), st(a.stream), a.h, parts, part, hd,
           dg, db, err);
}

#define TPNORM_CUDA_ROW_INSTANTIATE(T)                                                             \
  template void row_partial_forward<T>(const RowArgs&, const T*, bool, bool, void*,                \
                                       const HeaderWrite&);                                        \
  template void row_apply_forward<T>(const RowArgs&, const T*, const T*, const T*, const Header&,  \
                                     double, T*, void*, void*, int*);                              \
  template void row_partial_backward<T>(const RowArgs&, const T*, const T*, const T*, const void*, \
                                        const void*, bool, void*, void*, const HeaderWrite&,       \
                                        bool);                                                     \
  template void row_apply_backward<T>(const RowArgs&, const T*, const T*, const T*, const void*,   \
                                      const void*, const Header&, T*, T*, T*, void*, int*,         \
                                      int64_t);
TPNORM_CUDA_ROW_INSTANTIATE(float)
TPNORM_CUDA_ROW_INSTANTIATE(f16)
TPNORM_CUDA_ROW_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cuda
