// exact_channels.cpp — CPU kernels of Stats::kExact for SyncBatchNorm; see exact_channels.h.
//
// One pass over the data through ExactStreams (kernels/cpu/exact_bins.h). NCHW: threads take
// channels and a channel's planes go through its streams. Channels-last (and [N, C]): threads
// take blocks of rows, and a stream's lanes sum vf::L channels of a row at a time (one target
// per lane); the threads' integers are then added. Integer sums: the split into threads,
// blocks and vectors changes nothing.
#include "kernels/cpu/exact_channels.h"

#include <omp.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "common/exact_sum.h"
#include "common/half.h"
#include "kernels/cpu/exact_bins.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"

namespace tpnorm::kernels::cpu {
namespace {

struct ChannelSums {
  exact::Sum1 s1, t1;  // sum x or sum dy; sum dy*xmu
  exact::Sum2 s2;      // sum x^2
  int64_t bad = 0;
  void add(const ChannelSums& o) {
    exact::add(s1, o.s1);
    exact::add(t1, o.t1);
    exact::add(s2, o.s2);
    bad += o.bad;
  }
};

// n <= vf::L values of T at p as float lanes, zeros from lane n on.
template <class T>
inline vf load_lanes(const T* p, int n) {
  if (n == vf::L) return load_as<vf>(p);
  alignas(64) float b[vf::L] = {};
  for (int l = 0; l < n; ++l) b[l] = to_float(p[l]);
  return vload(b);
}

// v with the lanes from n on zeroed (a tail's terms: nothing but its own values is summed).
inline vf first_lanes(vf v, int n) {
  if (n == vf::L) return v;
  alignas(64) float b[vf::L];
  vstore(b, v);
  for (int l = n; l < vf::L; ++l) b[l] = 0.0f;
  return vload(b);
}

// The backward's second term: dy * xmu, xmu = (x - head) - tail as bn_apply_backward forms it.
inline vf dy_xmu(vf d, vf x, vf mh, vf mt) { return d * ((x - mh) - mt); }

// NCHW with inner > 1: a channel is n contiguous planes of `inner` values; threads take
// channels, and each channel's planes go through its streams in one pass. Forward: sum x and
// sum x^2; backward: sum dy and sum dy*xmu.
template <bool kForward, class T, class S>
void plane_sums(const BatchNormArgs& a, const T* x, const T* dy, const S* mean,
                std::vector<ChannelSums>& sums) {
  const int64_t full = a.inner / vf::L, j0 = full * vf::L, stride = a.c * a.inner;
  const int64_t ahead = kAheadBytes / static_cast<int64_t>(sizeof(T));
  // While a plane is summed, the next plane of the channel is prefetched (kAheadBytes on from
  // the element read, wrapping into the next plane): the hardware prefetcher starts over at
  // every plane.
  auto prefetch = [&](const T* p, int64_t at, int64_t b, int64_t j) {
    const int64_t k = j + ahead;
    if (k < a.inner)
      prefetch_l2(p + at + k);
    else if (b + 1 < a.n && k - a.inner < a.inner)
      prefetch_l2(p + at + stride + (k - a.inner));
  };
#pragma omp parallel for num_threads(thread_count(a.threads, a.c)) schedule(static)
  for (int64_t ch = 0; ch < a.c; ++ch) {
    ChannelSums& s = sums[ch];
    if constexpr (kForward) {
      ExactStream<true> sx(s.s1, &s.s2, s.bad);
      for (int64_t b = 0; b < a.n; ++b) {
        const int64_t at = (b * a.c + ch) * a.inner;
        sx.add_n(full, [&](int64_t i) {
          prefetch(x, at, b, i * vf::L);
          return load_as<vf>(x + at + i * vf::L);
        });
        if (j0 < a.inner) sx.add(load_lanes(x + at + j0, static_cast<int>(a.inner - j0)));
      }
      sx.finish();
    } else {
      float mh, mt;
      split_mean(mean[ch], mh, mt);
      const vf vmh = vsplat(mh), vmt = vsplat(mt);
      ExactStream<false> sd(s.s1, nullptr, s.bad), sdx(s.t1, nullptr, s.bad);
      for (int64_t b = 0; b < a.n; ++b) {
        const int64_t at = (b * a.c + ch) * a.inner;
        exact_add_both(sd, sdx, full, [&](int64_t i) {
          const int64_t j = at + i * vf::L;
          prefetch(x, at, b, i * vf::L);
          prefetch(dy, at, b, i * vf::L);
          const vf d = load_as<vf>(dy + j);
          return Two<vf>{d, dy_xmu(d, load_as<vf>(x + j), vmh, vmt)};
        });
        if (j0 < a.inner) {
          const int n = static_cast<int>(a.inner - j0);
          const vf d = load_lanes(dy + at + j0, n);
          sd.add(d);
          sdx.add(first_lanes(dy_xmu(d, load_lanes(x + at + j0, n), vmh, vmt), n));
        }
      }
      sd.finish();
      sdx.finish();
    }
  }
}

// Rows of c channels (channels-last, or [N, C]): a stream's lane l sums channel c0 + l, so one
// pass over a row sums vf::L channels at a time, each group of vf::L channels in its own
// streams. Threads take blocks of kBlockRows rows with their own sums, added after (integers:
// the split changes nothing). Within a block the groups take turns over its rows (each group's
// lanes in registers for its turn), while the next block is prefetched a line per step, so
// memory is read in order.
constexpr int64_t kBlockRows = 32;

template <bool kForward, class T, class S>
void row_sums(const BatchNormArgs& a, int64_t rows, const T* x, const T* dy, const S* mean,
              std::vector<ChannelSums>& sums) {
  const int64_t c = a.c, groups = (c + vf::L - 1) / vf::L;
  std::vector<float> mh(static_cast<size_t>(c) + vf::L, 0.0f), mt(mh);
  if constexpr (!kForward)
    for (int64_t ch = 0; ch < c; ++ch) split_mean(mean[ch], mh[ch], mt[ch]);
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  const int nt = thread_count(a.threads, blocks);
  std::vector<std::vector<ChannelSums>> part(nt, std::vector<ChannelSums>(c));
  using First = ExactStream<kForward, true>;
  using Second = ExactStream<false, true>;
#pragma omp parallel num_threads(nt)
  {
    std::vector<ChannelSums>& mine = part[omp_get_thread_num()];
    std::vector<std::unique_ptr<First>> first(groups);
    std::vector<std::unique_ptr<Second>> second(kForward ? 0 : groups);
    for (int64_t g = 0; g < groups; ++g) {
      const int w = static_cast<int>(std::min<int64_t>(vf::L, c - g * vf::L));
      ExactTarget to1[vf::L], to2[vf::L];
      for (int l = 0; l < w; ++l) {
        ChannelSums& s = mine[g * vf::L + l];
        to1[l] = {&s.s1, kForward ? &s.s2 : nullptr, &s.bad};
        to2[l] = {&s.t1, nullptr, &s.bad};
      }
      first[g] = std::make_unique<First>(to1, w);
      if constexpr (!kForward) second[g] = std::make_unique<Second>(to2, w);
    }
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));  // elements a cache line
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t r0 = blk * kBlockRows, nr = std::min(rows, r0 + kBlockRows) - r0;
      // The next block's lines, one per step (steps >= lines when c fills its vectors).
      const int64_t next = std::min(rows, r0 + nr + kBlockRows) * c, from = (r0 + nr) * c;
      int64_t line = from;
      auto prefetch_next = [&] {
        if (line < next) {
          prefetch_l2(x + line);
          if (!kForward) prefetch_l2(dy + line);
          line += kLine;
        }
      };
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * vf::L;
        const int w = static_cast<int>(std::min<int64_t>(vf::L, c - c0));
        const T* xb = x + r0 * c + c0;
        First& sx = *first[g];
        if constexpr (kForward) {
          sx.add_n(nr, [&](int64_t i) {
            prefetch_next();
            return load_lanes(xb + i * c, w);
          });
        } else {
          const T* dyb = dy + r0 * c + c0;
          const vf vmh = vload(mh.data() + c0), vmt = vload(mt.data() + c0);  // 0 past c
          exact_add_both(sx, *second[g], nr, [&](int64_t i) {
            prefetch_next();
            const vf d = load_lanes(dyb + i * c, w);
            return Two<vf>{d, first_lanes(dy_xmu(d, load_lanes(xb + i * c, w), vmh, vmt), w)};
          });
        }
      }
    }
    for (auto& f : first) f->finish();
    for (auto& f : second) f->finish();
  }
  for (const std::vector<ChannelSums>& p : part)
    for (int64_t ch = 0; ch < c; ++ch) sums[ch].add(p[ch]);
}

// sums[ch] for this rank's elements, in the layout's loop.
template <bool kForward, class T, class S>
std::vector<ChannelSums> channel_sums(const BatchNormArgs& a, const T* x, const T* dy,
                                      const S* mean) {
  std::vector<ChannelSums> sums(static_cast<size_t>(a.c));
  if (a.channels_last || a.inner == 1)
    row_sums<kForward>(a, a.channels_last ? a.n * a.inner : a.n, x, dy, mean, sums);
  else
    plane_sums<kForward>(a, x, dy, mean, sums);
  return sums;
}

void pack(const BatchNormArgs& a, bool forward, const std::vector<ChannelSums>& sums,
          int64_t* limbs) {
  const int k = exact::moment_limbs(forward);
  for (int64_t ch = 0; ch < a.c; ++ch) {
    int64_t* out = limbs + ch * k;
    out[0] = sums[ch].bad;
    exact::pack(sums[ch].s1, out + 1, exact::kLimbs1);
    if (forward)
      exact::pack(sums[ch].s2, out + 1 + exact::kLimbs1, exact::kLimbs2);
    else
      exact::pack(sums[ch].t1, out + 1 + exact::kLimbs1, exact::kLimbs1);
  }
}

}  // namespace

template <class T>
void bn_exact_partial_forward(const BatchNormArgs& a, const T* x, int64_t* limbs) {
  pack(a, true,
       channel_sums<true>(a, x, static_cast<const T*>(nullptr), static_cast<const float*>(nullptr)),
       limbs);
}

template <class T, class S>
void bn_exact_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean,
                               int64_t* limbs) {
  pack(a, false, channel_sums<false>(a, x, dy, mean), limbs);
}

void bn_exact_moments(int64_t c, const int64_t* limbs, double n, double* mean, double* var) {
  const int k = exact::moment_limbs(true);
  const auto count = static_cast<uint64_t>(n);
  for (int64_t ch = 0; ch < c; ++ch) {
    const int64_t* in = limbs + ch * k;
    if (in[0] != 0 || count == 0) {
      mean[ch] = var[ch] = in[0] != 0 ? std::numeric_limits<double>::quiet_NaN() : 0.0;
      continue;
    }
    const exact::Sum1 s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
    const exact::Sum2 s2 = exact::unpack<8>(in + 1 + exact::kLimbs1, exact::kLimbs2);
    mean[ch] = exact::mean(s1, count);
    var[ch] = exact::variance(s1, s2, count);
  }
}

void bn_exact_backward_sums(int64_t c, const int64_t* limbs, double d, double* sums) {
  const int k = exact::moment_limbs(false);
  const auto div = static_cast<uint64_t>(d);
  for (int64_t ch = 0; ch < c; ++ch) {
    const int64_t* in = limbs + ch * k;
    if (in[0] != 0 || div == 0) {
      sums[2 * ch] = sums[2 * ch + 1] = in[0] != 0 ? std::numeric_limits<double>::quiet_NaN() : 0.0;
      continue;
    }
    sums[2 * ch] = exact::mean(exact::unpack<4>(in + 1, exact::kLimbs1), div);
    sums[2 * ch + 1] = exact::mean(exact::unpack<4>(in + 1 + exact::kLimbs1, exact::kLimbs1), div);
  }
}

#define TPNORM_EXACT_BN_S(T, S)                                                           \
  template void bn_exact_partial_backward<T, S>(const BatchNormArgs&, const T*, const T*, \
                                                const S*, int64_t*);
#define TPNORM_EXACT_BN(T)                                                             \
  template void bn_exact_partial_forward<T>(const BatchNormArgs&, const T*, int64_t*); \
  TPNORM_EXACT_BN_S(T, float) TPNORM_EXACT_BN_S(T, double)
TPNORM_FOR_EACH_STORAGE(TPNORM_EXACT_BN)

}  // namespace tpnorm::kernels::cpu
