// row_chunks_cuda.h — the device hooks of a chunked LayerNorm / RMSNorm forward (ops/chunking.h,
// run_op's row chunks): the partial and apply kernels of rows [begin, end), on the
// communicator's stream, reading and writing that chunk's slice of the call's payload. The
// chunk's collective runs on the communicator's collective stream, ordered by events
// (Communicator::start_all_reduce_sum / wait), so chunk k+1's partial overlaps chunk k's sum and
// chunk k's apply re-reads x from L2. The backward is not chunked on device: its dgamma/dbeta
// pass reads every row itself (kernels/cuda/row_norm.h).
#pragma once

#include "ops/op_spec.h"
#include "ops/row_stages.h"

namespace tpnorm::detail {

void row_forward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                   const RowForwardCall& c, const ChunkRows& rows);
void row_forward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const RowForwardCall& c, const ChunkRows& rows);

}  // namespace tpnorm::detail
