// row_chunks_cuda.h — the device hooks of a chunked LayerNorm / RMSNorm call (ops/chunking.h,
// run_op's row chunks): the partial and apply kernels of rows [begin, end), on the
// communicator's stream, reading and writing that chunk's slice of the call's payload. The
// chunk's collective runs on the communicator's collective stream, ordered by events
// (Communicator::start_all_reduce_sum / wait), so chunk k+1's partial overlaps chunk k's sum and
// chunk k's apply re-reads x (backward: x and dy) from L2.
//
// Backward dgamma / dbeta: each chunk's partial adds its blocks' column sums into the SAME
// scratch slices (block b into slice b; chunk 0 writes them, later chunks add, in chunk order
// on one stream), so the scratch is the unchunked call's size (chunk 0 has the most blocks:
// row_bwd_parts grows with rows) and every rank sizes it before the plan is known. The last
// chunk's apply adds chunk 0's slices once (dgamma_final). Deterministic for a given shape and
// plan; NOT the unchunked call's bits in general (other rows per block, float adds per chunk).
// Not for Stats::kExact (row_norm.cpp chunkable).
#pragma once

#include "ops/op_spec.h"
#include "ops/row_stages.h"

namespace tpnorm::detail {

void row_forward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                   const RowForwardCall& c, const ChunkRows& rows);
void row_forward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const RowForwardCall& c, const ChunkRows& rows);
void row_backward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                    const RowBackwardCall& c, const ChunkRows& rows);
void row_backward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                  const RowBackwardCall& c, const ChunkRows& rows);

}  // namespace tpnorm::detail
