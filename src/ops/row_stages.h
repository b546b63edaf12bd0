// row_stages.h — the per-tensor stages of a row-norm call (validate, partial, apply), so that
// ops which put several row tensors into ONE collective (batched.h) or add a residual in front
// of the norm (fused.h) share them instead of copying the pipeline of row_norm.cpp.
//
// A stage works on one row tensor and a slice of the call's packed payload: the caller owns
// the PackedCall, places each tensor's statistics at its own offset, makes the one reduce, and
// passes each tensor's global element count n back to the apply stage.
#pragma once

#include <cstdint>
#include <string>

#include "ops/packed_call.h"
#include "ops/validate.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

struct RowGeometry {
  int64_t rows = 0, h = 0;  ///< leading dims flattened into rows; h = this rank's columns
};
RowGeometry row_geometry(const TensorView& x);

/// Payload values per row: {sum x, sum x^2} / {sum g, sum g*xhat} centred, one value for RMS.
inline int64_t row_stat_width(bool centered) { return centered ? 2 : 1; }

/// One forward row tensor. mean is ignored when !centered; beta too.
struct RowForwardArgs {
  bool centered = true;
  TensorView x, gamma, beta, y, mean, rstd;
};
/// One backward row tensor. mean and dbeta are ignored when !centered.
struct RowBackwardArgs {
  bool centered = true;
  TensorView dy, x, gamma, mean, rstd, dx, dgamma, dbeta;
};

/// Local checks (records the first failure on v and returns false). `prefix` names the tensor
/// in messages, e.g. "items[2]." for a batched call, "" for a single one.
bool validate_row_forward(Validator& v, const std::string& prefix, const RowForwardArgs& a);
bool validate_row_backward(Validator& v, const std::string& prefix, const RowBackwardArgs& a);

/// Writes rows * row_stat_width values of this rank's partial statistics at `stats` (wire type).
void row_forward_partial(const RowForwardArgs& a, DType wire, void* stats, int threads);
/// Finishes y (and mean/rstd when present) from the summed statistics; n = global columns.
/// stats is not const: the row kernels may use it as scratch (see kernels/cpu/row_norm.h).
void row_forward_apply(const RowForwardArgs& a, DType wire, void* stats, double n, double eps,
                       int threads);
void row_backward_partial(const RowBackwardArgs& a, DType wire, void* stats, int threads);
void row_backward_apply(const RowBackwardArgs& a, DType wire, void* stats, double n, int threads);

/// These ops have CPU kernels only: a call on a device communicator fails on every rank
/// (instead of handing device pointers to CPU kernels).
bool host_only(Validator& v, const Device& device);

/// The start of call's payload as untyped memory (payload<W>() for the call's wire type W).
void* payload_of(PackedCall& call);

/// The wire type of a statistics mode: float64 robust, float32 naive.
inline DType wire_of(Stats s) { return s == Stats::kNaive ? DType::F32 : DType::F64; }
/// The naive mode's float32 counts are exact below 2^24: throws (on every rank, since n is the
/// reduced count) beyond that.
void check_naive_count(Stats s, double n);

}  // namespace tpnorm::detail
