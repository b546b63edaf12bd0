// row_chunks_cuda.cpp — see row_chunks_cuda.h. A chunk is a row slice of the call's tensors
// (row_stages.h rows_of) run through the unchunked hooks' `_at` forms, with the payload slice
// of its rows: the partial writes from payload value begin * width on, the apply reads the
// summed header (chunk 0's collective carries it) and the statistics from the same place
// (kernels::cuda::Header::payload_at). The partials pass no HeaderWrite: check_header_first
// wrote the header before chunk 0's partial.
#include "ops/cuda/row_chunks_cuda.h"

#include "kernels/cuda/plan.h"
#include "ops/cuda/device_call.h"
#include "ops/cuda/row_norm_cuda.h"

namespace tpnorm::detail {
namespace {

int64_t forward_width(const RowForwardCall& c) {
  return row_stat_width(c.a.centered, c.opt.stats, true);
}
int64_t backward_width(const RowBackwardCall& c) {
  return row_stat_width(c.a.centered, c.opt.stats, false);
}
void* payload_at(PackedCall& call, const ChunkRows& rows, int64_t width) {
  return static_cast<char*>(call.payload_data()) +
         static_cast<size_t>(rows.begin * width) * dtype_size(call.wire());
}
kernels::cuda::Header header_at(PackedCall& call, DeviceCommunicator& dev, const ChunkRows& rows,
                                int64_t width, const NormOptions& opt) {
  kernels::cuda::Header hd = device_header(call, dev, hidden_want(opt));
  hd.payload_at = static_cast<int64_t>(call.header_values()) + rows.begin * width;
  return hd;
}

}  // namespace

void row_forward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                   const RowForwardCall& c, const ChunkRows& rows) {
  row_forward_partial_at(dev, rows_of(c.a, rows.begin, rows.end), c.opt.stats,
                         call.wire() == DType::F64, payload_at(call, rows, forward_width(c)));
}

void row_forward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const RowForwardCall& c, const ChunkRows& rows) {
  row_forward_apply_at(dev, rows_of(c.a, rows.begin, rows.end), c.opt.eps,
                       header_at(call, dev, rows, forward_width(c), c.opt));
}

// Chunk 0 writes the column-sum slices, later chunks add into them (see the header).
void row_backward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                    const RowBackwardCall& c, const ChunkRows& rows) {
  row_backward_partial_at(dev, rows_of(c.a, rows.begin, rows.end), c.opt.stats,
                          call.wire() == DType::F64, payload_at(call, rows, backward_width(c)),
                          call.scratch(), {}, !rows.first);
}

// dx of the chunk's rows; dgamma / dbeta once, by the last chunk, from chunk 0's slices.
void row_backward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                  const RowBackwardCall& c, const ChunkRows& rows) {
  RowBackward a = rows_of(c.a, rows.begin, rows.end);
  if (!rows.last) a.dgamma = a.dbeta = TensorView{};
  row_backward_apply_at(dev, a, header_at(call, dev, rows, backward_width(c), c.opt), call.scratch(),
                        kernels::cuda::row_bwd_parts(rows.size, c.a.g.h));
}

}  // namespace tpnorm::detail
