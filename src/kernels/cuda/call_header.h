// call_header.h — the device side of the call header (layout: common/call_header.h): the view
// the apply kernels get of a call's summed header, and the kernel that writes a rank's header
// into the device buffer of its collective. The packed call (ops/packed_call.cpp) launches
// it; communicators know nothing of it. No CUDA types here: CPU translation units include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpnorm::kernels::cuda {

/// Where the summed header of a call is, and how to read it, as a kernel argument. The header
/// is followed by the op's payload; base == nullptr means a call without a collective.
struct Header {
  const void* base = nullptr;  ///< header + payload on device
  int values = 2;              ///< header length in wire values (call_header::header_values)
  int ranks = 1;               ///< P, for the fingerprint check P * sum(c^2) == sum(c)^2
  bool w64 = true;             ///< wire type double (robust) or float (naive)
  /// Where this op's count and payload are, in wire values from base; -1: the call's own
  /// (call_header::kCountIndex, and right after the header). A batched call gives each item
  /// its summed column count slot and its statistics slice.
  int count_at = -1;
  int64_t payload_at = -1;
};

/// Enqueues on `stream` (a cudaStream_t) the write of `nh` header values (given as doubles,
/// at most call_header::kFullValues) in the wire type at `base`, then `zeros` zero values
/// (the payload of a rank that failed locally). The values travel as a kernel argument, so a
/// captured graph replays them. Throws tpnorm::Error if the launch fails.
void write_header(void* base, bool w64, const double* header, int nh, size_t zeros, void* stream);

/// Enqueues the write of n values (given as doubles; a host array read now, before the call
/// returns) in the wire type at `base`, e.g. a batched call's per-item counts. Graph-safe as
/// write_header: the values travel as kernel arguments.
void write_values(void* base, bool w64, const double* values, int64_t n, void* stream);

}  // namespace tpnorm::kernels::cuda
