// exact_groups.cpp — CPU kernels of Stats::kExact for GroupNorm / InstanceNorm; see
// exact_groups.h. Threads take slots (forward) or local channels (the backward's dgamma/dbeta);
// sums are exact integers, so neither the split nor the threads change a bit.
#include "kernels/cpu/exact_groups.h"

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

constexpr int64_t kPiece = 2048;  // float32 values formed at a time

// This rank's local channels of group g: [lo, hi) (empty when it holds none of them).
inline void local_channels(const GroupNormArgs& a, int64_t g, int64_t& lo, int64_t& hi) {
  lo = std::max<int64_t>(g * a.cpg - a.c0, 0);
  hi = std::min<int64_t>((g + 1) * a.cpg - a.c0, a.c_local);
}

// Adds n float32 values made by fill(j0, n, buf) (in pieces) to s1 (and s2 when not null).
template <class Fill>
void pieces(int64_t n, exact::Sum1& s1, exact::Sum2* s2, int64_t& bad, Fill fill) {
  alignas(64) float buf[kPiece];
  for (int64_t j0 = 0; j0 < n; j0 += kPiece) {
    const int64_t m = std::min(kPiece, n - j0);
    fill(j0, m, buf);
    exact_accumulate(buf, m, s1, s2, bad);
  }
}

}  // namespace

template <class T>
void group_exact_partial_forward(const GroupNormArgs& a, const T* x, int64_t* limbs) {
  const int k = exact::moment_limbs(true);
  const int64_t slots = a.n * a.groups;
#pragma omp parallel for num_threads(thread_count(a.threads, slots)) schedule(static)
  for (int64_t s = 0; s < slots; ++s) {
    int64_t lo, hi;
    local_channels(a, s % a.groups, lo, hi);
    exact::Sum1 s1;
    exact::Sum2 s2;
    int64_t bad = 0;
    if (hi > lo) {
      const T* run = x + ((s / a.groups) * a.c_local + lo) * a.spatial;
      const int64_t n = (hi - lo) * a.spatial;
      if constexpr (std::is_same_v<T, float>)
        exact_accumulate(run, n, s1, &s2, bad);
      else
        pieces(n, s1, &s2, bad, [&](int64_t j0, int64_t m, float* buf) {
          for (int64_t j = 0; j < m; ++j) buf[j] = to_float(run[j0 + j]);
        });
    }
    int64_t* out = limbs + s * k;
    out[0] = bad;
    exact::pack(s1, out + 1, exact::kLimbs1);
    exact::pack(s2, out + 1 + exact::kLimbs1, exact::kLimbs2);
  }
}

template <class T, class S>
void group_exact_partial_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                                  const S* mean, const S* rstd, int64_t* limbs, double* dparams) {
  const int k = exact::moment_limbs(false);
  // The terms of local channel c of sample b: g = dy*gamma[c], g*xhat (which = 0), or dy*xhat,
  // dy (which = 1, for dgamma / dbeta), as float32.
  auto plane_terms = [&](int64_t b, int64_t c, int which, int64_t j0, int64_t m, float* buf) {
    const int64_t slot = b * a.groups + (a.c0 + c) / a.cpg;
    float mh, mt;
    split_mean(mean[slot], mh, mt);
    const float rs = static_cast<float>(rstd[slot]);
    const float gm = gamma ? to_float(gamma[c]) : 1.0f;
    const T* xr = x + (b * a.c_local + c) * a.spatial + j0;
    const T* dyr = dy + (b * a.c_local + c) * a.spatial + j0;
    for (int64_t j = 0; j < m; ++j) {
      const float xhat = ((to_float(xr[j]) - mh) - mt) * rs;
      const float d = to_float(dyr[j]);
      if (which == 0)
        buf[j] = gm * d, buf[kPiece + j] = (gm * d) * xhat;
      else
        buf[j] = d * xhat, buf[kPiece + j] = d;
    }
  };
  // Two sums of one plane's terms into (s, t).
  auto plane_sums = [&](int64_t b, int64_t c, int which, exact::Sum1& s, exact::Sum1& t,
                        int64_t& bad) {
    alignas(64) float buf[2 * kPiece];
    for (int64_t j0 = 0; j0 < a.spatial; j0 += kPiece) {
      const int64_t m = std::min(kPiece, a.spatial - j0);
      plane_terms(b, c, which, j0, m, buf);
      exact_accumulate(buf, m, s, nullptr, bad);
      exact_accumulate(buf + kPiece, m, t, nullptr, bad);
    }
  };
  const int64_t slots = a.n * a.groups;
#pragma omp parallel for num_threads(thread_count(a.threads, slots)) schedule(static)
  for (int64_t s = 0; s < slots; ++s) {
    int64_t lo, hi;
    local_channels(a, s % a.groups, lo, hi);
    exact::Sum1 sg, sgx;
    int64_t bad = 0;
    for (int64_t c = lo; c < hi; ++c) plane_sums(s / a.groups, c, 0, sg, sgx, bad);
    int64_t* out = limbs + s * k;
    out[0] = bad;
    exact::pack(sg, out + 1, exact::kLimbs1);
    exact::pack(sgx, out + 1 + exact::kLimbs1, exact::kLimbs1);
  }
#pragma omp parallel for num_threads(thread_count(a.threads, a.c_local)) schedule(static)
  for (int64_t c = 0; c < a.c_local; ++c) {
    exact::Sum1 sdx, sd;
    int64_t bad = 0;
    for (int64_t b = 0; b < a.n; ++b) plane_sums(b, c, 1, sdx, sd, bad);
    const double nan = std::numeric_limits<double>::quiet_NaN();
    dparams[c] = bad ? nan : exact::mean(sdx, 1);
    dparams[a.c_local + c] = bad ? nan : exact::mean(sd, 1);
  }
}

void exact_group_finish(const GroupNormArgs& a, bool forward, const int64_t* limbs, double count,
                        double* stats) {
  const int k = exact::moment_limbs(forward);
  const auto n = static_cast<uint64_t>(count);
  for (int64_t s = 0; s < a.n * a.groups; ++s) {
    const int64_t* in = limbs + s * k;
    double* st = stats + 2 * s;
    if (in[0] != 0 || n == 0) {
      st[0] = st[1] = in[0] != 0 ? std::numeric_limits<double>::quiet_NaN() : 0.0;
      continue;
    }
    const exact::Sum1 s1 = exact::unpack<4>(in + 1, exact::kLimbs1);
    if (forward) {
      st[0] = exact::mean(s1, n);
      st[1] = exact::variance(s1, exact::unpack<8>(in + 1 + exact::kLimbs1, exact::kLimbs2), n);
    } else {
      st[0] = exact::mean(s1, n);
      st[1] = exact::mean(exact::unpack<4>(in + 1 + exact::kLimbs1, exact::kLimbs1), n);
    }
  }
}

#define TPNORM_EXACT_GROUP_S(T, S)                  \
  template void group_exact_partial_backward<T, S>( \
      const GroupNormArgs&, const T*, const T*, const T*, const S*, const S*, int64_t*, double*);
#define TPNORM_EXACT_GROUP(T)                                                             \
  template void group_exact_partial_forward<T>(const GroupNormArgs&, const T*, int64_t*); \
  TPNORM_EXACT_GROUP_S(T, float) TPNORM_EXACT_GROUP_S(T, double)
TPNORM_FOR_EACH_STORAGE(TPNORM_EXACT_GROUP)

}  // namespace tpnorm::kernels::cpu
