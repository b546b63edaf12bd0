// batch_norm.cu — CUDA kernels of SyncBatchNorm; see batch_norm.h, and plan.h for the two walks.
//
// Element kernels, each in the planes walk (a block per channel and split, inner > 1) and the
// rows walk (a block per tile of channels and split, inner == 1): sums_* make the per-split
// partial sums; apply_fwd_* / apply_bwd_* write y / dx. Every thread keeps its channel's (or
// its vec channels') constants in registers, issues kBnLoads vector accesses per tensor before
// it uses any, and finds the next element by additions (no division per element). Per-channel
// kernels: combine adds the splits in order per channel (deterministic for a shape: the same
// plan, the same order; no atomics), fwd_consts / bwd_consts make the per-channel constants,
// param_grads writes dgamma / dbeta. Templates: the storage type, the vector width, the pass.
#include <algorithm>

#include "common/half.h"
#include "kernels/cuda/batch_norm.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/plan.h"

namespace tpnorm::kernels::cuda {
namespace {

constexpr int K = kBnLoads;

struct Geo {
  int64_t outer, c, inner;
  bool channels_last = false;  // only the pivot's span depends on it (as on CPU)
};

// The robust pivot of channel ch on this rank: the CPU kernels' (common/pivot.h); a
// channels-last tensor here is [outer = n * inner, c, 1]. Only called when the rank has values.
template <class T>
__device__ __forceinline__ float channel_pivot(const Geo& g, const T* x, int64_t ch) {
  return detail::channel_pivot(x, g.outer, g.c, g.inner, g.channels_last, ch);
}

// What a pass adds per element into v[2]: forward {d, d^2} with d = x - a (a: the pivot, or 0);
// backward {dy, dy * ((x - a) - b)} with (a, b) the saved mean split into floats.
template <bool kBwd>
__device__ __forceinline__ void add_term(float xv, float gv, float a, float b, float (&v)[2]) {
  if (kBwd) {
    v[0] += gv;
    v[1] += gv * ((xv - a) - b);
  } else {
    const float d = xv - a;
    v[0] += d;
    v[1] += d * d;
  }
}

// Per channel: the pivot (forward, robust; else 0) or the split saved mean (backward).
template <class T, bool kBwd>
__device__ __forceinline__ void channel_ref(const Geo& g, const T* x, const void* mean, bool s64,
                                            bool robust, int64_t ch, float& a, float& b) {
  a = b = 0.0f;
  if (kBwd)
    split_mean(load_fd(mean, ch, s64), a, b);
  else if (robust)
    a = channel_pivot(g, x, ch);
}

template <class T, int V>
using Vec = Pack<T, V>;

// Planes walk (plan.h): block (ch, sp); thread t sums its units into kBnLoads independent
// accumulator pairs, added in a fixed order, then the block's sum in a fixed order.
template <class T, int V, bool kBwd>
__global__ void __launch_bounds__(kBnThreads)
    sums_planes(BnPlan p, Geo g, const T* __restrict__ x, const T* __restrict__ dy,
                const void* mean, bool s64, bool robust, float* part, float* pivots) {
  const int64_t ch = blockIdx.x, sp = blockIdx.y;
  __shared__ float ref[2];  // one thread reads the channel's pivot / mean for the block
  if (threadIdx.x == 0) {
    channel_ref<T, kBwd>(g, x, mean, s64, robust, ch, ref[0], ref[1]);
    if (!kBwd && robust && sp == 0) pivots[ch] = ref[0];  // for combine
  }
  __syncthreads();
  const float a = ref[0], b = ref[1];
  float acc[K][2] = {};
  BnWalk w = BnWalk::start(p, g.c, ch, sp, threadIdx.x);
  while (w.left > 0) {
    Vec<T, V> xs[K], gs[K];
    bool on[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {  // every access of the round in flight before any use
      on[k] = w.left > 0;
      if (on[k]) {
        xs[k] = load_pack<T, V>(x, w.at);
        if (kBwd) gs[k] = load_pack<T, V>(dy, w.at);
        w.next(p);
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (on[k])
#pragma unroll
        for (int j = 0; j < V; ++j)
          add_term<kBwd>(to_f(xs[k].v[j]), kBwd ? to_f(gs[k].v[j]) : 0.0f, a, b, acc[k]);
  }
  float v[2] = {0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < K; ++k) v[0] += acc[k][0], v[1] += acc[k][1];
  group_sum<2>(v, kBnThreads);
  if (threadIdx.x == 0) {
    part[(2 * sp) * g.c + ch] = v[0];
    part[(2 * sp + 1) * g.c + ch] = v[1];
  }
}

// Rows walk (plan.h): block (tile, sp) of tile_x vector columns x tile_y rows; thread (tx, ty)
// owns channels gi * V .. gi * V + V - 1 (gi = its vector column) and sums rows ty, ty +
// tile_y, ... of the split; the block then adds its tile_y rows per channel in row order.
template <class T, int V, bool kBwd>
__global__ void __launch_bounds__(kBnThreads)
    sums_rows(BnPlan p, Geo g, const T* __restrict__ x, const T* __restrict__ dy, const void* mean,
              bool s64, bool robust, float* part, float* pivots) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * p.tile_x + tx, sp = blockIdx.y;
  float acc[V][2] = {};
  if (gi < p.groups) {
    float a[V], b[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      channel_ref<T, kBwd>(g, x, mean, s64, robust, gi * V + j, a[j], b[j]);
      if (!kBwd && robust && sp == 0 && ty == 0) pivots[gi * V + j] = a[j];  // for combine
    }
    const int64_t r1 = min(g.outer, (sp + 1) * p.per), step = p.tile_y * p.groups;
    int64_t r = sp * p.per + ty, at = r * p.groups + gi;
    while (r < r1) {
      Vec<T, V> xs[K], gs[K];
      bool on[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        on[k] = r < r1;
        if (on[k]) {
          xs[k] = load_pack<T, V>(x, at);
          if (kBwd) gs[k] = load_pack<T, V>(dy, at);
          at += step;
          r += p.tile_y;
        }
      }
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (on[k])
#pragma unroll
          for (int j = 0; j < V; ++j)
            add_term<kBwd>(to_f(xs[k].v[j]), kBwd ? to_f(gs[k].v[j]) : 0.0f, a[j], b[j], acc[j]);
    }
  }
  // Every thread reaches this barrier (threads past the last channel hold zeros).
  __shared__ float s0[kBnThreads * 8], s1[kBnThreads * 8];  // [tile_y][tile_x * V]
  const int width = p.tile_x * V;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s0[ty * width + tx * V + j] = acc[j][0];
    s1[ty * width + tx * V + j] = acc[j][1];
  }
  __syncthreads();
  const int t = ty * p.tile_x + tx;  // position t of the tile: channel blockIdx.x * width + t
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * width + t;
  if (t >= width || ch >= g.c) return;
  float t0 = 0.0f, t1 = 0.0f;
  for (int i = 0; i < p.tile_y; ++i) t0 += s0[i * width + t], t1 += s1[i * width + t];
  part[(2 * sp) * g.c + ch] = t0;
  part[(2 * sp + 1) * g.c + ch] = t1;
}

// Splits in order per channel; forward shifts the pivoted sums back (as on CPU), with the
// pivots the sums kernel stored (null: no pivot, 0).
template <bool kBwd>
__global__ void combine(Geo g, const float* pivots, int64_t splits, const float* part, bool w64,
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
    const double p = pivots ? pivots[ch] : 0.0f;
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

// call_ok for a whole block of an element kernel: one thread reads the header, the block
// gets its verdict. Every thread must call it, before any divergence.
__device__ __forceinline__ bool block_call_ok(const Header& hd, bool need_two, int* err) {
  __shared__ int ok;
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    double n;
    ok = call_ok(hd, need_two, &n) ? 1 : 0;
    if (!ok) atomicExch(err, 1);
  }
  __syncthreads();
  return ok != 0;
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

// The element operation of an apply, with its channel's constants in registers. kIn: how many
// input tensors it reads (in0, then in1); kNeedTwo: a training forward also needs n > 1.
// Forward, consts head[c], tail[c], scale[c], shift[c]: y = ((x - head) - tail) * scale + shift.
struct ApplyFwd {
  static constexpr int kIn = 1;  // x
  static constexpr bool kNeedTwo = true;
  float h, t, s, b;
  __device__ __forceinline__ void load(const float* consts, int64_t c, int64_t ch) {
    h = consts[ch], t = consts[c + ch], s = consts[2 * c + ch], b = consts[3 * c + ch];
  }
  __device__ __forceinline__ float operator()(float x, float) const {
    return ((x - h) - t) * s + b;
  }
};
// Backward, consts head[c], tail[c], k[c], c1[c], c2[c]: dx = k ((dy - c1) - xc c2), xc = (x -
// head) - tail. Eval (kTrain false: mean and invstd are constants, c1 = c2 = 0): dx = k dy,
// x is not read (as PyTorch's eval backward; the CPU path computes k ((dy - 0) - xc 0), the same
// value for finite x).
template <bool kTrain>
struct ApplyBwd {
  static constexpr int kIn = kTrain ? 2 : 1;  // dy (and x)
  static constexpr bool kNeedTwo = false;
  float h, t, k, c1, c2;
  __device__ __forceinline__ void load(const float* consts, int64_t c, int64_t ch) {
    h = consts[ch], t = consts[c + ch], k = consts[2 * c + ch];
    c1 = consts[3 * c + ch], c2 = consts[4 * c + ch];
  }
  __device__ __forceinline__ float operator()(float dy, float x) const {
    return kTrain ? k * ((dy - c1) - ((x - h) - t) * c2) : k * dy;
  }
};

// out = op(in0, in1) over the planes walk: block (ch, sp), the channel's constants in registers.
template <class T, int V, class Op>
__global__ void __launch_bounds__(kBnThreads)
    apply_planes(BnPlan p, Geo g, Header hd, const T* __restrict__ in0, const T* __restrict__ in1,
                 T* __restrict__ out, const float* consts, int* err) {
  if (!block_call_ok(hd, Op::kNeedTwo, err)) return;  // uniform: the whole block leaves
  const int64_t ch = blockIdx.x;
  Op op;
  op.load(consts, g.c, ch);
  BnWalk w = BnWalk::start(p, g.c, ch, blockIdx.y, threadIdx.x);
  while (w.left > 0) {
    Vec<T, V> u[K], v[K];
    int64_t at[K];
    bool on[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      on[k] = w.left > 0;
      if (on[k]) {
        at[k] = w.at;
        u[k] = load_pack<T, V>(in0, w.at);
        if (Op::kIn == 2) v[k] = load_pack<T, V>(in1, w.at);
        w.next(p);
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!on[k]) continue;
      Vec<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j)
        o.v[j] = from_f<T>(op(to_f(u[k].v[j]), Op::kIn == 2 ? to_f(v[k].v[j]) : 0.0f));
      store_pack<T, V>(out, at[k], o);
    }
  }
}

// out = op(in0, in1) over the rows walk: thread (tx, ty) holds the constants of its V channels.
template <class T, int V, class Op>
__global__ void __launch_bounds__(kBnThreads)
    apply_rows(BnPlan p, Geo g, Header hd, const T* __restrict__ in0, const T* __restrict__ in1,
               T* __restrict__ out, const float* consts, int* err) {
  if (!block_call_ok(hd, Op::kNeedTwo, err)) return;
  const int64_t gi = static_cast<int64_t>(blockIdx.x) * p.tile_x + threadIdx.x, sp = blockIdx.y;
  if (gi >= p.groups) return;  // no barrier below
  Op op[V];
#pragma unroll
  for (int j = 0; j < V; ++j) op[j].load(consts, g.c, gi * V + j);
  const int64_t r1 = min(g.outer, (sp + 1) * p.per), step = p.tile_y * p.groups;
  int64_t r = sp * p.per + threadIdx.y, at0 = r * p.groups + gi;
  while (r < r1) {
    Vec<T, V> u[K], v[K];
    int64_t at[K];
    bool on[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      on[k] = r < r1;
      if (on[k]) {
        at[k] = at0;
        u[k] = load_pack<T, V>(in0, at0);
        if (Op::kIn == 2) v[k] = load_pack<T, V>(in1, at0);
        at0 += step;
        r += p.tile_y;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (!on[k]) continue;
      Vec<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j)
        o.v[j] = from_f<T>(op[j](to_f(u[k].v[j]), Op::kIn == 2 ? to_f(v[k].v[j]) : 0.0f));
      store_pack<T, V>(out, at[k], o);
    }
  }
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

size_t up(size_t b) { return (b + 255) / 256 * 256; }
size_t nonneg(int64_t v) { return static_cast<size_t>(std::max<int64_t>(v, 0)); }

// Scratch: part floats [max splits][2][c] | pivots floats [c] | local doubles [2c] |
// consts floats [5c]. The splits' bound comes from the shape (plan.h: bn_max_splits), so the
// size is known before the pointers (which may narrow the plan's vectors) are.
struct Scratch {
  float* part;
  float* pivots;
  double* local;
  float* consts;
};
size_t part_bytes(const BnArgs& a) {
  return up(nonneg(bn_max_splits(a.outer, a.c, a.inner)) * 2 * nonneg(a.c) * sizeof(float));
}
Scratch carve(const BnArgs& a, void* s) {
  char* p = static_cast<char*>(s);
  const size_t c = nonneg(a.c), part = part_bytes(a), piv = up(c * sizeof(float));
  return {reinterpret_cast<float*>(p), reinterpret_cast<float*>(p + part),
          reinterpret_cast<double*>(p + part + piv),
          reinterpret_cast<float*>(p + part + piv + up(2 * c * sizeof(double)))};
}

cudaStream_t st(void* s) { return static_cast<cudaStream_t>(s); }
Geo geo(const BnArgs& a) { return {a.outer, a.c, a.inner, a.channels_last}; }
unsigned per_channel_blocks(int64_t c) { return static_cast<unsigned>((c + 255) / 256); }
dim3 grid_of(const BnPlan& p) {
  return dim3(static_cast<unsigned>(p.blocks_x), static_cast<unsigned>(p.splits));
}
dim3 block_of(const BnPlan& p) {
  return p.rows ? dim3(static_cast<unsigned>(p.tile_x), static_cast<unsigned>(p.tile_y))
                : dim3(kBnThreads);
}

template <class D, bool kBwd>
void channel_sums(const BnArgs& a, const D* x, const D* dy, const void* mean, bool s64, bool robust,
                  bool w64, void* payload, void* scratch) {
  if (a.c <= 0) return;
  const BnPlan p = plan_channels(a.outer, a.c, a.inner, sizeof(D), {x, dy});
  const Scratch s = carve(a, scratch);
  const Geo g = geo(a);
  if (p.splits > 0) {  // 0 when this rank has no element: nothing may read x
    with_vec<D>(p.vec, [&](auto v) {
      constexpr int V = decltype(v)::value;
      if (p.rows)
        launch("bn sums_rows", sums_rows<D, V, kBwd>, grid_of(p), block_of(p), st(a.stream), p, g,
               x, dy, mean, s64, robust, s.part, s.pivots);
      else
        launch("bn sums_planes", sums_planes<D, V, kBwd>, grid_of(p), block_of(p), st(a.stream), p,
               g, x, dy, mean, s64, robust, s.part, s.pivots);
    });
  }
  const float* pivots = !kBwd && robust && p.splits > 0 ? s.pivots : nullptr;
  launch("bn combine", combine<kBwd>, dim3(per_channel_blocks(a.c)), dim3(256), st(a.stream), g,
         pivots, p.splits, static_cast<const float*>(s.part), w64, payload,
         kBwd ? s.local : nullptr);
}

// out = Op(in0, in1) element-wise in the walk the plan picks; nothing when there is no element.
template <class Op, class D>
void apply(const char* what, const BnArgs& a, const Header& hd, const D* in0, const D* in1, D* out,
           const float* consts, int* err) {
  const BnPlan p = plan_channels(a.outer, a.c, a.inner, sizeof(D), {in0, in1, out});
  if (p.splits == 0) return;
  with_vec<D>(p.vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    launch(what, p.rows ? apply_rows<D, V, Op> : apply_planes<D, V, Op>, grid_of(p), block_of(p),
           st(a.stream), p, geo(a), hd, in0, in1, out, consts, err);
  });
}

}  // namespace

size_t bn_scratch_bytes(const BnArgs& a) {
  const size_t c = nonneg(a.c);
  return part_bytes(a) + up(c * sizeof(float)) + up(2 * c * sizeof(double)) +
         up(5 * c * sizeof(float));
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
  const D* none = nullptr;
  apply<ApplyFwd>("bn apply_fwd", a, hd, reinterpret_cast<const D*>(x), none,
                  reinterpret_cast<D*>(y), carve(a, scratch).consts, err);
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
  const D* g = reinterpret_cast<const D*>(dy);
  if (hd.base)  // training: dx needs x and the summed sums
    apply<ApplyBwd<true>>("bn apply_bwd", a, hd, g, reinterpret_cast<const D*>(x),
                          reinterpret_cast<D*>(dx), s.consts, err);
  else  // eval: dx = gamma * invstd * dy, x unread
    apply<ApplyBwd<false>>("bn apply_bwd", a, hd, g, static_cast<const D*>(nullptr),
                           reinterpret_cast<D*>(dx), s.consts, err);
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
