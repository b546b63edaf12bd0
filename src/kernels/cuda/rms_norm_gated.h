// rms_norm_gated.h — CUDA kernels of the gated RMSNorm (tpnorm/rms_norm_gated.h), the device
// side of kernels/cpu/rms_norm_gated.h (same layout: one statistic per (row, group) of ALL
// groups, 0 for groups this rank holds no channel of): x, z [rows, c_local], this rank's
// channels [c0, c0 + c_local), channel c in group c / group_size.
//
// Kernels: a block per (row, group) slot sums u^2 (forward) or g*uhat (backward) over the
// slot's local channels (block sum in a fixed order); a thread per local channel adds its
// dweight terms over the rows in row order into scratch (float64); the element-wise applies
// check the summed header on device (error flag, fingerprint, and that the ranks' channel
// counts add up to `hidden`): a failed call writes nothing and sets *err. float32 and float64
// wires (Stats::kRobust, kNaive); Stats::kExact and float32 weights next to fp16/bf16 x are
// CPU-only so far (the spec declares no exact device hooks; the validator refuses the latter).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/call_header.h"

namespace tpnorm::kernels::cuda {

struct GatedArgs {
  int64_t rows = 0, c_local = 0, c0 = 0, group_size = 1, groups = 0;
  int64_t hidden = 0;  ///< all channels: what the header's summed count must be
  bool norm_before_gate = false;
  bool s64 = false;        ///< saved rstd is double
  void* stream = nullptr;  ///< cudaStream_t
};

/// Device scratch the functions below need (the backward's dweight sums).
size_t gated_scratch_bytes(const GatedArgs& a);

/// payload [rows * groups] of float (w64 false) or double; z may be null (no gate).
template <class T>
void gated_partial_forward(const GatedArgs& a, const T* x, const T* z, bool w64, void* payload);

/// y, and rstd [rows * groups] when non-null; w may be null.
template <class T>
void gated_apply_forward(const GatedArgs& a, const Header& hd, double eps, const T* x, const T* z,
                         const T* w, T* y, void* rstd, int* err);

/// payload as the forward's (sums of g*uhat); dweight sums into scratch when `dweight`.
template <class T>
void gated_partial_backward(const GatedArgs& a, const T* dy, const T* x, const T* z, const T* w,
                            const void* rstd, bool w64, void* payload, bool dweight, void* scratch);

/// dx, dz (when z is non-null) and dweight [c_local] (when non-null) from scratch.
template <class T>
void gated_apply_backward(const GatedArgs& a, const Header& hd, const T* dy, const T* x, const T* z,
                          const T* w, const void* rstd, T* dx, T* dz, T* dweight,
                          const void* scratch, int* err);

}  // namespace tpnorm::kernels::cuda
