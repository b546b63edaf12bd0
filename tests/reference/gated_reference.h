// gated_reference.h — float64 gated RMSNorm reference (tpnorm/rms_norm_gated.h) on full
// [rows, hidden] data, and a runner for tpnorm's rms_norm_gated_* on one rank's channel slice.
#pragma once

#include <cstdint>
#include <vector>

#include "tpnorm/communicator.h"
#include "tpnorm/rms_norm_gated.h"

namespace tpnorm_test {

struct GatedRef {
  std::vector<double> y, rstd, dx, dz, dweight;  // rstd [rows * G]; dweight [hidden]
};

/// x, z [rows, hidden] (z empty: no gate); weight [hidden] or empty; backward too when dy is
/// non-empty. Statistics per (row, group of group_size channels), two-pass float64.
GatedRef rms_norm_gated_reference(const std::vector<float>& x, const std::vector<float>& z,
                                  int64_t rows, int64_t hidden, int64_t group_size,
                                  bool norm_before_gate, const std::vector<float>& weight,
                                  double eps, const std::vector<float>& dy = {});

struct GatedSetup {
  tpnorm::DType dt = tpnorm::DType::F32, saved = tpnorm::DType::F32;
  tpnorm::DType param = tpnorm::DType::F32;  ///< weight / dweight: dt, or F32 (mixed precision)
  int64_t rows = 0, c_local = 0;             // this rank's shape [rows, c_local]
  tpnorm::GatedGroups gg;
  bool gated = true, weighted = true, backward = true;
  tpnorm::NormOptions opt;
};
struct GatedOut {
  std::vector<float> y, rstd, dx, dz, dweight;
};
/// Inputs are rounded to st.dt (weight to st.param); rstd holds every group of every row.
GatedOut run_gated(tpnorm::Communicator& comm, const GatedSetup& st, const std::vector<float>& x,
                   const std::vector<float>& z, const std::vector<float>& weight,
                   const std::vector<float>& dy);

}  // namespace tpnorm_test
