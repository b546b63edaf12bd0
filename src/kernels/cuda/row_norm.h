// row_norm.h — CUDA kernels of the row norms (LayerNorm, RMSNorm) with a sharded hidden dim:
// the same partial / apply split as kernels/cpu/row_norm.h, on device memory, enqueued on a
// stream. They know nothing of communication.
//
// Stats buffer ("base"): the call's header (Header, call_header.h) followed by the payload, in the
// wire type W (double when w64, else float); payload per row as on CPU: centred {S1, S2},
// RMS {S2}; backward centred {Sg, Sgx}, RMS {Sgx}. Apply kernels read the global count n from
// the summed header and check it: a failed or disagreeing call (error flag != 0, fingerprint
// chunks with P*sum(c^2) != sum(c)^2, or n >= 2^24 with float wire) writes no output and sets
// *err = 1.
//
// Launch geometry is chosen on the host from h (kernels/cuda/plan.h): a warp per row when
// h <= 1024, else a 256-thread block per row, rows walked grid-stride; 16-byte vector loads
// when h and every pointer allow it, a compile-time number of them per thread. Everything is
// float32 inside (the robust mode accumulates around a per-row pivot, as on CPU); saved
// mean/rstd are float or double (s64).
//
// Backward bytes: the partial reads dy and x once for the row sums AND the dgamma / dbeta
// column sums (the saved mean / rstd are known before the collective), the apply reads them
// again for dx: 5 N s in all (N s = the bytes of one of dy, x, dx) plus a [blocks, 2, h]
// float scratch written once and read once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/call_header.h"

namespace tpnorm::kernels::cuda {

struct RowArgs {
  int64_t rows = 0, h = 0;
  bool centered = true;
  bool s64 = false;        ///< saved mean/rstd are double
  void* stream = nullptr;  ///< cudaStream_t
};

/// The partials write this rank's call header too when handed one (hw.nh > 0): block 0 of the
/// partial kernel, or the header kernel when there is no row to launch for.
template <class T>
void row_partial_forward(const RowArgs& a, const T* x, bool robust, bool w64, void* payload,
                         const HeaderWrite& hw = {});

template <class T>
void row_apply_forward(const RowArgs& a, const T* x, const T* gamma, const T* beta,
                       const Header& hd, double eps, T* y, void* mean, void* rstd, int* err);

/// Row sums into `payload`; with `scratch` (row_norm_scratch_bytes(rows, h, true) bytes) also
/// each block's dgamma / dbeta column sums, which row_apply_backward then adds up. Block b
/// writes slice b (row_bwd_parts(rows, h) slices); with `accumulate` it adds its sums to what
/// slice b holds (float), so that the row chunks of one call (ops/cuda/row_chunks_cuda.h), run
/// in order on one stream, add up in the slices of the first chunk, which has the most blocks.
template <class T>
void row_partial_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma,
                          const void* mean, const void* rstd, bool w64, void* payload,
                          void* scratch = nullptr, const HeaderWrite& hw = {},
                          bool accumulate = false);

/// dx from the summed statistics; dgamma/dbeta (may be null) as the sum, in block order, of
/// the column sums row_partial_backward left in `scratch` (deterministic for a given shape):
/// the first `parts` slices (< 0: row_bwd_parts(rows, h), this call's own partial's).
template <class T>
void row_apply_backward(const RowArgs& a, const T* dy, const T* x, const T* gamma, const void* mean,
                        const void* rstd, const Header& hd, T* dx, T* dgamma, T* dbeta,
                        void* scratch, int* err, int64_t parts = -1);

/// Device scratch the backward needs for dgamma/dbeta (0 when neither is requested).
size_t row_norm_scratch_bytes(int64_t rows, int64_t h, bool params);

}  // namespace tpnorm::kernels::cuda
