// row_chunks_cuda.cpp — see row_chunks_cuda.h. A chunk is a row slice of the call's tensors
// (row_stages.h rows_of) run through the unchunked hooks' `_at` forms, with the payload slice
// of its rows: the partial writes from payload value begin * width on, the apply reads the
// summed header (chunk 0's collective carries it) and the statistics from the same place
// (kernels::cuda::Header::payload_at).
#include "ops/cuda/row_chunks_cuda.h"

#include "ops/cuda/device_call.h"
#include "ops/cuda/row_norm_cuda.h"

namespace tpnorm::detail {
namespace {

int64_t forward_width(const RowForwardCall& c) {
  return row_stat_width(c.a.centered, c.opt.stats, true);
}

}  // namespace

void row_forward_partial_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                   const RowForwardCall& c, const ChunkRows& rows) {
  const size_t at = static_cast<size_t>(rows.begin * forward_width(c)) * dtype_size(call.wire());
  row_forward_partial_at(dev, rows_of(c.a, rows.begin, rows.end), c.opt.stats,
                         call.wire() == DType::F64, static_cast<char*>(call.payload_data()) + at);
}

void row_forward_apply_rows_cuda(PackedCall& call, DeviceCommunicator& dev,
                                 const RowForwardCall& c, const ChunkRows& rows) {
  kernels::cuda::Header hd = device_header(call, dev);
  hd.payload_at = static_cast<int64_t>(call.header_values()) + rows.begin * forward_width(c);
  row_forward_apply_at(dev, rows_of(c.a, rows.begin, rows.end), c.opt.eps, hd);
}

}  // namespace tpnorm::detail
