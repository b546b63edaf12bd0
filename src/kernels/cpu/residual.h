// residual.h — CPU kernels of the fused residual add (h = alpha*x + f) around the row norms.
//
// The forward partial writes each row of h and reduces that row's statistics while the row is
// still in cache: it reuses row_partial_forward on the row it has just written (same pivoted
// accumulation, same stats layout, see row_norm.h) instead of a second pass over h in memory.
// Statistics are taken of h as stored (rounded to T), so the apply phase, which reads h, sees
// exactly the values the statistics describe. Rows are contiguous with a.h columns; h may alias
// x or f (each element is read before it is written).
#pragma once

#include <cstdint>

#include "kernels/cpu/row_norm.h"

namespace tpnorm::kernels::cpu {

template <class T, class W>
void residual_partial_forward(const RowNormArgs& a, const T* x, const T* f, float alpha, T* h,
                              W* stats);

/// The residual epilogue of the backward: dh = dnorm + dh_extra; df = dh; dx = alpha * dh.
/// dnorm lives in df on entry (the norm's input gradient); dh_extra may be null. n elements.
template <class T>
void residual_backward_epilogue(int64_t n, const T* dh_extra, float alpha, T* df, T* dx,
                                int threads);

// float64 storage: double kernels of their own (kernels/cpu/float64.cpp).
template <>
void residual_partial_forward<double, float>(const RowNormArgs&, const double*, const double*,
                                             float, double*, float*);
template <>
void residual_partial_forward<double, double>(const RowNormArgs&, const double*, const double*,
                                              float, double*, double*);
template <>
void residual_backward_epilogue<double>(int64_t, const double*, float, double*, double*, int);

}  // namespace tpnorm::kernels::cpu
