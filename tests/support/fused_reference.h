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
  std::vector<float> h;        // alpha*x + f, rounded once to the storage dtype as the op stores it
  RowRef norm;                 // the row norm of h (y, mean, rstd; dx = the norm's input gradient)
  std::vector<double> dx, df;  // alpha*(norm.dx + dh_extra), norm.dx + dh_extra
};

/// x, f [rows, h]; gamma/beta/dy/dh_extra may be empty (absent; no backward without dy).
FusedRef fused_reference(bool centered, tpnorm::DType dt, const std::vector<float>& x,
                         const std::vector<float>& f, double alpha, int64_t rows, int64_t h,
                         const std::vector<float>& gamma, const std::vector<float>& beta,
                         double eps, const std::vector<float>& dy = {},
                         const std::vector<float>& dh_extra = {});

/// What one fused forward (+ backward when dy is non-empty) returns, read back as float.
struct FusedOut {
  std::vector<float> h, y, mean, rstd, dx, df, dgamma, dbeta;
};

/// Runs tpnorm's fused_add_{layer,rms}_norm_{forward,backward} on `comm` with storage dtype dt
/// (inputs are rounded to dt), saved statistics of dtype `saved`. Empty gamma/beta/dh_extra are
/// absent. With in_place, h is written over x's buffer.
FusedOut run_fused(tpnorm::Communicator& comm, bool centered, tpnorm::DType dt,
                   tpnorm::DType saved, const std::vector<float>& x, const std::vector<float>& f,
                   double alpha, int64_t rows, int64_t h, const std::vector<float>& gamma,
                   const std::vector<float>& beta, const std::vector<float>& dy = {},
                   const std::vector<float>& dh_extra = {}, bool in_place = false,
                   const tpnorm::NormOptions& opt = {});

}  // namespace tpnorm_test
