// row_norm.h — CPU kernels of the row norms (LayerNorm, RMSNorm) with a sharded hidden dim.
//
// The kernels know nothing of communication: partial_* reduce this rank's columns of every row
// into a packed stats buffer; the op sums that buffer over ranks; apply_* finish each element
// from the summed statistics. Rows are contiguous with h columns each; h may be 0.
//
// Stats layout per row: centred (LayerNorm) = {sum x, sum x^2}, RMS = {sum x^2}; backward:
// centred = {sum g, sum g*xhat}, RMS = {sum g*xhat}; g = dy*gamma. W (the wire type) is double
// in the robust mode (forward sums accumulated around a per-row pivot, so 1e4 + N(0,1) loses
// nothing) and float in the naive mode.
//
// P, the type of gamma / beta / dgamma / dbeta, is T or float: fp16/bf16 activations with
// float32 parameters and parameter gradients (mixed precision, as apex's MixedFusedLayerNorm).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpnorm::kernels::cpu {

struct RowNormArgs {
  int64_t rows = 0;
  int64_t h = 0;         ///< this rank's columns
  bool centered = true;  ///< LayerNorm (true) or RMSNorm (false)
  int threads = 0;       ///< 0: OpenMP default
  /// One rank (the reduce is the identity): the apply_* kernels compute each row's statistics
  /// themselves, while the row is in cache, and write them to `stats` instead of reading it.
  bool fused = false;
  /// Stats::kExact: `stats` already holds each row's final values, rounded once from exact
  /// sums (kernels/cpu/exact_rows.h): forward {mean, var} centred or {mean square}; backward
  /// {sum g / n, sum g*xhat / n} or {sum g*xhat / n}. The apply kernels use them as they are.
  bool final_stats = false;
  /// Row chunks of one call (ops/chunking.h): these rows are rows [row0, row0 + rows) of a call
  /// of call_rows rows (0: rows, the whole call). Streaming stores are chosen for the whole
  /// call; with final_stats the backward's fixed row blocks are counted from the call's row 0.
  int64_t row0 = 0, call_rows = 0;
  /// Backward of a chunked call: dgamma/dbeta are summed into param_acc (row_param_acc_size
  /// doubles, zeroed by the caller, the same for every chunk of the call) and written only by
  /// the chunk with param_last. The slots and the order of additions are those of the unchunked
  /// call whenever every chunk starts at a multiple of 16 rows (kParamRows): the same bits at
  /// one thread, and with final_stats at any thread count.
  double* param_acc = nullptr;
  bool param_last = true;
  /// Backward, float statistics, not fused (P > 1): the partial sums dgamma/dbeta into
  /// param_acc (zeroed by the caller, row_param_acc_size doubles) while it reads x and dy for
  /// the row sums, and the apply (given the same param_acc) only writes dx and, with
  /// param_last, dgamma/dbeta: the same bits as summing them in the apply.
  bool params_in_partial = false;
  /// Chunked calls: the rows the call reads next (the partial of a later chunk), prefetched
  /// by the apply while it computes from cache, row i of this call with row i of these:
  /// x (and dy backward) of pf_rows rows of h columns, the same type as x. Null: none.
  const void* pf_x = nullptr;
  const void* pf_dy = nullptr;
  int64_t pf_rows = 0;
};

/// Doubles of RowNormArgs::param_acc for a call (a.call_rows or a.rows rows, a.threads).
size_t row_param_acc_size(const RowNormArgs& a);

template <class T, class W>
void row_partial_forward(const RowNormArgs& a, const T* x, W* stats);

/// mean/rstd may be null (not saved). n: global count per row; stats: summed over ranks
/// ([out] instead with a.fused).
template <class T, class P, class W, class S>
void row_apply_forward(const RowNormArgs& a, const T* x, const P* gamma, const P* beta, W* stats,
                       double n, double eps, T* y, S* mean, S* rstd);

template <class T, class P, class W, class S>
void row_partial_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                          const S* mean, const S* rstd, W* stats);

/// dgamma / dbeta may be null; they are overwritten with sums over this rank's rows.
/// stats: summed over ranks ([out] instead with a.fused).
template <class T, class P, class W, class S>
void row_apply_backward(const RowNormArgs& a, const T* dy, const T* x, const P* gamma,
                        const S* mean, const S* rstd, W* stats, double n, T* dx, P* dgamma,
                        P* dbeta);

// float64 storage: double kernels of their own (kernels/cpu/float64.cpp), every sum and
// element formula in double, for every wire and saved-statistics type.
#define TPNORM_ROW_F64_W(W) \
  template <>               \
  void row_partial_forward<double, W>(const RowNormArgs&, const double*, W*);
#define TPNORM_ROW_F64_WS(W, S)                                                                   \
  template <>                                                                                     \
  void row_apply_forward<double, double, W, S>(const RowNormArgs&, const double*, const double*, \
                                               const double*, W*, double, double, double*, S*,   \
                                               S*);                                               \
  template <>                                                                                     \
  void row_partial_backward<double, double, W, S>(const RowNormArgs&, const double*,              \
                                                  const double*, const double*, const S*,         \
                                                  const S*, W*);                                  \
  template <>                                                                                     \
  void row_apply_backward<double, double, W, S>(const RowNormArgs&, const double*, const double*, \
                                                const double*, const S*, const S*, W*, double,    \
                                                double*, double*, double*);
TPNORM_ROW_F64_W(float)
TPNORM_ROW_F64_W(double)
TPNORM_ROW_F64_WS(float, float)
TPNORM_ROW_F64_WS(float, double)
TPNORM_ROW_F64_WS(double, float)
TPNORM_ROW_F64_WS(double, double)
#undef TPNORM_ROW_F64_W
#undef TPNORM_ROW_F64_WS

}  // namespace tpnorm::kernels::cpu
