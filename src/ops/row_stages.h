// row_stages.h — the math and the checks of one row tensor of a row norm (LayerNorm, RMSNorm):
// validate, partial, apply. The row norm's spec (row_norm.cpp) runs them on one tensor, the
// batched op (batched.cpp) on K tensors in one payload, the fused op (fused.cpp) on h after its
// residual add. Each stage works on one tensor and its slice of the call's payload; run_op
// (op_spec.h) owns the call, the one reduce and the global counts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "ops/op_spec.h"
#include "ops/validate.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm::detail {

struct RowGeometry {
  int64_t rows = 0, h = 0;  ///< leading dims flattened into rows; h = this rank's columns
};
/// {0, 0} for a shape the validator rejects (see shape_fits).
RowGeometry row_geometry(const TensorView& x);

/// Payload values per row: {sum x, sum x^2} / {sum g, sum g*xhat} centred, one value for RMS;
/// in Stats::kExact int64 limbs (kernels/cpu/exact_rows.h), which differ forward and backward.
int64_t row_stat_width(bool centered, Stats stats, bool forward);

/// One forward row tensor with its geometry, computed once. mean and beta are ignored when
/// !centered (RMSNorm).
struct RowForward {
  RowForward(bool centered, const TensorView& x, const TensorView& gamma, const TensorView& beta,
             const TensorView& y, const TensorView& mean, const TensorView& rstd)
      : centered(centered),
        x(x),
        gamma(gamma),
        beta(beta),
        y(y),
        mean(mean),
        rstd(rstd),
        g(row_geometry(x)),
        param(param_dtype(x, {&gamma, &beta})) {}
  bool centered;
  TensorView x, gamma, beta, y, mean, rstd;
  RowGeometry g;
  DType param;  ///< gamma's and beta's dtype (param_dtype)
  /// Payload values of this tensor's statistics (rows * row_stat_width).
  size_t stat_values(Stats s) const {
    return static_cast<size_t>(g.rows * row_stat_width(centered, s, true));
  }
};

/// One backward row tensor; mean and dbeta are ignored when !centered.
struct RowBackward {
  RowBackward(bool centered, const TensorView& dy, const TensorView& x, const TensorView& gamma,
              const TensorView& mean, const TensorView& rstd, const TensorView& dx,
              const TensorView& dgamma, const TensorView& dbeta)
      : centered(centered),
        dy(dy),
        x(x),
        gamma(gamma),
        mean(mean),
        rstd(rstd),
        dx(dx),
        dgamma(dgamma),
        dbeta(dbeta),
        g(row_geometry(x)),
        param(param_dtype(x, {&gamma, &dgamma, &dbeta})) {}
  bool centered;
  TensorView dy, x, gamma, mean, rstd, dx, dgamma, dbeta;
  RowGeometry g;
  DType param;  ///< gamma's, dgamma's and dbeta's dtype (param_dtype)
  size_t stat_values(Stats s) const {
    return static_cast<size_t>(g.rows * row_stat_width(centered, s, false));
  }
};

/// Local checks (the first failure is recorded on v). `prefix` names the tensor in messages,
/// e.g. "items[2]." for a batched call, "" for a single one.
void validate_row_forward(Validator& v, const std::string& prefix, const RowForward& a);
void validate_row_backward(Validator& v, const std::string& prefix, const RowBackward& a);

/// How the CPU kernels run: OpenMP threads (0: default), and `fused` at one rank, where the
/// reduce is the identity: then no partial runs and the apply kernels compute each row's
/// statistics themselves while the row is in cache (one pass over memory instead of two, the
/// same bits; see kernels/cpu/row_norm.h).
struct RowRun {
  int threads = 0;
  bool fused = false;
  /// A chunk of a chunked call (ops/chunking.h): the stages run on rows_of(a, row0, ...) of a
  /// call of call_rows rows (0: the whole call); backward dgamma/dbeta accumulate over the
  /// chunks in param_acc (row_backward_acc_size doubles, zeroed) and are written by the chunk
  /// with param_last (see kernels/cpu/row_norm.h RowNormArgs).
  int64_t row0 = 0, call_rows = 0;
  double* param_acc = nullptr;
  bool param_last = true;
  /// Backward: the partial sums dgamma/dbeta into param_acc, the apply only writes them
  /// (kernels/cpu/row_norm.h RowNormArgs::params_in_partial; not with Stats::kExact, whose
  /// partial is another kernel, nor fused). param_acc is then given to both stages.
  bool params_in_partial = false;
  /// Rows [pf_begin, pf_end) of the call (not of the chunk), which the apply prefetches: the
  /// next chunk's partial reads them (OpSpec's ChunkRows::next_begin). Empty: none.
  int64_t pf_begin = 0, pf_end = 0;
};

/// Rows [r0, r1) of a row tensor's views (data offset, leading dims flattened), as a tensor of
/// its own: what one chunk's stages run on.
RowForward rows_of(const RowForward& a, int64_t r0, int64_t r1);
RowBackward rows_of(const RowBackward& a, int64_t r0, int64_t r1);

/// One row-norm call (row_norm.cpp): its tensor, options and kernel run; what the host and
/// device hooks of its spec read.
template <class Tensor>
struct RowCall {
  Tensor a;
  NormOptions opt;
  RowRun run;
};
using RowForwardCall = RowCall<RowForward>;
using RowBackwardCall = RowCall<RowBackward>;

/// Writes stat_values() values of this rank's partial statistics at `stats` (wire type).
void row_forward_partial(const RowForward& a, DType wire, void* stats, RowRun run);
/// Finishes y (and mean/rstd when present) from the summed statistics; n = global columns.
/// stats is not const: the row kernels may use it as scratch (see kernels/cpu/row_norm.h).
void row_forward_apply(const RowForward& a, DType wire, void* stats, double n, double eps,
                       RowRun run);
void row_backward_partial(const RowBackward& a, DType wire, void* stats, RowRun run);
void row_backward_apply(const RowBackward& a, DType wire, void* stats, double n, RowRun run);
/// Doubles of RowRun::param_acc for a chunked backward call of `a` (the whole call's rows).
size_t row_backward_acc_size(const RowBackward& a, DType wire, RowRun run);
/// Whether the partial of `a` may sum dgamma/dbeta (RowRun::params_in_partial): a float wire,
/// not fused, and dgamma or dbeta asked for.
bool row_backward_params_in_partial(const RowBackward& a, DType wire, RowRun run);

}  // namespace tpnorm::detail
