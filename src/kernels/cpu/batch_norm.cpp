// batch_norm.cpp — CPU kernels for SyncBatchNorm; see batch_norm.h.
//
// Two traversals serve every kernel, both as contiguous float32 vector loops (loops.h):
// NCHW walks (sample, channel) planes of `inner` contiguous values, a channel's constants
// splatted over the lanes (sums: threads over channels; apply: threads over planes);
// channels-last walks rows of c channels, vectorised across channels, the constants loaded per
// lane (threads over rows; per-thread per-channel float32 sums over kRows rows, added into W
// accumulators, which are added in a fixed order: deterministic for a thread count). The apply
// loops prefetch the input ~4 KiB ahead and stream outputs larger than the last-level cache.
// Element work is float32; statistics are W (double in the robust mode). x - mean is formed as
// (x - head) - tail with mean = head + tail split into floats, as in row_norm.cpp, so xhat
// keeps float accuracy when |mean| >> std.
// One rank, NCHW (bn_fused_*): threads over channels; a thread sums a channel's planes, applies
// them from L2, and while it writes them prefetches the next channel's planes, so the next sums
// read L2 while memory serves reads and writes at once, as in a copy.
#include "kernels/cpu/batch_norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "common/half.h"
#include "common/pivot.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {
namespace {

// Channels-last rows summed in float32 per channel before the sums are added in W.
constexpr int kRows = 16;

// A channel's constant over the lanes: NCHW lanes share one channel, channels-last lanes are
// consecutive channels starting at ch.
struct PlaneChannel {
  int64_t ch;
};
struct LaneChannels {
  int64_t ch;
};
template <class V>
inline V chan(PlaneChannel k, const float* v) {
  return splat<V>(v[k.ch]);
}
template <class V>
inline V chan(LaneChannels k, const float* v) {
  return load_as<V>(v + k.ch);
}

// NCHW: (s1, s2) = the sums of term over channel ch's n planes, plane by plane in sample order
// (block_sums each, added in W), the next plane prefetched: the hardware does not follow the
// jump there. The one order of a channel's sums, in the partial and in the one-rank fused path.
template <class W, class T, class Term>
void plane_sums(const BatchNormArgs& a, int64_t ch, const T* pf1, const T* pf2, Term term, W& s1,
                W& s2) {
  const int64_t c = a.c, inner = a.inner;
  W t1 = 0, t2 = 0;
  for (int64_t b = 0; b < a.n; ++b) {
    const int64_t base = (b * c + ch) * inner;
    W p1, p2;
    const bool pf = b + 1 < a.n;
    block_sums<W>(
        inner, [&](int64_t s, auto tag) { return term(base + s, PlaneChannel{ch}, tag); }, p1, p2,
        pf ? pf1 + base + c * inner : nullptr, pf && pf2 ? pf2 + base + c * inner : nullptr);
    t1 += p1;
    t2 += p2;
  }
  s1 = t1;
  s2 = t2;
}

// out[2ch], out[2ch+1] = the sums over channel ch's elements of term(i, k, V{}) -> Two<V>
// (i: the element's offset, k: its channel(s), see chan).
// pf1/pf2 (pf2 may be null): the inputs term reads, for prefetching.
template <class W, class T, class Term>
void channel_sums(const BatchNormArgs& a, W* out, const T* pf1, const T* pf2, Term term) {
  const int64_t c = a.c, inner = a.inner;
  if (!a.channels_last) {
    const int64_t c0 = a.c_begin, c1 = a.channel_end();
#pragma omp parallel for num_threads(thread_count(a.threads, c1 - c0)) schedule(static)
    for (int64_t ch = c0; ch < c1; ++ch)
      plane_sums(a, ch, pf1, pf2, term, out[2 * ch], out[2 * ch + 1]);
    return;
  }
  const int64_t rows = a.n * inner;
  const int nt = thread_count(a.threads, rows);
  std::vector<W> acc(static_cast<size_t>(nt) * 2 * c, W(0));
#pragma omp parallel num_threads(nt)
  {
    W* s1 = acc.data() + static_cast<size_t>(omp_get_thread_num()) * 2 * c;
    W* s2 = s1 + c;
    std::vector<float> part(static_cast<size_t>(2) * c, 0.0f);
    float* f1 = part.data();
    float* f2 = f1 + c;
    int pending = 0;
    auto flush = [&] {
      for (int64_t ch = 0; ch < c; ++ch) {
        s1[ch] += f1[ch];
        s2[ch] += f2[ch];
        f1[ch] = f2[ch] = 0;
      }
      pending = 0;
    };
    auto add = [&](int64_t r, int64_t ch, auto tag) {
      using V = decltype(tag);
      const Two<V> p = term(r * c + ch, LaneChannels{ch}, tag);
      store_as(f1 + ch, load_as<V>(f1 + ch) + p.a);
      store_as(f2 + ch, load_as<V>(f2 + ch) + p.b);
    };
    // The backward's sums read x and dy: both prefetched kAheadBytes on, line by line (0.93-0.96x
    // the time without, [32, 56, 56, 64], 1 and 2 threads, alternated call by call). The
    // forward's x alone is a single stream that the hardware prefetcher keeps up with (its
    // software prefetch measured 1.05-1.06x slower), so pf2 decides.
    const int64_t total = rows * c, ahead = kAheadBytes / static_cast<int64_t>(sizeof(T));
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      int64_t ch = 0;
      if (pf2)
        for (int64_t o = r * c + ahead; o < std::min(total, (r + 1) * c + ahead); o += kLine) {
          __builtin_prefetch(pf1 + o, 0, 2);
          __builtin_prefetch(pf2 + o, 0, 2);
        }
      for (; ch + vf::L <= c; ch += vf::L) add(r, ch, vf{});
      for (; ch < c; ++ch) add(r, ch, 0.0f);
      if (++pending == kRows) flush();
    }
    if (pending > 0) flush();
  }
  for (int64_t ch = 0; ch < c; ++ch) {
    W s1 = 0, s2 = 0;
    for (int t = 0; t < nt; ++t) {
      s1 += acc[static_cast<size_t>(t) * 2 * c + ch];
      s2 += acc[static_cast<size_t>(t) * 2 * c + c + ch];
    }
    out[2 * ch] = s1;
    out[2 * ch + 1] = s2;
  }
}

// out[i] = value(i, k, V{}) for every element, in parallel; in1/in2 (in2 may be null) are the
// inputs value reads, prefetched kAheadBytes ahead. Per-channel arrays that value reads with
// LaneChannels must be padded by tile_channels.
template <class T, class Value>
void apply_elements(const BatchNormArgs& a, const T* in1, const T* in2, T* out, Value value) {
  const int64_t c = a.c, inner = a.inner, total = a.n * c * inner;
  const bool stream = stream_output<T>((in2 ? 3 : 2) * total * static_cast<int64_t>(sizeof(T)));
  const int64_t ahead = kAheadBytes / static_cast<int64_t>(sizeof(T));
  const T* none = nullptr;
  // Elements [o, e) with channel constants k(j); prefetching only where it stays in the tensor.
  auto run = [&](int64_t o, int64_t e, auto k) {
    const int64_t mid = std::max(o, std::min(e, total - ahead));
    for (const auto& [lo, hi, pf] : {std::tuple{o, mid, true}, std::tuple{mid, e, false}})
      write_row(out + lo, hi - lo, stream, pf ? in1 + lo + ahead : none,
                pf && in2 ? in2 + lo + ahead : none,
                [value, k, lo = lo](int64_t j, auto tag) { return value(lo + j, k(lo + j), tag); });
  };
  if (!a.channels_last) {
    // Planes (b, ch) of channels [c0, c1) in memory order.
    const int64_t c0 = a.c_begin, r = a.channel_end() - c0, planes = a.n * r;
#pragma omp parallel num_threads(thread_count(a.threads, planes))
    {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < planes; ++i) {
        const int64_t ch = c0 + i % r, bc = i / r * c + ch;
        run(bc * inner, (bc + 1) * inner, [ch](int64_t) { return PlaneChannel{ch}; });
      }
      if (stream) stream_fence();
    }
  } else {
    // One flat run per thread (a row of c channels is too short to peel and stream by itself);
    // the channel of element i is i % c, tracked incrementally (write_row goes forward, at most
    // vf::L elements a step).
    const int64_t rows = a.n * inner;
#pragma omp parallel num_threads(thread_count(a.threads, rows))
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t lo = rows * t / nt * c, hi = rows * (t + 1) / nt * c;
      int64_t pos = lo, ch = 0;
      run(lo, hi, [&](int64_t i) {
        ch += i - pos;
        pos = i;
        while (ch >= c) ch -= c;
        return LaneChannels{ch};
      });
      if (stream) stream_fence();
    }
  }
}

// Pads per-channel arrays to c + vf::L entries, entry k holding channel k % c, so that a vector
// of consecutive channels may run past the last channel into the next row's first ones.
template <class... A>
void tile_channels(int64_t c, A&... v) {
  if (c > 0)
    for (std::vector<float>* p : {&v...})
      for (int64_t k = c; k < c + vf::L; ++k) p->push_back((*p)[k % c]);
}

// split_mean of every channel's mean.
template <class S>
void split_means(int64_t c, const S* mean, std::vector<float>& head, std::vector<float>& tail) {
  head.resize(c);
  tail.resize(c);
  for (int64_t ch = 0; ch < c; ++ch) split_mean(mean[ch], head[ch], tail[ch]);
}

// The formulas below are written once for the two-pass kernels and the one-rank fused ones
// (bn_fused_*), so that both give the same bits: the same sums in the same order (plane_sums
// for NCHW), the same per-channel constants, the same element formulas.

// Forward sums around each channel's pivot pv: {d, d^2}, d = x - pivot.
template <class T>
auto forward_term(const T* x, const float* pv) {
  return [=](int64_t i, auto k, auto tag) {
    using V = decltype(tag);
    const V d = load_as<V>(x + i) - chan<V>(k, pv);
    return Two<V>{d, d * d};
  };
}

// Sums of d = x - pivot over m values shifted back to sums of x and x^2.
template <class W>
void unpivot(float pivot, int64_t m, W& s1, W& s2) {
  const W p = pivot, d1 = s1, d2 = s2;
  s1 = p * static_cast<W>(m) + d1;
  s2 = d2 + 2 * p * d1 + p * p * static_cast<W>(m);
}

// Mean and biased variance (clamped at 0) of n values from their sums.
template <class W>
void moments_of(W s1, W s2, double n, double& mean, double& var) {
  const double mu = static_cast<double>(s1) / n;
  const double v = static_cast<double>(s2) / n - mu * mu;
  mean = mu;
  var = v > 0 ? v : 0.0;
}

// Backward sums: {dy, dy * (x - mean)}, x - mean as (x - head) - tail.
template <class T>
auto backward_term(const T* dy, const T* x, const float* h, const float* t) {
  return [=](int64_t i, auto k, auto tag) {
    using V = decltype(tag);
    const V d = load_as<V>(dy + i);
    return Two<V>{d, d * ((load_as<V>(x + i) - chan<V>(k, h)) - chan<V>(k, t))};
  };
}

// The forward apply's channel constants (mean as head + tail, scale = invstd * gamma,
// shift = beta) and its element formula y = (x - mean) * scale + shift.
struct ForwardConstants {
  std::vector<float> h, t, sc, sh;
  explicit ForwardConstants(int64_t c) : h(c), t(c), sc(c), sh(c) {}
  template <class P, class S>
  void set(int64_t ch, const P* gamma, const P* beta, S mean, S invstd) {
    split_mean(mean, h[ch], t[ch]);
    sc[ch] = static_cast<float>(invstd) * (gamma ? to_float(gamma[ch]) : 1.0f);
    sh[ch] = beta ? to_float(beta[ch]) : 0.0f;
  }
  // After tile_channels (the vectors do not change afterwards).
  template <class T>
  auto value(const T* x) const {
    const float *hp = h.data(), *tp = t.data(), *scp = sc.data(), *shp = sh.data();
    return [=](int64_t i, auto k, auto tag) {
      using V = decltype(tag);
      const V xc = (load_as<V>(x + i) - chan<V>(k, hp)) - chan<V>(k, tp);
      return fmadd(xc, chan<V>(k, scp), chan<V>(k, shp));
    };
  }
};

// The backward apply's channel constants (mean as head + tail, k = invstd * gamma,
// c1 = sum(dy) / n, c2 = invstd^2 * sum(dy * (x - mean)) / n; zero sums or n = 0: the eval
// backward) and its element formula dx = k * ((dy - c1) - (x - mean) * c2).
struct BackwardConstants {
  std::vector<float> h, t, k, c1, c2;
  explicit BackwardConstants(int64_t c) : h(c), t(c), k(c), c1(c), c2(c) {}
  template <class P, class W, class S>
  void set(int64_t ch, const P* gamma, S invstd, W s1, W s2, double n) {
    const double is = static_cast<double>(invstd);
    k[ch] = static_cast<float>(is * (gamma ? to_float(gamma[ch]) : 1.0f));
    c1[ch] = n > 0 ? static_cast<float>(static_cast<double>(s1) / n) : 0.0f;
    c2[ch] = n > 0 ? static_cast<float>(is * is * static_cast<double>(s2) / n) : 0.0f;
  }
  template <class T>
  auto value(const T* dy, const T* x) const {
    const float *hp = h.data(), *tp = t.data(), *kp = k.data(), *k1 = c1.data(), *k2 = c2.data();
    return [=](int64_t i, auto ch, auto tag) {
      using V = decltype(tag);
      const V xc = (load_as<V>(x + i) - chan<V>(ch, hp)) - chan<V>(ch, tp);
      return chan<V>(ch, kp) * ((load_as<V>(dy + i) - chan<V>(ch, k1)) - xc * chan<V>(ch, k2));
    };
  }
};

// NCHW: out's planes of channel ch from value, plane by plane (their inputs are in cache);
// next1/next2 (may be null): the inputs of the channel the thread takes next, prefetched plane
// by plane as this channel's planes are written, so that its sums read L2 and memory reads
// overlap this channel's writes (as in a copy) instead of following them.
template <class T, class Value>
void apply_planes(const BatchNormArgs& a, int64_t ch, bool stream, T* out, const T* next1,
                  const T* next2, Value value) {
  for (int64_t b = 0; b < a.n; ++b) {
    const int64_t base = (b * a.c + ch) * a.inner, nb = base + a.inner;
    write_row(out + base, a.inner, stream, next1 ? next1 + nb : next1, next2 ? next2 + nb : next2,
              [&](int64_t j, auto tag) { return value(base + j, PlaneChannel{ch}, tag); });
  }
}

// The channels [begin, end) of thread t of nt (contiguous, as OpenMP's static schedule).
inline std::pair<int64_t, int64_t> thread_channels(int64_t c, int t, int nt) {
  return {c * t / nt, c * (t + 1) / nt};
}

}  // namespace

bool bn_fuses(const BatchNormArgs& a, int64_t input_bytes) {
  if (a.channels_last || a.n <= 0 || a.c <= 0) return false;
  const int64_t t = a.threads > 0 ? a.threads : omp_get_max_threads();
  const bool balanced = a.c % t == 0 || a.c >= 4 * t;
  return balanced && a.n * a.inner * input_bytes <= bn_fused_channel_bytes(static_cast<int>(t));
}

int64_t bn_fused_channel_bytes(int threads) {
  return l2_cache_bytes() + last_level_cache_bytes() / (4 * std::max(threads, 2));
}

template <class T, class W>
void bn_partial_forward(const BatchNormArgs& a, const T* x, W* stats) {
  // Robust: sums of d = x - pivot (float lanes, W across blocks) around each channel's robust
  // pivot (common/pivot.h), shifted back exactly enough. Naive: pivot 0.
  std::vector<float> pivot(a.c, 0.0f);
  const int64_t m = a.n * a.inner;
  const int64_t c0 = a.c_begin, c1 = a.channel_end();
  if (std::is_same_v<W, double>)
    for (int64_t ch = c0; ch < c1; ++ch)
      pivot[ch] = detail::channel_pivot(x, a.n, a.c, a.inner, a.channels_last, ch);
  const T* none = nullptr;
  channel_sums<W>(a, stats, x, none, forward_term(x, pivot.data()));
  for (int64_t ch = c0; ch < c1; ++ch) unpivot(pivot[ch], m, stats[2 * ch], stats[2 * ch + 1]);
}

template <class W>
void bn_moments(int64_t c, const W* stats, double n, double* mean, double* var) {
  for (int64_t ch = 0; ch < c; ++ch)
    moments_of(stats[2 * ch], stats[2 * ch + 1], n, mean[ch], var[ch]);
}

template <class T, class P, class S>
void bn_apply_forward(const BatchNormArgs& a, const T* x, const P* gamma, const P* beta,
                      const S* mean, const S* invstd, T* y) {
  ForwardConstants k(a.c);
  for (int64_t ch = a.c_begin; ch < a.channel_end(); ++ch)
    k.set(ch, gamma, beta, mean[ch], invstd[ch]);
  tile_channels(a.c, k.h, k.t, k.sc, k.sh);
  apply_elements(a, x, static_cast<const T*>(nullptr), y, k.value(x));
}

template <class T, class P, class W>
void bn_fused_forward(const BatchNormArgs& a, const T* x, const P* gamma, const P* beta, double eps,
                      double n, double* mean, double* var, double* invstd, T* y) {
  const int64_t c = a.c, m = a.n * a.inner;
  const bool stream = stream_output<T>(2 * m * c * static_cast<int64_t>(sizeof(T)));
  std::vector<float> pivot(c, 0.0f);
  ForwardConstants k(c);
  const auto term = forward_term(x, pivot.data());
  const auto value = k.value(x);
  const T* none = nullptr;
#pragma omp parallel num_threads(thread_count(a.threads, c))
  {
    const auto [c0, c1] = thread_channels(c, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t ch = c0; ch < c1; ++ch) {
      const T* next = ch + 1 < c1 ? x : none;
      if (std::is_same_v<W, double>)
        pivot[ch] = detail::channel_pivot(x, a.n, c, a.inner, false, ch);
      W s1, s2;
      plane_sums(a, ch, x, none, term, s1, s2);
      unpivot(pivot[ch], m, s1, s2);
      moments_of(s1, s2, n, mean[ch], var[ch]);
      invstd[ch] = 1.0 / std::sqrt(var[ch] + eps);
      k.set(ch, gamma, beta, mean[ch], invstd[ch]);
      apply_planes(a, ch, stream, y, next, none, value);
    }
    if (stream) stream_fence();
  }
}

template <class T, class W, class S>
void bn_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean, W* stats) {
  std::vector<float> mh, mt;
  split_means(a.c, mean, mh, mt);
  channel_sums<W>(a, stats, dy, x, backward_term(dy, x, mh.data(), mt.data()));
}

template <class T, class P, class W, class S>
void bn_apply_backward(const BatchNormArgs& a, const T* dy, const T* x, const P* gamma,
                       const S* mean, const S* invstd, const W* stats, double n, T* dx) {
  BackwardConstants k(a.c);
  split_means(a.c, mean, k.h, k.t);
  for (int64_t ch = a.c_begin; ch < a.channel_end(); ++ch)
    k.set(ch, gamma, invstd[ch], stats[2 * ch], stats[2 * ch + 1], n);
  tile_channels(a.c, k.h, k.t, k.k, k.c1, k.c2);
  apply_elements(a, x, dy, dx, k.value(dy, x));
}

template <class T, class P, class W, class S>
void bn_fused_backward(const BatchNormArgs& a, const T* dy, const T* x, const P* gamma,
                       const S* mean, const S* invstd, double n, W* sums, T* dx) {
  const int64_t c = a.c;
  const bool stream = stream_output<T>(3 * a.n * c * a.inner * static_cast<int64_t>(sizeof(T)));
  BackwardConstants k(c);
  const auto term = backward_term(dy, x, k.h.data(), k.t.data());
  const auto value = k.value(dy, x);
#pragma omp parallel num_threads(thread_count(a.threads, c))
  {
    const auto [c0, c1] = thread_channels(c, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t ch = c0; ch < c1; ++ch) {
      const bool next = ch + 1 < c1;
      split_mean(mean[ch], k.h[ch], k.t[ch]);
      plane_sums(a, ch, dy, x, term, sums[2 * ch], sums[2 * ch + 1]);
      k.set(ch, gamma, invstd[ch], sums[2 * ch], sums[2 * ch + 1], n);
      apply_planes(a, ch, stream, dx, next ? dy : nullptr, next ? x : nullptr, value);
    }
    if (stream) stream_fence();
  }
}

template <class P, class W, class S>
void bn_param_grads(int64_t c, const W* local_stats, const S* invstd, P* dgamma, P* dbeta) {
  for (int64_t ch = 0; ch < c; ++ch) {
    if (dgamma)
      dgamma[ch] = from_float<P>(static_cast<float>(static_cast<double>(invstd[ch]) *
                                                    static_cast<double>(local_stats[2 * ch + 1])));
    if (dbeta) dbeta[ch] = from_float<P>(static_cast<float>(local_stats[2 * ch]));
  }
}

// W: the wire type of bn_partial_forward, the saved-statistics type of bn_apply_forward.
// P: the parameter type, T or float (TPNORM_BN_*_F32: float32 parameters of f16/bf16 x).
#define TPNORM_BN_PW(T, P, W)                                                                 \
  template void bn_apply_forward<T, P, W>(const BatchNormArgs&, const T*, const P*, const P*, \
                                          const W*, const W*, T*);                            \
  template void bn_fused_forward<T, P, W>(const BatchNormArgs&, const T*, const P*, const P*, \
                                          double, double, double*, double*, double*, T*);
#define TPNORM_BN_W(T, W)                                                     \
  template void bn_partial_forward<T, W>(const BatchNormArgs&, const T*, W*); \
  TPNORM_BN_PW(T, T, W)
#define TPNORM_BN_PWS(T, P, W, S)                                                                 \
  template void bn_apply_backward<T, P, W, S>(const BatchNormArgs&, const T*, const T*, const P*, \
                                              const S*, const S*, const W*, double, T*);          \
  template void bn_fused_backward<T, P, W, S>(const BatchNormArgs&, const T*, const T*, const P*, \
                                              const S*, const S*, double, W*, T*);
#define TPNORM_BN_WS(T, W, S)                                                                    \
  template void bn_partial_backward<T, W, S>(const BatchNormArgs&, const T*, const T*, const S*, \
                                             W*);                                                \
  TPNORM_BN_PWS(T, T, W, S)                                                                      \
  template void bn_param_grads<T, W, S>(int64_t, const W*, const S*, T*, T*);
#define TPNORM_BN_W_F32(T, W) TPNORM_BN_PW(T, float, W)
#define TPNORM_BN_WS_F32(T, W, S) TPNORM_BN_PWS(T, float, W, S)
#define TPNORM_BN(T) TPNORM_FOR_EACH_W(TPNORM_BN_W, T) TPNORM_FOR_EACH_WS(TPNORM_BN_WS, T)
#define TPNORM_BN_F32(T) \
  TPNORM_FOR_EACH_W(TPNORM_BN_W_F32, T) TPNORM_FOR_EACH_WS(TPNORM_BN_WS_F32, T)
TPNORM_FOR_EACH_STORAGE(TPNORM_BN)
TPNORM_BN_F32(f16)
TPNORM_BN_F32(bf16)
template void bn_moments<float>(int64_t, const float*, double, double*, double*);
template void bn_moments<double>(int64_t, const double*, double, double*, double*);

}  // namespace tpnorm::kernels::cpu
