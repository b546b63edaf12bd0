// batch_norm.cpp — CPU kernels for SyncBatchNorm; see batch_norm.h.
//
// Two traversals serve every kernel: NCHW walks one channel's n runs of `inner` contiguous
// values (threads over channels); channels-last walks rows of c channels (threads over rows,
// per-thread per-channel accumulators added in a fixed order, so results are deterministic for
// a thread count). Element work is float32; statistics are W (double in the robust mode).
// x - mean is formed as (x - head) - tail with mean = head + tail split into floats, as in
// row_norm.cpp, so xhat keeps float accuracy when |mean| >> std.
#include "kernels/cpu/batch_norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/half.h"

namespace tpnorm::kernels::cpu {
namespace {

int thread_count(const BatchNormArgs& a, int64_t work) {
  const int t = a.threads > 0 ? a.threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, work)));
}

// Calls f(i, ch) for every element i of channel ch, in parallel.
template <class F>
void for_each_element(const BatchNormArgs& a, F f) {
  const int64_t c = a.c, inner = a.inner;
  if (!a.channels_last) {
    const int64_t blocks = a.n * c;
#pragma omp parallel for num_threads(thread_count(a, blocks)) schedule(static)
    for (int64_t bc = 0; bc < blocks; ++bc)
      for (int64_t s = 0; s < inner; ++s) f(bc * inner + s, bc % c);
  } else {
    const int64_t rows = a.n * inner;
#pragma omp parallel for num_threads(thread_count(a, rows)) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t ch = 0; ch < c; ++ch) f(r * c + ch, ch);
  }
}

// out[2ch], out[2ch+1] = the two sums that f(i, ch, s1, s2) adds over channel ch's elements.
template <class A, class F>
void channel_sums(const BatchNormArgs& a, A* out, F f) {
  const int64_t c = a.c, inner = a.inner;
  if (!a.channels_last) {
#pragma omp parallel for num_threads(thread_count(a, c)) schedule(static)
    for (int64_t ch = 0; ch < c; ++ch) {
      A s1 = 0, s2 = 0;
      for (int64_t b = 0; b < a.n; ++b)
        for (int64_t s = 0; s < inner; ++s) f((b * c + ch) * inner + s, ch, s1, s2);
      out[2 * ch] = s1;
      out[2 * ch + 1] = s2;
    }
    return;
  }
  const int64_t rows = a.n * inner;
  const int nt = thread_count(a, rows);
  std::vector<A> acc(static_cast<size_t>(nt) * 2 * c, A(0));
#pragma omp parallel num_threads(nt)
  {
    A* s1 = acc.data() + static_cast<size_t>(omp_get_thread_num()) * 2 * c;
    A* s2 = s1 + c;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t ch = 0; ch < c; ++ch) f(r * c + ch, ch, s1[ch], s2[ch]);
  }
  for (int64_t ch = 0; ch < c; ++ch) {
    A s1 = 0, s2 = 0;
    for (int t = 0; t < nt; ++t) {
      s1 += acc[static_cast<size_t>(t) * 2 * c + ch];
      s2 += acc[static_cast<size_t>(t) * 2 * c + c + ch];
    }
    out[2 * ch] = s1;
    out[2 * ch + 1] = s2;
  }
}

// The exact split of a mean into float head + float tail.
template <class S>
void split_means(int64_t c, const S* mean, std::vector<float>& head, std::vector<float>& tail) {
  head.resize(c);
  tail.resize(c);
  for (int64_t ch = 0; ch < c; ++ch) {
    head[ch] = static_cast<float>(mean[ch]);
    tail[ch] = static_cast<float>(static_cast<double>(mean[ch]) - head[ch]);
  }
}

}  // namespace

template <class T, class W>
void bn_partial_forward(const BatchNormArgs& a, const T* x, W* stats) {
  // Robust: sums of d = x - pivot in double, shifted back exactly enough. Naive: pivot 0.
  std::vector<W> pivot(a.c, W(0));
  const int64_t m = a.n * a.inner;
  if (std::is_same_v<W, double> && m > 0)
    for (int64_t ch = 0; ch < a.c; ++ch)
      pivot[ch] = to_float(x[a.channels_last ? ch : ch * a.inner]);
  channel_sums<W>(a, stats, [&](int64_t i, int64_t ch, W& s1, W& s2) {
    const W d = static_cast<W>(to_float(x[i])) - pivot[ch];
    s1 += d;
    s2 += d * d;
  });
  for (int64_t ch = 0; ch < a.c; ++ch) {
    const W p = pivot[ch], d1 = stats[2 * ch], d2 = stats[2 * ch + 1];
    stats[2 * ch] = p * static_cast<W>(m) + d1;
    stats[2 * ch + 1] = d2 + 2 * p * d1 + p * p * static_cast<W>(m);
  }
}

template <class W>
void bn_moments(int64_t c, const W* stats, double n, double* mean, double* var) {
  for (int64_t ch = 0; ch < c; ++ch) {
    const double mu = static_cast<double>(stats[2 * ch]) / n;
    const double v = static_cast<double>(stats[2 * ch + 1]) / n - mu * mu;
    mean[ch] = mu;
    var[ch] = v > 0 ? v : 0.0;
  }
}

template <class T, class S>
void bn_apply_forward(const BatchNormArgs& a, const T* x, const T* gamma, const T* beta,
                      const S* mean, const S* invstd, T* y) {
  std::vector<float> mh, mt, scale(a.c), shift(a.c);
  split_means(a.c, mean, mh, mt);
  for (int64_t ch = 0; ch < a.c; ++ch) {
    scale[ch] = static_cast<float>(invstd[ch]) * (gamma ? to_float(gamma[ch]) : 1.0f);
    shift[ch] = beta ? to_float(beta[ch]) : 0.0f;
  }
  for_each_element(a, [&](int64_t i, int64_t ch) {
    y[i] = from_float<T>(((to_float(x[i]) - mh[ch]) - mt[ch]) * scale[ch] + shift[ch]);
  });
}

template <class T, class W, class S>
void bn_partial_backward(const BatchNormArgs& a, const T* dy, const T* x, const S* mean,
                         W* stats) {
  std::vector<float> mh, mt;
  split_means(a.c, mean, mh, mt);
  channel_sums<W>(a, stats, [&](int64_t i, int64_t ch, W& sdy, W& sdyx) {
    const float d = to_float(dy[i]);
    sdy += d;
    sdyx += static_cast<W>(d * ((to_float(x[i]) - mh[ch]) - mt[ch]));
  });
}

template <class T, class W, class S>
void bn_apply_backward(const BatchNormArgs& a, const T* dy, const T* x, const T* gamma,
                       const S* mean, const S* invstd, const W* stats, double n, T* dx) {
  std::vector<float> mh, mt, k(a.c), c1(a.c), c2(a.c);
  split_means(a.c, mean, mh, mt);
  for (int64_t ch = 0; ch < a.c; ++ch) {
    const double is = static_cast<double>(invstd[ch]);
    k[ch] = static_cast<float>(is * (gamma ? to_float(gamma[ch]) : 1.0f));
    c1[ch] = n > 0 ? static_cast<float>(static_cast<double>(stats[2 * ch]) / n) : 0.0f;
    c2[ch] = n > 0 ? static_cast<float>(is * is * static_cast<double>(stats[2 * ch + 1]) / n)
                   : 0.0f;
  }
  for_each_element(a, [&](int64_t i, int64_t ch) {
    const float xc = (to_float(x[i]) - mh[ch]) - mt[ch];
    dx[i] = from_float<T>(k[ch] * (to_float(dy[i]) - c1[ch] - xc * c2[ch]));
  });
}

template <class T, class W, class S>
void bn_param_grads(int64_t c, const W* local_stats, const S* invstd, T* dgamma, T* dbeta) {
  for (int64_t ch = 0; ch < c; ++ch) {
    if (dgamma)
      dgamma[ch] = from_float<T>(static_cast<float>(static_cast<double>(invstd[ch]) *
                                                    static_cast<double>(local_stats[2 * ch + 1])));
    if (dbeta) dbeta[ch] = from_float<T>(static_cast<float>(local_stats[2 * ch]));
  }
}

#define TPNORM_BN_INSTANTIATE_WS(T, W, S)                                                       \
  template void bn_partial_backward<T, W, S>(const BatchNormArgs&, const T*, const T*,         \
                                             const S*, W*);                                    \
  template void bn_apply_backward<T, W, S>(const BatchNormArgs&, const T*, const T*, const T*, \
                                           const S*, const S*, const W*, double, T*);          \
  template void bn_param_grads<T, W, S>(int64_t, const W*, const S*, T*, T*);
#define TPNORM_BN_INSTANTIATE(T)                                                           \
  template void bn_partial_forward<T, float>(const BatchNormArgs&, const T*, float*);     \
  template void bn_partial_forward<T, double>(const BatchNormArgs&, const T*, double*);   \
  template void bn_apply_forward<T, float>(const BatchNormArgs&, const T*, const T*,      \
                                           const T*, const float*, const float*, T*);     \
  template void bn_apply_forward<T, double>(const BatchNormArgs&, const T*, const T*,     \
                                            const T*, const double*, const double*, T*);  \
  TPNORM_BN_INSTANTIATE_WS(T, float, float)                                               \
  TPNORM_BN_INSTANTIATE_WS(T, float, double)                                              \
  TPNORM_BN_INSTANTIATE_WS(T, double, float)                                              \
  TPNORM_BN_INSTANTIATE_WS(T, double, double)

template void bn_moments<float>(int64_t, const float*, double, double*, double*);
template void bn_moments<double>(int64_t, const double*, double, double*, double*);
TPNORM_BN_INSTANTIATE(float)
TPNORM_BN_INSTANTIATE(f16)
TPNORM_BN_INSTANTIATE(bf16)

}  // namespace tpnorm::kernels::cpu
