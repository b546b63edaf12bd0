// float64.cpp — the CPU kernels for float64 storage (x, y, dy, dx, residuals, gamma, beta and
// their gradients in double): plain double loops, every sum and every element formula in
// double, declared as explicit specializations in the kernel headers (T = double).
//
// Why not the float32-lane kernels with T = double: those sum in float32 vectors and form xhat
// from a float split of the mean, which is what makes fp32 fast and what
// torch.autograd.gradcheck's finite differences cannot afford (a perturbation of 1e-6 drowns in
// float32 rounding). float64 storage is for checking gradients and reference work, not the hot
// path, so these loops are scalar and threaded over rows, planes or channels. Each kernel keeps
// the contract of its header: the stats layout, the one-rank fused forms (a.fused), the chunk
// arguments (param_acc / param_last / params_in_partial, c_begin / c_end). Stats::kExact is not
// run here (the ops refuse it for float64 before any kernel runs), so final_stats never is set.
// Robust sums are taken around a pivot (the mean of the first kPivotSpan values, as
// common/pivot.h's rule) and shifted back, as the float kernels do.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/pivot.h"
#include "kernels/cpu/batch_norm.h"
#include "kernels/cpu/group_norm.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/residual.h"
#include "kernels/cpu/row_norm.h"

namespace tpnorm::kernels::cpu {
namespace {

// The pivot of n values value(i): their first kPivotSpan values' mean, summed around the first.
template <class Value>
double pivot_of(int64_t n, Value value) {
  const int64_t m = std::min<int64_t>(n, detail::kPivotSpan);
  if (m == 0) return 0.0;
  const double v0 = value(0);
  double s = 0;
  for (int64_t i = 0; i < m; ++i) s += value(i) - v0;
  return v0 + s / static_cast<double>(m);
}

// {sum x, sum x^2} of n values value(i) around their pivot, shifted back.
template <class Value>
void pivoted_sums(int64_t n, Value value, double& s1, double& s2) {
  const double p = pivot_of(n, value);
  double d1 = 0, d2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = value(i) - p;
    d1 += d;
    d2 += d * d;
  }
  const double m = static_cast<double>(n);
  s1 = p * m + d1;
  s2 = d2 + 2.0 * p * d1 + p * p * m;
}

// --- row norms ------------------------------------------------------------------------------

// One row's forward partial: centred {sum x, sum x^2} or RMS {sum x^2} into st.
template <class W>
void row_sums(const RowNormArgs& a, const double* xr, W* st) {
  double s1 = 0, s2 = 0;
  if (a.centered) {
    pivoted_sums(a.h, [=](int64_t j) { return xr[j]; }, s1, s2);
    st[0] = static_cast<W>(s1);
    st[1] = static_cast<W>(s2);
  } else {
    for (int64_t j = 0; j < a.h; ++j) s2 += xr[j] * xr[j];
    st[0] = static_cast<W>(s2);
  }
}

// Row r's mean (0 for RMSNorm, whose mean is absent) and rstd, as doubles.
template <class S>
double row_mean(const RowNormArgs& a, const S* mean, int64_t r) {
  return a.centered ? static_cast<double>(mean[r]) : 0.0;
}

// One row's backward partial: centred {sum g, sum g*xhat} or RMS {sum g*xhat}, g = dy*gamma.
template <class W>
void row_backward_sums(const RowNormArgs& a, const double* dyr, const double* xr,
                       const double* gamma, double mu, double rs, W* st) {
  double sg = 0, sgx = 0;
  for (int64_t j = 0; j < a.h; ++j) {
    const double g = gamma ? dyr[j] * gamma[j] : dyr[j];
    sg += g;
    sgx += g * ((xr[j] - mu) * rs);
  }
  if (a.centered) {
    st[0] = static_cast<W>(sg);
    st[1] = static_cast<W>(sgx);
  } else {
    st[0] = static_cast<W>(sgx);
  }
}

// acc[j] += sum over rows of dy*xhat, acc[h + j] += sum of dy: dgamma / dbeta of these rows, in
// slot 0 of RowNormArgs::param_acc (the caller zeroed every slot; the others stay 0). Threads
// take columns, rows in order: the same bits at any thread count and any chunking.
template <class S>
void add_param_sums(const RowNormArgs& a, const double* dy, const double* x, const S* mean,
                    const S* rstd, double* acc) {
  const int64_t h = a.h;
#pragma omp parallel for num_threads(thread_count(a.threads, h)) schedule(static)
  for (int64_t j = 0; j < h; ++j) {
    double dg = 0, db = 0;
    for (int64_t r = 0; r < a.rows; ++r) {
      const double xhat = (x[r * h + j] - row_mean(a, mean, r)) * static_cast<double>(rstd[r]);
      dg += dy[r * h + j] * xhat;
      db += dy[r * h + j];
    }
    acc[j] += dg;
    acc[h + j] += db;
  }
}

template <class W>
void f64_row_partial_forward(const RowNormArgs& a, const double* x, W* stats) {
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) row_sums(a, x + r * a.h, stats + r * k);
}

template <class W>
void f64_residual_partial_forward(const RowNormArgs& a, const double* x, const double* f,
                                  float alpha, double* h, W* stats) {
  const int k = a.centered ? 2 : 1;
  const double al = alpha;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t o = r * a.h;
    for (int64_t j = 0; j < a.h; ++j) h[o + j] = al * x[o + j] + f[o + j];
    row_sums(a, h + o, stats + r * k);
  }
}

template <class W, class S>
void f64_row_apply_forward(const RowNormArgs& a, const double* x, const double* gamma,
                           const double* beta, W* stats, double n, double eps, double* y, S* mean,
                           S* rstd) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const double* xr = x + r * h;
    W* st = stats + r * k;
    if (a.fused) row_sums(a, xr, st);
    double mu = 0, var = 0;
    if (a.final_stats) {
      mu = a.centered ? static_cast<double>(st[0]) : 0.0;
      var = static_cast<double>(st[k - 1]);
    } else if (n > 0) {
      if (a.centered) {
        mu = static_cast<double>(st[0]) / n;
        var = std::max(static_cast<double>(st[1]) / n - mu * mu, 0.0);
      } else {
        var = static_cast<double>(st[0]) / n;
      }
    }
    const double rs = 1.0 / std::sqrt(var + eps);
    if (mean) mean[r] = static_cast<S>(mu);
    if (rstd) rstd[r] = static_cast<S>(rs);
    double* yr = y + r * h;
    for (int64_t j = 0; j < h; ++j) {
      const double xhat = (xr[j] - mu) * rs;
      yr[j] = xhat * (gamma ? gamma[j] : 1.0) + (beta ? beta[j] : 0.0);
    }
  }
}

template <class W, class S>
void f64_row_partial_backward(const RowNormArgs& a, const double* dy, const double* x,
                              const double* gamma, const S* mean, const S* rstd, W* stats) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r)
    row_backward_sums(a, dy + r * h, x + r * h, gamma, row_mean(a, mean, r),
                      static_cast<double>(rstd[r]), stats + r * k);
  if (a.params_in_partial) add_param_sums(a, dy, x, mean, rstd, a.param_acc);
}

template <class W, class S>
void f64_row_apply_backward(const RowNormArgs& a, const double* dy, const double* x,
                            const double* gamma, const S* mean, const S* rstd, W* stats, double n,
                            double* dx, double* dgamma, double* dbeta) {
  const int64_t h = a.h;
  const int k = a.centered ? 2 : 1;
  const bool params = dgamma || dbeta;
  std::vector<double> own(params && !a.param_acc ? static_cast<size_t>(2 * h) : 0, 0.0);
  double* acc = a.param_acc ? a.param_acc : own.data();
  // Before dx is written: dx may alias dy.
  if (params && !a.params_in_partial) add_param_sums(a, dy, x, mean, rstd, acc);
#pragma omp parallel for num_threads(thread_count(a.threads, a.rows)) schedule(static)
  for (int64_t r = 0; r < a.rows; ++r) {
    const double* xr = x + r * h;
    const double* dyr = dy + r * h;
    const double mu = row_mean(a, mean, r), rs = static_cast<double>(rstd[r]);
    W* st = stats + r * k;
    if (a.fused) row_backward_sums(a, dyr, xr, gamma, mu, rs, st);
    const double div = a.final_stats ? 1.0 : n;
    const double c1 = a.centered ? static_cast<double>(st[0]) / div : 0.0;
    const double c2 = static_cast<double>(st[k - 1]) / div;
    double* dxr = dx + r * h;
    for (int64_t j = 0; j < h; ++j) {
      const double xhat = (xr[j] - mu) * rs;
      const double g = gamma ? dyr[j] * gamma[j] : dyr[j];
      dxr[j] = rs * ((g - c1) - xhat * c2);
    }
  }
  if (!params || (a.param_acc && !a.param_last)) return;
  for (int64_t j = 0; j < h; ++j) {
    if (dgamma) dgamma[j] = acc[j];
    if (dbeta) dbeta[j] = acc[h + j];
  }
}

// --- GroupNorm / InstanceNorm ---------------------------------------------------------------

// Group slot of plane r = (sample, local channel), as group_norm.cpp.
inline int64_t group_slot(const GroupNormArgs& a, int64_t r) {
  return (r / a.c_local) * a.groups + (a.c0 + r % a.c_local) / a.cpg;
}

template <class W>
void f64_group_partial_forward(const GroupNormArgs& a, const double* x, W* stats) {
  const int64_t planes = a.n * a.c_local;
  std::vector<double> rows(static_cast<size_t>(planes * 2));
  f64_row_partial_forward<double>({planes, a.spatial, true, a.threads}, x, rows.data());
  for (int64_t r = 0; r < planes; ++r) {  // serial: planes of one group are added in order
    stats[2 * group_slot(a, r)] += static_cast<W>(rows[2 * r]);
    stats[2 * group_slot(a, r) + 1] += static_cast<W>(rows[2 * r + 1]);
  }
}

template <class W, class S>
void f64_group_apply_forward(const GroupNormArgs& a, const double* x, const double* gamma,
                             const double* beta, const W* stats, double count, double eps,
                             double* y, S* mean, S* rstd) {
  const int64_t ng = a.n * a.groups, planes = a.n * a.c_local;
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
#pragma omp parallel for num_threads(thread_count(a.threads, planes)) schedule(static)
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t k = group_slot(a, r), c = r % a.c_local;
    const double s = rs[k] * (gamma ? gamma[c] : 1.0), b = beta ? beta[c] : 0.0, m = mu[k];
    const double* xr = x + r * a.spatial;
    double* yr = y + r * a.spatial;
    for (int64_t j = 0; j < a.spatial; ++j) yr[j] = (xr[j] - m) * s + b;
  }
}

template <class W, class S>
void f64_group_partial_backward(const GroupNormArgs& a, const double* dy, const double* x,
                                const double* gamma, const S* mean, const S* rstd, W* stats,
                                double* dparams) {
  const int64_t planes = a.n * a.c_local;
  // Per plane {sum dy, sum dy*xhat} (gamma left out: it is constant over the plane).
  std::vector<double> rows(static_cast<size_t>(planes * 2));
  const RowNormArgs one{1, a.spatial, true, 1};
#pragma omp parallel for num_threads(thread_count(a.threads, planes)) schedule(static)
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t k = group_slot(a, r);
    row_backward_sums(one, dy + r * a.spatial, x + r * a.spatial, nullptr,
                      static_cast<double>(mean[k]), static_cast<double>(rstd[k]), &rows[2 * r]);
  }
  std::fill(dparams, dparams + 2 * a.c_local, 0.0);
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t c = r % a.c_local;
    const double g = gamma ? gamma[c] : 1.0;
    stats[2 * group_slot(a, r)] += static_cast<W>(g * rows[2 * r]);
    stats[2 * group_slot(a, r) + 1] += static_cast<W>(g * rows[2 * r + 1]);
    dparams[c] += rows[2 * r + 1];
    dparams[a.c_local + c] += rows[2 * r];
  }
}

template <class W, class S>
void f64_group_apply_backward(const GroupNormArgs& a, const double* dy, const double* x,
                              const double* gamma, const S* mean, const S* rstd, const W* stats,
                              double count, const double* dparams, double* dx, double* dgamma,
                              double* dbeta) {
  const int64_t planes = a.n * a.c_local;
#pragma omp parallel for num_threads(thread_count(a.threads, planes)) schedule(static)
  for (int64_t r = 0; r < planes; ++r) {
    const int64_t k = group_slot(a, r), c = r % a.c_local;
    const double m = static_cast<double>(mean[k]), rs = static_cast<double>(rstd[k]);
    const double c1 = static_cast<double>(stats[2 * k]) / count;
    const double c2 = static_cast<double>(stats[2 * k + 1]) / count;
    const double gm = gamma ? gamma[c] : 1.0;
    const double* xr = x + r * a.spatial;
    const double* dyr = dy + r * a.spatial;
    double* dxr = dx + r * a.spatial;
    for (int64_t j = 0; j < a.spatial; ++j) {
      const double xhat = (xr[j] - m) * rs;
      dxr[j] = rs * ((gm * dyr[j] - c1) - xhat * c2);
    }
  }
  for (int64_t c = 0; c < a.c_local; ++c) {
    if (dgamma) dgamma[c] = dparams[c];
    if (dbeta) dbeta[c] = dparams[a.c_local + c];
  }
}

// --- SyncBatchNorm --------------------------------------------------------------------------

// Offset of element i < n * inner of channel ch (i = b * inner + s) in either layout.
inline int64_t bn_at(const BatchNormArgs& a, int64_t ch, int64_t i) {
  const int64_t b = i / a.inner, s = i % a.inner;
  return a.channels_last ? (b * a.inner + s) * a.c + ch : (b * a.c + ch) * a.inner + s;
}

// The channels a partial or an apply covers: NCHW [c_begin, c_end), channels-last all.
inline int64_t bn_first(const BatchNormArgs& a) { return a.channels_last ? 0 : a.c_begin; }
inline int64_t bn_last(const BatchNormArgs& a) { return a.channels_last ? a.c : a.channel_end(); }

void bn_channel_sums(const BatchNormArgs& a, const double* x, int64_t ch, double& s1,
                     double& s2) {
  pivoted_sums(a.n * a.inner, [&](int64_t i) { return x[bn_at(a, ch, i)]; }, s1, s2);
}

// {sum dy, sum dy * (x - mean)} of channel ch.
void bn_backward_sums(const BatchNormArgs& a, const double* dy, const double* x, int64_t ch,
                      double mu, double& s1, double& s2) {
  s1 = s2 = 0;
  for (int64_t i = 0; i < a.n * a.inner; ++i) {
    const int64_t o = bn_at(a, ch, i);
    s1 += dy[o];
    s2 += dy[o] * (x[o] - mu);
  }
}

void bn_forward_channel(const BatchNormArgs& a, const double* x, const double* gamma,
                        const double* beta, int64_t ch, double mu, double invstd, double* y) {
  const double sc = invstd * (gamma ? gamma[ch] : 1.0), sh = beta ? beta[ch] : 0.0;
  for (int64_t i = 0; i < a.n * a.inner; ++i) {
    const int64_t o = bn_at(a, ch, i);
    y[o] = (x[o] - mu) * sc + sh;
  }
}

// dx = k * ((dy - c1) - (x - mean) * c2), k = invstd * gamma, c1 = sum dy / n,
// c2 = invstd^2 * sum dy*(x-mean) / n; n = 0: the eval backward dx = k * dy.
template <class W>
void bn_backward_channel(const BatchNormArgs& a, const double* dy, const double* x,
                         const double* gamma, int64_t ch, double mu, double is, W s1, W s2,
                         double n, double* dx) {
  const double k = is * (gamma ? gamma[ch] : 1.0);
  const double c1 = n > 0 ? static_cast<double>(s1) / n : 0.0;
  const double c2 = n > 0 ? is * is * static_cast<double>(s2) / n : 0.0;
  for (int64_t i = 0; i < a.n * a.inner; ++i) {
    const int64_t o = bn_at(a, ch, i);
    dx[o] = k * ((dy[o] - c1) - (x[o] - mu) * c2);
  }
}

template <class W>
void f64_bn_partial_forward(const BatchNormArgs& a, const double* x, W* stats) {
  const int64_t c0 = bn_first(a), c1 = bn_last(a);
#pragma omp parallel for num_threads(thread_count(a.threads, c1 - c0)) schedule(static)
  for (int64_t ch = c0; ch < c1; ++ch) {
    double s1, s2;
    bn_channel_sums(a, x, ch, s1, s2);
    stats[2 * ch] = static_cast<W>(s1);
    stats[2 * ch + 1] = static_cast<W>(s2);
  }
}

template <class S>
void f64_bn_apply_forward(const BatchNormArgs& a, const double* x, const double* gamma,
                          const double* beta, const S* mean, const S* invstd, double* y) {
  const int64_t c0 = bn_first(a), c1 = bn_last(a);
#pragma omp parallel for num_threads(thread_count(a.threads, c1 - c0)) schedule(static)
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_forward_channel(a, x, gamma, beta, ch, static_cast<double>(mean[ch]),
                       static_cast<double>(invstd[ch]), y);
}

void f64_bn_fused_forward(const BatchNormArgs& a, const double* x, const double* gamma,
                          const double* beta, double eps, double n, double* mean, double* var,
                          double* invstd, double* y) {
#pragma omp parallel for num_threads(thread_count(a.threads, a.c)) schedule(static)
  for (int64_t ch = 0; ch < a.c; ++ch) {
    double s1, s2;
    bn_channel_sums(a, x, ch, s1, s2);
    mean[ch] = s1 / n;
    var[ch] = std::max(s2 / n - mean[ch] * mean[ch], 0.0);
    invstd[ch] = 1.0 / std::sqrt(var[ch] + eps);
    bn_forward_channel(a, x, gamma, beta, ch, mean[ch], invstd[ch], y);
  }
}

template <class W, class S>
void f64_bn_partial_backward(const BatchNormArgs& a, const double* dy, const double* x,
                             const S* mean, W* stats) {
  const int64_t c0 = bn_first(a), c1 = bn_last(a);
#pragma omp parallel for num_threads(thread_count(a.threads, c1 - c0)) schedule(static)
  for (int64_t ch = c0; ch < c1; ++ch) {
    double s1, s2;
    bn_backward_sums(a, dy, x, ch, static_cast<double>(mean[ch]), s1, s2);
    stats[2 * ch] = static_cast<W>(s1);
    stats[2 * ch + 1] = static_cast<W>(s2);
  }
}

template <class W, class S>
void f64_bn_apply_backward(const BatchNormArgs& a, const double* dy, const double* x,
                           const double* gamma, const S* mean, const S* invstd, const W* stats,
                           double n, double* dx) {
  const int64_t c0 = bn_first(a), c1 = bn_last(a);
#pragma omp parallel for num_threads(thread_count(a.threads, c1 - c0)) schedule(static)
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_backward_channel(a, dy, x, gamma, ch, static_cast<double>(mean[ch]),
                        static_cast<double>(invstd[ch]), stats[2 * ch], stats[2 * ch + 1], n, dx);
}

template <class W, class S>
void f64_bn_fused_backward(const BatchNormArgs& a, const double* dy, const double* x,
                           const double* gamma, const S* mean, const S* invstd, double n, W* sums,
                           double* dx) {
#pragma omp parallel for num_threads(thread_count(a.threads, a.c)) schedule(static)
  for (int64_t ch = 0; ch < a.c; ++ch) {
    const double mu = static_cast<double>(mean[ch]);
    double s1, s2;
    bn_backward_sums(a, dy, x, ch, mu, s1, s2);
    sums[2 * ch] = static_cast<W>(s1);
    sums[2 * ch + 1] = static_cast<W>(s2);
    bn_backward_channel(a, dy, x, gamma, ch, mu, static_cast<double>(invstd[ch]), sums[2 * ch],
                        sums[2 * ch + 1], n, dx);
  }
}

}  // namespace

// --- the specializations the headers declare --------------------------------------------------

#define TPNORM_F64_W(W)                                                                           \
  template <>                                                                                     \
  void row_partial_forward<double, W>(const RowNormArgs& a, const double* x, W* stats) {          \
    f64_row_partial_forward(a, x, stats);                                                         \
  }                                                                                               \
  template <>                                                                                     \
  void residual_partial_forward<double, W>(const RowNormArgs& a, const double* x,                 \
                                           const double* f, float alpha, double* h, W* stats) {   \
    f64_residual_partial_forward(a, x, f, alpha, h, stats);                                       \
  }                                                                                               \
  template <>                                                                                     \
  void group_partial_forward<double, W>(const GroupNormArgs& a, const double* x, W* stats) {      \
    f64_group_partial_forward(a, x, stats);                                                       \
  }                                                                                               \
  template <>                                                                                     \
  void bn_partial_forward<double, W>(const BatchNormArgs& a, const double* x, W* stats) {         \
    f64_bn_partial_forward(a, x, stats);                                                          \
  }                                                                                               \
  template <>                                                                                     \
  void bn_apply_forward<double, double, W>(const BatchNormArgs& a, const double* x,               \
                                           const double* gamma, const double* beta,               \
                                           const W* mean, const W* invstd, double* y) {           \
    f64_bn_apply_forward(a, x, gamma, beta, mean, invstd, y);                                     \
  }                                                                                               \
  template <>                                                                                     \
  void bn_fused_forward<double, double, W>(const BatchNormArgs& a, const double* x,               \
                                           const double* gamma, const double* beta, double eps,   \
                                           double n, double* mean, double* var, double* invstd,   \
                                           double* y) {                                           \
    f64_bn_fused_forward(a, x, gamma, beta, eps, n, mean, var, invstd, y);                        \
  }

#define TPNORM_F64_WS(W, S)                                                                       \
  template <>                                                                                     \
  void row_apply_forward<double, double, W, S>(const RowNormArgs& a, const double* x,             \
                                               const double* gamma, const double* beta, W* stats, \
                                               double n, double eps, double* y, S* mean,          \
                                               S* rstd) {                                         \
    f64_row_apply_forward(a, x, gamma, beta, stats, n, eps, y, mean, rstd);                       \
  }                                                                                               \
  template <>                                                                                     \
  void row_partial_backward<double, double, W, S>(const RowNormArgs& a, const double* dy,         \
                                                  const double* x, const double* gamma,           \
                                                  const S* mean, const S* rstd, W* stats) {       \
    f64_row_partial_backward(a, dy, x, gamma, mean, rstd, stats);                                 \
  }                                                                                               \
  template <>                                                                                     \
  void row_apply_backward<double, double, W, S>(                                                  \
      const RowNormArgs& a, const double* dy, const double* x, const double* gamma,               \
      const S* mean, const S* rstd, W* stats, double n, double* dx, double* dgamma,               \
      double* dbeta) {                                                                            \
    f64_row_apply_backward(a, dy, x, gamma, mean, rstd, stats, n, dx, dgamma, dbeta);             \
  }                                                                                               \
  template <>                                                                                     \
  void group_apply_forward<double, W, S>(const GroupNormArgs& a, const double* x,                 \
                                         const double* gamma, const double* beta, const W* stats, \
                                         double count, double eps, double* y, S* mean, S* rstd) { \
    f64_group_apply_forward(a, x, gamma, beta, stats, count, eps, y, mean, rstd);                 \
  }                                                                                               \
  template <>                                                                                     \
  void group_partial_backward<double, W, S>(const GroupNormArgs& a, const double* dy,             \
                                            const double* x, const double* gamma, const S* mean,  \
                                            const S* rstd, W* stats, double* dparams) {           \
    f64_group_partial_backward(a, dy, x, gamma, mean, rstd, stats, dparams);                      \
  }                                                                                               \
  template <>                                                                                     \
  void group_apply_backward<double, W, S>(                                                        \
      const GroupNormArgs& a, const double* dy, const double* x, const double* gamma,             \
      const S* mean, const S* rstd, const W* stats, double count, const double* dparams,          \
      double* dx, double* dgamma, double* dbeta) {                                                \
    f64_group_apply_backward(a, dy, x, gamma, mean, rstd, stats, count, dparams, dx, dgamma,      \
                             dbeta);                                                              \
  }                                                                                               \
  template <>                                                                                     \
  void bn_partial_backward<double, W, S>(const BatchNormArgs& a, const double* dy,                \
                                         const double* x, const S* mean, W* stats) {              \
    f64_bn_partial_backward(a, dy, x, mean, stats);                                               \
  }                                                                                               \
  template <>                                                                                     \
  void bn_apply_backward<double, double, W, S>(const BatchNormArgs& a, const double* dy,          \
                                               const double* x, const double* gamma,              \
                                               const S* mean, const S* invstd, const W* stats,    \
                                               double n, double* dx) {                            \
    f64_bn_apply_backward(a, dy, x, gamma, mean, invstd, stats, n, dx);                           \
  }                                                                                               \
  template <>                                                                                     \
  void bn_fused_backward<double, double, W, S>(const BatchNormArgs& a, const double* dy,          \
                                               const double* x, const double* gamma,              \
                                               const S* mean, const S* invstd, double n, W* sums, \
                                               double* dx) {                                      \
    f64_bn_fused_backward(a, dy, x, gamma, mean, invstd, n, sums, dx);                            \
  }                                                                                               \
  template <>                                                                                     \
  void bn_param_grads<double, W, S>(int64_t c, const W* local_stats, const S* invstd,             \
                                    double* dgamma, double* dbeta) {                              \
    for (int64_t ch = 0; ch < c; ++ch) {                                                          \
      if (dgamma)                                                                                 \
        dgamma[ch] = static_cast<double>(invstd[ch]) * static_cast<double>(local_stats[2 * ch + 1]); \
      if (dbeta) dbeta[ch] = static_cast<double>(local_stats[2 * ch]);                            \
    }                                                                                             \
  }

TPNORM_F64_W(float)
TPNORM_F64_W(double)
TPNORM_F64_WS(float, float)
TPNORM_F64_WS(float, double)
TPNORM_F64_WS(double, float)
TPNORM_F64_WS(double, double)

template <>
void residual_backward_epilogue<double>(int64_t n, const double* dh_extra, float alpha, double* df,
                                        double* dx, int threads) {
  const double al = alpha;
#pragma omp parallel for num_threads(thread_count(threads, n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double dh = df[i] + (dh_extra ? dh_extra[i] : 0.0);
    df[i] = dh;
    dx[i] = al * dh;
  }
}

}  // namespace tpnorm::kernels::cpu
