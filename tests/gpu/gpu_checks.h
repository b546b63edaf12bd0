// gpu_checks.h — element-wise checks of a row-norm result against the float64 reference and
// against the CPU op, with the tolerances of tests/mpi/test_row_norm_equiv.cpp (r = one
// rounding of the storage dtype: fp32 1e-5, fp16 1e-3, bf16 8e-3):
//   y: r + r|want|;  mean, rstd: 1e-6 rel;  dx: r*max(1, rstd) + 10r|want|;
//   dgamma, dbeta (sums over rows): r*rows + r|want|.
// `c0, h` select this rank's columns of the full-width reference.
#pragma once

#include <algorithm>
#include <vector>

#include "gpu_support.h"
#include "harness.h"
#include "reference.h"

namespace tpnorm_gpu {

inline std::vector<double> ref_cols(const std::vector<double>& m, int64_t rows, int64_t cols,
                                    int64_t c0, int64_t nc) {
  std::vector<double> out(static_cast<size_t>(rows * nc));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < nc; ++c) out[r * nc + c] = m[r * cols + c0 + c];
  return out;
}
inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// Wrong elements of `got` (this rank's columns [c0, c0+h) of `hidden`) against the reference
/// and against `cpu` (the CPU op on the same columns).
inline int64_t count_wrong_rows(const RowOut& got, const RowOut& cpu,
                                const tpnorm_test::RowRef& ref, bool centered, tpnorm::DType dt,
                                int64_t rows, int64_t hidden, int64_t c0, int64_t h) {
  using tpnorm_test::count_wrong;
  const double rt = tpnorm_test::storage_rtol(dt);
  const double rs_max =
      ref.rstd.empty() ? 1.0 : *std::max_element(ref.rstd.begin(), ref.rstd.end());
  const double dxt = rt * std::max(1.0, rs_max);
  int64_t w = 0;
  w += count_wrong("y", got.y, ref_cols(ref.y, rows, hidden, c0, h), rt, rt);
  w += count_wrong("rstd", got.rstd, ref.rstd, 0, 1e-6);
  w += count_wrong("dx", got.dx, ref_cols(ref.dx, rows, hidden, c0, h), dxt, 10 * rt);
  w += count_wrong("dgamma", got.dgamma, ref_cols(ref.dgamma, 1, hidden, c0, h), rt * rows, rt);
  w += count_wrong("y vs cpu", got.y, to_double(cpu.y), rt, rt);
  w += count_wrong("rstd vs cpu", got.rstd, to_double(cpu.rstd), 0, 1e-6);
  w += count_wrong("dx vs cpu", got.dx, to_double(cpu.dx), dxt, 10 * rt);
  w += count_wrong("dgamma vs cpu", got.dgamma, to_double(cpu.dgamma), rt * rows, rt);
  if (centered) {
    w += count_wrong("mean", got.mean, ref.mean, 1e-6, 1e-6);
    w += count_wrong("dbeta", got.dbeta, ref_cols(ref.dbeta, 1, hidden, c0, h), rt * rows, rt);
    w += count_wrong("mean vs cpu", got.mean, to_double(cpu.mean), 1e-6, 1e-6);
    w += count_wrong("dbeta vs cpu", got.dbeta, to_double(cpu.dbeta), rt * rows, rt);
  }
  return w;
}

}  // namespace tpnorm_gpu
