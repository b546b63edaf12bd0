// fused_reference.h — float64 reference of the fused residual add + row norm (tpnorm/fused.h).
#pragma once

#include <cstdint>
#include <vector>

#include "reference.h"
#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm_test {

struct FusedRef {
  std::vector<double> h;       // alpha*x + f in float64, to check the op's stored h against
  RowRef norm;                 // the row norm of h_stored (y, mean, rstd; dx = its input gradient)
  std::vector<double> dx, df;  // alpha*(norm.dx + dh_extra), norm.dx + dh_extra
};

/// x, f [rows, h]; gamma/beta/dy/dh_extra may be empty (absent; no backward without dy).
/// h_stored: the op's h on the full data, checked separately against `h`. The norm is taken of
/// it because the op's h is alpha*x + f rounded to the storage dtype (twice in float32 for
/// alpha != 1), and with |mean| >> std one rounding of h moves xhat by more than the tolerance.
FusedRef fused_reference(bool centered, const std::vector<float>& x, const std::vector<float>& f,
                         double alpha, const std::vector<float>& h_stored, int64_t rows, int64_t h,
                         const std::vector<float>& gamma, const std::vector<float>& beta,
                         double eps, const std::vector<float>& dy = {},
                         const std::vector<float>& dh_extra = {});

/// What one fused forward (+ backward) returns, read back as float.
struct FusedOut {
  std::vector<float> h, y, mean, rstd, dx, df, dgamma, dbeta;
};

/// One fused call's set-up. Presence is explicit, not "vector empty", because a rank holding no
/// column has empty slices of present tensors.
struct FusedSetup {
  bool centered = true;
  tpnorm::DType dt = tpnorm::DType::F32, saved = tpnorm::DType::F32;
  double alpha = 1.0;
  int64_t rows = 0, h = 0;
  bool affine = false;    // gamma (and beta when centered) present
  bool backward = false;  // run the backward with dy
  bool extra = false;     // dh_extra present
  bool in_place = false;  // h written over x's buffer
  tpnorm::NormOptions opt;
};

/// Runs fused_add_{layer,rms}_norm_{forward,backward} on `comm`; inputs are rounded to s.dt.
FusedOut run_fused(tpnorm::Communicator& comm, const FusedSetup& s, const std::vector<float>& x,
                   const std::vector<float>& f, const std::vector<float>& gamma = {},
                   const std::vector<float>& beta = {}, const std::vector<float>& dy = {},
                   const std::vector<float>& dh_extra = {});

}  // namespace tpnorm_test
