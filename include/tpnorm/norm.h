// tpnorm/norm.h — hidden-sharded LayerNorm and RMSNorm (tensor parallelism).
//
// Each rank holds a slice of the hidden dimension: x is [rows, hidden_local] (any leading dims
// are flattened into rows; the last dim is this rank's slice). Rows must agree across ranks;
// hidden_local may differ and may be 0. With n = sum of hidden_local over ranks:
//
//   LayerNorm:  mu = sum(x)/n   var = max(sum(x^2)/n - mu^2, 0)   rstd = 1/sqrt(var + eps)
//               xhat = (x - mu) * rstd                            y = gamma * xhat + beta
//   RMSNorm:    rstd = 1/sqrt(sum(x^2)/n + eps)   xhat = x * rstd  y = gamma * xhat
//
// Backward, with g = dy * gamma (dy when gamma is absent) and sums over the full row:
//   LayerNorm:  dx = rstd * (g - sum(g)/n - xhat * sum(g*xhat)/n)
//   RMSNorm:    dx = rstd * (g - xhat * sum(g*xhat)/n)
//   dgamma = sum over this rank's rows of dy*xhat, dbeta = sum of dy: this rank's slice of
//   gamma, so no further communication is needed in tensor parallelism.
//
// Every call makes exactly ONE all_reduce_sum on `comm`, packing every row's statistics plus a
// small header (error flag, element count, and a fingerprint of the call unless
// NormOptions::check_agreement is off). Payload per rank, in values of the wire type
// (float64 for Stats::kRobust, float32 for Stats::kNaive):
//   LayerNorm: 2*rows + H     RMSNorm: rows + H     with H = 10 (agreement on) or 2 (off).
// Stats::kExact sends int64: LayerNorm 13*rows + H forward, 11*rows + H backward; RMSNorm
// 8*rows + H / 6*rows + H (see Stats::kExact).
//
// dtypes: x, y, dy, dx share one storage dtype (fp32, fp16, bf16; fp32 or fp64 accumulation
// inside; or fp64 on CPU communicators with Stats::kRobust, computed in double throughout, with
// fp64 parameters); gamma, beta, dgamma, dbeta have x's dtype, or float32 next to fp16/bf16 x (mixed
// precision: float32 parameters and parameter gradients; CPU communicators only so far); mean
// and rstd are float32 or float64 [rows]. All views live on comm.device(). Errors: tpnorm::Error on
// every rank together (see tpnorm/error.h).
#pragma once

#include "tpnorm/communicator.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

/// How partial statistics are accumulated and sent.
enum class Stats : int32_t {
  /// float64 moments (accumulated around a per-shard pivot near the mean: float32 block sums
  /// of the pivoted values promoted to float64 per block on CPU, float32 sums on GPU):
  /// accurate even when |mean| >> std, e.g. 1e4 + N(0,1). The default.
  kRobust = 0,
  /// float32 sum and sum of squares, E[x^2] - E[x]^2: half the bytes, cancels catastrophically
  /// when |mean| >> std. Global element counts must stay below 2^24.
  kNaive = 1,
  /// Exact sums: every rank's partial sums as integers on a grid fixed per mode (int64 limbs,
  /// summed by one integer all-reduce), mean and variance computed from the integers and
  /// rounded once. The same bits at every world size and split, for every output (y, saved
  /// statistics, dx, dgamma, dbeta), and an exact variance at any offset. Inputs with a value
  /// that is not finite or has |x| >= 2^64 give NaN statistics for that row; squares of values
  /// under 2^-79 are truncated to a grid of 2^-204 each (common/exact_sum.h). Payload per row:
  /// LayerNorm forward 13 int64 (104 bytes), RMSNorm forward 8, LayerNorm backward 11, RMSNorm
  /// backward 6; at most 2048 ranks and 2^32 values a row. On device communicators too, for
  /// every op (the CPU's bits).
  kExact = 2,
};

/// Options shared by the norm calls. Grows by appending fields with defaults.
struct NormOptions {
  double eps = 1e-5;             ///< > 0 and finite
  Stats stats = Stats::kRobust;  ///< how partial statistics are accumulated and sent
  bool check_agreement = true;   ///< fold a fingerprint of the call into the collective
  int num_threads = 0;           ///< CPU threads per rank; 0 = OpenMP's default
  /// Row norms: > 0 is the hidden size the ranks' slices must tile (the sum of hidden_local
  /// over the ranks, as the call's collective sums it): otherwise the call fails with
  /// kInvalidArgument on every rank, outputs untouched. 0: not checked.
  int64_t hidden_size = 0;
};

/// Values of the call header H that leads every call's collective (H above): 10 with
/// check_agreement (and in strict calls, Communicator::set_strict_calls), 2 without.
int call_header_values(bool check_agreement);

/// LayerNorm forward.
/// [in]  x      [rows, hidden_local]
/// [in]  gamma  [hidden_local] or absent (= 1);  beta [hidden_local] or absent (= 0)
/// [out] y      [rows, hidden_local], same dtype as x
/// [out] mean, rstd  [rows] float32/float64, saved for backward; may be absent (inference)
void layer_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                        const TensorView& beta, const TensorView& y, const TensorView& mean,
                        const TensorView& rstd, const NormOptions& opt = {});

/// LayerNorm backward.
/// [in]  dy, x  [rows, hidden_local];  gamma [hidden_local] or absent
/// [in]  mean, rstd  [rows] as written by layer_norm_forward
/// [out] dx  [rows, hidden_local]
/// [out] dgamma, dbeta  [hidden_local] or absent: sums over this rank's rows (overwritten)
void layer_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                         const TensorView& gamma, const TensorView& mean, const TensorView& rstd,
                         const TensorView& dx, const TensorView& dgamma, const TensorView& dbeta,
                         const NormOptions& opt = {});

/// RMSNorm forward. Arguments as layer_norm_forward without beta and mean.
void rms_norm_forward(Communicator& comm, const TensorView& x, const TensorView& gamma,
                      const TensorView& y, const TensorView& rstd, const NormOptions& opt = {});

/// RMSNorm backward. Arguments as layer_norm_backward without mean and dbeta.
void rms_norm_backward(Communicator& comm, const TensorView& dy, const TensorView& x,
                       const TensorView& gamma, const TensorView& rstd, const TensorView& dx,
                       const TensorView& dgamma, const NormOptions& opt = {});

}  // namespace tpnorm
