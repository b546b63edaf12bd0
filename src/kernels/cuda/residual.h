// residual.h — CUDA kernels of the fused residual add around the row norms, the device side of
// kernels/cpu/residual.h: h = alpha*x + f written before the row norm's partial reads h (so
// the statistics describe h as stored), and the backward epilogue dh = dnorm + dh_extra,
// df = dh, dx = alpha*dh. Rounded exactly as on CPU: the product and the sum each in float32
// (no fused multiply-add, which the CPU build does not contract either), then to T once.
// h may alias x or f, and df holds dnorm on entry (each element is read before it is written).
// They know nothing of communication.
#pragma once

#include <cstdint>

#include "kernels/cuda/call_header.h"

namespace tpnorm::kernels::cuda {

/// h[i] = alpha * x[i] + f[i], i < n, on `stream` (a cudaStream_t).
template <class T>
void residual_add(int64_t n, const T* x, const T* f, float alpha, T* h, void* stream);

/// dh = df[i] + (dh_extra ? dh_extra[i] : 0); df[i] = dh; dx[i] = alpha * dh — only when the
/// call's summed header `hd` accepts the call (else nothing is written, as in every apply).
template <class T>
void residual_backward_epilogue(const Header& hd, int64_t n, const T* dh_extra, float alpha,
                                T* df, T* dx, void* stream);

}  // namespace tpnorm::kernels::cuda
