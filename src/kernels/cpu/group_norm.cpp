// group_norm.cpp — see group_norm.h.
//
// The partials are the row kernels' over each (sample, channel) plane; the apply loops are
// write_row (loops.h) over each plane with its group's constants. Element work is float32 like
// the row kernels; x - mean uses the same exact head + tail split of the mean (split_mean), so
// xhat keeps float accuracy when |mean| >> std.
#include "kernels/cpu/group_norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/instantiate.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/row_norm.h"

namespace tpnorm::kernels::cpu {
namespace {

// Group slot of plane r = (sample, local channel).
inline int64_t slot(const GroupNormArgs& a, int64_t r) {
  return (r / a.c_local) * a.groups + (a.c0 + r % a.c_local) / a.cpg;
}

// body(o, k, c, mh, mt) for every plane in parallel: o its first element, k its group slot,
// c its local channel, mh + mt the split of its group's mean.
template <class S, class Body>
void for_each_plane(const GroupNormArgs& a, const S* mean, Body body) {
  const int64_t planes = a.n * a.c_local;
#pragma omp parallel for num_threads(thread_count(a.threads, planes)) schedule(static)
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t k = slot(a, r);
    float mh, mt;
    split_mean(mean[k], mh, mt);
    body(r * a.spatial, k, r % a.c_local, mh, mt);
  }
}

// mean / rstd of every plane, from the per-group ones: the row kernels take them per row.
template <class S>
void per_plane(const GroupNormArgs& a, const S* group, std::vector<S>& plane) {
  plane.resize(static_cast<size_t>(a.n * a.c_local));
  for (int64_t r = 0; r < a.n * a.c_local; ++r) plane[r] = group[slot(a, r)];
}

}  // namespace

template <class T, class W>
void group_partial_forward(const GroupNormArgs& a, const T* x, W* stats) {
  const int64_t planes = a.n * a.c_local;
  std::vector<W> rows(static_cast<size_t>(planes * 2));
  row_partial_forward<T, W>({planes, a.spatial, true, a.threads}, x, rows.data());
  for (int64_t r = 0; r < planes; ++r) {  // serial: planes of one group are added in order
    stats[2 * slot(a, r)] += rows[2 * r];
    stats[2 * slot(a, r) + 1] += rows[2 * r + 1];
  }
}

template <class T, class W, class S>
void group_apply_forward(const GroupNormArgs& a, const T* x, const T* gamma, const T* beta,
                         const W* stats, double count, double eps, T* y, S* mean, S* rstd) {
  const int64_t ng = a.n * a.groups;
  std::vector<double> mu(static_cast<size_t>(ng), 0.0), rs(static_cast<size_t>(ng));
  for (int64_t k = 0; k < ng; ++k) {
    double var = 0;
    if (a.final_stats) {
      mu[k] = static_cast<double>(stats[2 * k]);
      var = static_cast<double>(stats[2 * k + 1]);
    } else if (count > 0) {
      mu[k] = static_cast<double>(stats[2 * k]) / count;
      var = std::max(static_cast<double>(stats[2 * k + 1]) / count - mu[k] * mu[k], 0.0);
    }
    rs[k] = 1.0 / std::sqrt(var + eps);
    if (mean) mean[k] = static_cast<S>(mu[k]);
    if (rstd) rstd[k] = static_cast<S>(rs[k]);
  }
  const T* none = nullptr;
  for_each_plane(a, mu.data(), [&](int64_t o, int64_t k, int64_t c, float mh, float mt) {
    const float s = static_cast<float>(rs[k]) * (gamma ? to_float(gamma[c]) : 1.0f);
    const float b = beta ? to_float(beta[c]) : 0.0f;
    const T* xr = x + o;
    write_row(y + o, a.spatial, false, none, none, [=](int64_t j, auto tag) {
      using V = decltype(tag);
      return fmadd((load_as<V>(xr + j) - splat<V>(mh)) - splat<V>(mt), splat<V>(s), splat<V>(b));
    });
  });
}

template <class T, class W, class S>
void group_partial_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                            const S* mean, const S* rstd, W* stats, double* dparams) {
  const int64_t planes = a.n * a.c_local;
  std::vector<S> pm, pr;
  per_plane(a, mean, pm);
  per_plane(a, rstd, pr);
  // Per plane {sum dy, sum dy*xhat} (gamma left out: it is constant over the plane).
  std::vector<W> rows(static_cast<size_t>(planes * 2));
  row_partial_backward<T, T, W, S>({planes, a.spatial, true, a.threads}, dy, x, nullptr, pm.data(),
                                   pr.data(), rows.data());
  std::fill(dparams, dparams + 2 * a.c_local, 0.0);
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t c = r % a.c_local;
    const W g = gamma ? static_cast<W>(to_float(gamma[c])) : W(1);
    stats[2 * slot(a, r)] += g * rows[2 * r];
    stats[2 * slot(a, r) + 1] += g * rows[2 * r + 1];
    dparams[c] += static_cast<double>(rows[2 * r + 1]);
    dparams[a.c_local + c] += static_cast<double>(rows[2 * r]);
  }
}

template <class T, class W, class S>
void group_apply_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                          const S* mean, const S* rstd, const W* stats, double count,
                          const double* dparams, T* dx, T* dgamma, T* dbeta) {
  const T* none = nullptr;
  for_each_plane(a, mean, [&](int64_t o, int64_t k, int64_t c, float mh, float mt) {
    const float rs = static_cast<float>(rstd[k]);
    const float c1 = static_cast<float>(static_cast<double>(stats[2 * k]) / count);
    const float c2 = static_cast<float>(static_cast<double>(stats[2 * k + 1]) / count);
    const float gm = gamma ? to_float(gamma[c]) : 1.0f;
    const T* xr = x + o;
    const T* dyr = dy + o;
    write_row(dx + o, a.spatial, false, none, none, [=](int64_t j, auto tag) {
      using V = decltype(tag);
      const V xhat = ((load_as<V>(xr + j) - splat<V>(mh)) - splat<V>(mt)) * splat<V>(rs);
      return splat<V>(rs) *
             ((splat<V>(gm) * load_as<V>(dyr + j) - splat<V>(c1)) - xhat * splat<V>(c2));
    });
  });
  for (int64_t c = 0; c < a.c_local; ++c) {
    if (dgamma) dgamma[c] = from_float<T>(static_cast<float>(dparams[c]));
    if (dbeta) dbeta[c] = from_float<T>(static_cast<float>(dparams[a.c_local + c]));
  }
}

#define TPNORM_GROUP_W(T, W) \
  template void group_partial_forward<T, W>(const GroupNormArgs&, const T*, W*);
#define TPNORM_GROUP_WS(T, W, S)                                                                   \
  template void group_apply_forward<T, W, S>(const GroupNormArgs&, const T*, const T*, const T*,   \
                                             const W*, double, double, T*, S*, S*);                \
  template void group_partial_backward<T, W, S>(const GroupNormArgs&, const T*, const T*,          \
                                                const T*, const S*, const S*, W*, double*);        \
  template void group_apply_backward<T, W, S>(const GroupNormArgs&, const T*, const T*, const T*,  \
                                              const S*, const S*, const W*, double, const double*, \
                                              T*, T*, T*);
#define TPNORM_GROUP(T) TPNORM_FOR_EACH_W(TPNORM_GROUP_W, T) TPNORM_FOR_EACH_WS(TPNORM_GROUP_WS, T)
TPNORM_FOR_EACH_STORAGE(TPNORM_GROUP)

}  // namespace tpnorm::kernels::cpu
