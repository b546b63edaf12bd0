// tpnorm/batched.h — several hidden-sharded LayerNorm / RMSNorm calls in ONE collective.
//
// A transformer block often normalizes several row tensors at one point of the step: a q-norm
// and a k-norm (per head, so their "rows" are tokens x heads), a pre-norm of the hidden state.
// Each is one norm of tpnorm/norm.h with its own width, gamma/beta and saved statistics; doing
// them one by one costs one latency-bound collective each. The batched calls pack the
// statistics of every item into one buffer and make exactly ONE all_reduce_sum.
//
// Item i is x_i [rows_i, hidden_local_i] with the formulas of norm.h (LayerNorm when
// centered, RMSNorm otherwise), n_i = sum over ranks of hidden_local_i, which must equal the
// item's hidden_size when it is given (> 0). Rows, centered, hidden_size and gamma/beta presence
// of each item must agree across ranks; hidden_local_i may differ by rank and may be 0. Items may have different storage dtypes and saved-statistics dtypes. All items
// share NormOptions (eps, stats mode, threads).
//
// Payload per rank per call, in values of the wire type (float64 robust, float32 naive):
//   sum_i rows_i * (2 if centered_i else 1)  +  K  +  H
// with K = number of items (each item's column count, summed into n_i: widths differ, so the
// call header's single count cannot carry them) and H = 10 with agreement, 2 without.
// Forward and backward alike; an empty list (K = 0) still makes its one collective, so that
// every rank reaches it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

/// One forward item; views as in layer_norm_forward (beta and mean ignored for RMSNorm).
struct RowNormItem {
  bool centered = true;  ///< LayerNorm (true) or RMSNorm (false)
  TensorView x;          ///< [in]  [rows, hidden_local]
  TensorView gamma;      ///< [in]  [hidden_local] or absent
  TensorView beta;       ///< [in]  [hidden_local] or absent (LayerNorm only)
  TensorView y;          ///< [out] [rows, hidden_local], x's dtype
  TensorView mean;       ///< [out] [rows] float32/float64 or absent (LayerNorm only)
  TensorView rstd;       ///< [out] [rows] float32/float64 or absent
  /// The item's whole hidden size, which the ranks' hidden_local must add up to (checked on the
  /// summed count, the same error on every rank otherwise, as NormOptions::hidden_size does
  /// for one norm); 0: not checked.
  int64_t hidden_size = 0;
};

/// One backward item; views as in layer_norm_backward (mean and dbeta ignored for RMSNorm).
struct RowNormGradItem {
  bool centered = true;
  TensorView dy;      ///< [in]  [rows, hidden_local]
  TensorView x;       ///< [in]  [rows, hidden_local]
  TensorView gamma;   ///< [in]  [hidden_local] or absent
  TensorView mean;    ///< [in]  [rows], as written by the forward (LayerNorm only)
  TensorView rstd;    ///< [in]  [rows], as written by the forward
  TensorView dx;      ///< [out] [rows, hidden_local]
  TensorView dgamma;  ///< [out] [hidden_local] or absent: sum over this rank's rows
  TensorView dbeta;   ///< [out] [hidden_local] or absent (LayerNorm only)
  int64_t hidden_size = 0;  ///< as RowNormItem::hidden_size
};

/// Forward of `count` items with one collective. [in] items: `count` entries (may be null
/// when count == 0); the caller keeps them alive during the call.
void batched_norm_forward(Communicator& comm, const RowNormItem* items, size_t count,
                          const NormOptions& opt = {});

/// Backward of `count` items with one collective.
void batched_norm_backward(Communicator& comm, const RowNormGradItem* items, size_t count,
                           const NormOptions& opt = {});

}  // namespace tpnorm
