// harness.cpp — see harness.h.
#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

namespace tpnorm_test {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

std::vector<float> normal(uint64_t seed, uint64_t stream, size_t n, double mean, double stddev) {
  std::mt19937_64 gen(seed * 0x9e3779b97f4a7c15ULL + stream);
  std::vector<float> v(n);
  // Box-Muller on the raw generator: identical on every platform and rank.
  for (size_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    v[i] = static_cast<float>(mean + stddev * r * std::cos(2 * M_PI * u2));
    if (i + 1 < n) v[i + 1] = static_cast<float>(mean + stddev * r * std::sin(2 * M_PI * u2));
  }
  return v;
}

Split split_even(int64_t total, int parts) {
  return split_weighted(total, std::vector<int>(static_cast<size_t>(parts), 1));
}

Split split_weighted(int64_t total, const std::vector<int>& weights) {
  Split s;
  int64_t wsum = 0;
  for (int w : weights) wsum += w;
  int64_t off = 0;
  int64_t acc = 0;
  for (size_t p = 0; p < weights.size(); ++p) {
    acc += weights[p];
    const int64_t end = wsum ? (total * acc + wsum - 1) / wsum : 0;
    s.offset.push_back(off);
    s.count.push_back(std::max<int64_t>(0, end - off));
    off = std::max(off, end);
  }
  return s;
}

std::vector<float> columns(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t c0,
                           int64_t nc) {
  std::vector<float> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * cols + c0 + c];
  return out;
}

namespace {
double g_max_abs_err = 0, g_max_tol_used = 0;
}

double max_abs_err() { return g_max_abs_err; }
double max_tolerance_used() { return g_max_tol_used; }
void reset_max_abs_err() { g_max_abs_err = g_max_tol_used = 0; }

int64_t count_wrong(const char* what, const float* got, const double* want, size_t n, double atol,
                    double rtol) {
  int64_t wrong = 0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double tol = atol + rtol * std::fabs(want[i]);
    if (std::isfinite(err)) {
      g_max_abs_err = std::max(g_max_abs_err, err);
      if (tol > 0) g_max_tol_used = std::max(g_max_tol_used, err / tol);
    }
    if (!(err <= tol)) {
      if (wrong < 5)
        std::fprintf(stderr, "[rank %d] %s[%zu]: got %.9g, want %.9g (err %.3g, tol %.3g)\n",
                     world_rank(), what, i, got[i], want[i], err, atol + rtol * std::fabs(want[i]));
      ++wrong;
    }
  }
  return wrong;
}

int64_t count_wrong(const char* what, const std::vector<float>& got,
                    const std::vector<double>& want, double atol, double rtol) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "[rank %d] %s: %zu values, want %zu\n", world_rank(), what, got.size(),
                 want.size());
    return static_cast<int64_t>(std::max(got.size(), want.size()));
  }
  return count_wrong(what, got.data(), want.data(), got.size(), atol, rtol);
}

int64_t sum_over_ranks(int64_t local, MPI_Comm comm) {
  int64_t s = 0;
  MPI_Allreduce(&local, &s, 1, MPI_INT64_T, MPI_SUM, comm);
  return s;
}

double max_over_ranks(double local, MPI_Comm comm) {
  double m = 0;
  MPI_Allreduce(&local, &m, 1, MPI_DOUBLE, MPI_MAX, comm);
  return m;
}

}  // namespace tpnorm_test
