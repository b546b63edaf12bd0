// exact_channels.cpp — CPU kernels of Stats::kExact for SyncBatchNorm; see exact_channels.h.
//
// NCHW: a channel is n contiguous runs of `inner` values; threads take channels and sum each
// run through exact_accumulate. Channels-last: threads take blocks of rows, transpose a block
// into one contiguous run per channel and sum those; the threads' integers are then added.
// Integer sums: the split into threads, blocks and runs changes nothing.
#include "kernels/cpu/exact_channels.h"

#include <omp.h>

#include <algorithm>
#include <limits>
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

// Values of one channel gathered as float32 at a time (per thread).
constexpr int64_t kRun = 2048;

// sums[ch] += the terms of channel ch: values(ch, i0, n, out) writes n float32 values of the
// channel, from its i0-th element on (elements in the order of the layout: sample-major), into
// out; `forward` sums values and squares, else two value streams (values writes 2 runs).
template <class Values>
void channel_exact_sums(const BatchNormArgs& a, bool forward, std::vector<ChannelSums>& sums,
                        Values values) {
  const int64_t per = a.n * a.inner;  // elements of a channel on this rank
  auto run = [&](ChannelSums& s, int64_t ch, int64_t i0, int64_t n, float* buf) {
    values(ch, i0, n, buf);
    if (forward) {
      exact_accumulate(buf, n, s.s1, &s.s2, s.bad);
    } else {
      exact_accumulate(buf, n, s.s1, nullptr, s.bad);
      exact_accumulate(buf + kRun, n, s.t1, nullptr, s.bad);
    }
  };
  const int nt = thread_count(a.threads, a.c);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(2 * kRun);
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < a.c; ++ch)
      for (int64_t i0 = 0; i0 < per; i0 += kRun)
        run(sums[ch], ch, i0, std::min(kRun, per - i0), buf.data());
  }
}

// The element offset of channel ch's i-th element (sample-major).
inline int64_t offset(const BatchNormArgs& a, int64_t ch, int64_t i) {
  const int64_t b = i / a.inner, s = i % a.inner;
  return a.channels_last ? (b * a.inner + s) * a.c + ch : (b * a.c + ch) * a.inner + s;
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
  std::vector<ChannelSums> sums(static_cast<size_t>(a.c));
  channel_exact_sums(a, true, sums, [&](int64_t ch, int64_t i0, int64_t n, float* out) {
    if (!a.channels_last) {  // runs of `inner` contiguous values
      for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[offset(a, ch, i0 + i)]);
      return;
    }
    for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[(i0 + i) * a.c + ch]);
  });
  pack(a, true, sums, limbs);
}

template <class T, class S>
void bn_exact_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean,
                               int64_t* limbs) {
  std::vector<ChannelSums> sums(static_cast<size_t>(a.c));
  channel_exact_sums(a, false, sums, [&](int64_t ch, int64_t i0, int64_t n, float* out) {
    float mh, mt;
    split_mean(mean[ch], mh, mt);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = offset(a, ch, i0 + i);
      const float d = to_float(dy[at]);
      out[i] = d;
      out[kRun + i] = d * ((to_float(x[at]) - mh) - mt);
    }
  });
  pack(a, false, sums, limbs);
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
