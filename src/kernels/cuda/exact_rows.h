// exact_rows.h — CUDA kernels of Stats::kExact for the row norms (LayerNorm, RMSNorm): the same
// payload and the same outputs, bit for bit, as the CPU kernels (kernels/cpu/exact_rows.h,
// kernels/cpu/row_norm.cpp with final_stats). No CUDA types here.
//
// partial_*: each row's exact sums over this rank's columns as int64 limbs, laid out as on the
//   CPU (exact_row_limbs; `bad` first). Exact integers: any split of a row over threads or
//   ranks gives the same limbs (kernels/cuda/exact_acc.h).
// apply_*: a finish kernel turns each row's summed limbs into its final statistics (rounded
//   once, common/exact_sum.h), written in place over the row's limbs; the apply kernel then
//   computes each element with the CPU's float32 formula, every operation spelled out with
//   __f*_rn so that nvcc contracts nothing the CPU does not (the CPU's one fused operation,
//   y = fma(xhat, gamma, beta), is __fmaf_rn here). dgamma / dbeta: as the CPU's exact mode,
//   per block of kExactParamBlock rows in row order (float32 sums of kExactParamRows rows added
//   in double), the blocks added in block order: the same bits at any world size.
// Headers are int64 (the exact wire): every apply kernel checks the summed header (error flag,
// fingerprint, 0 <= n < 2^32) and writes nothing on a failed call but *err = 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>

#include "common/exact_sum.h"
#include "kernels/cuda/call_header.h"
#include "kernels/cuda/plan.h"

namespace tpnorm::kernels::cuda {

/// int64 limbs per row (the CPU's kernels::cpu::exact_row_limbs): forward {bad, sum x, sum x^2}
/// or {bad, sum x^2}; backward {bad, sum g, sum g*xhat} or {bad, sum g*xhat}.
inline constexpr int exact_row_limbs(bool centered, bool forward) {
  return 1 + (centered ? exact::kLimbs1 : 0) + (forward ? exact::kLimbs2 : exact::kLimbs1);
}

/// The CPU's fixed dgamma/dbeta blocks (kernels/cpu/row_norm.cpp kFixedRows, kParamRows).
inline constexpr int64_t kExactParamBlock = 256;
inline constexpr int kExactParamRows = 16;

struct ExactRowArgs {
  int64_t rows = 0, h = 0;
  bool centered = true;
  bool s64 = false;        ///< saved mean/rstd are double
  void* stream = nullptr;  ///< cudaStream_t
};

/// Launch geometry of the row kernels: a warp per row (4 rows per 128-thread block) when
/// h <= 1024, else a 256-thread block per row; vector width as kernels/cuda/plan.h.
struct ExactRowPlan {
  int tpr = 32, threads = 128;
  int64_t blocks = 0;
  int vec = 1;
};
inline ExactRowPlan exact_row_plan(int64_t rows, int64_t h, size_t elem,
                                   std::initializer_list<const void*> ptrs) {
  ExactRowPlan p;
  p.vec = row_vector_width(h, elem, ptrs);
  p.tpr = h <= 1024 ? 32 : 256;
  p.threads = p.tpr == 32 ? 128 : 256;
  const int64_t per_block = p.threads / p.tpr;
  p.blocks = rows > 0 ? (rows + per_block - 1) / per_block : 0;
  if (p.blocks > INT32_MAX) throw std::length_error("tpnorm: too many rows for one CUDA launch");
  return p;
}

template <class T>
void exact_row_partial_forward(const ExactRowArgs& a, const T* x, int64_t* limbs);

template <class T>
void exact_row_partial_backward(const ExactRowArgs& a, const T* dy, const T* x, const T* gamma,
                                const void* mean, const void* rstd, int64_t* limbs);

/// hd: the call's summed int64 header; its payload (this op's limbs) is overwritten with the
/// final statistics.
template <class T>
void exact_row_apply_forward(const ExactRowArgs& a, const T* x, const T* gamma, const T* beta,
                             const Header& hd, double eps, T* y, void* mean, void* rstd, int* err);

template <class T>
void exact_row_apply_backward(const ExactRowArgs& a, const T* dy, const T* x, const T* gamma,
                              const void* mean, const void* rstd, const Header& hd, T* dx,
                              T* dgamma, T* dbeta, void* scratch, int* err);

/// Device scratch of the backward's dgamma/dbeta blocks (0 when neither is requested).
size_t exact_row_scratch_bytes(int64_t rows, int64_t h, bool params);

}  // namespace tpnorm::kernels::cuda
