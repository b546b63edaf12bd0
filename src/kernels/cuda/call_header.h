// call_header.h — the device side of the call header (layout: common/call_header.h): the view
// the apply kernels get of a call's summed header, and the kernel that writes a rank's header
// into the device buffer of its collective. The packed call (ops/packed_call.cpp) launches
// it, unless the op's partial kernel wrote the header itself (HeaderWrite); communicators
// know nothing of it. No CUDA types here: CPU translation units include it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/call_header.h"

namespace tpnorm::kernels::cuda {

/// Where the summed header of a call is, and how to read it, as a kernel argument. The header
/// is followed by the op's payload; base == nullptr means a call without a collective.
struct Header {
  const void* base = nullptr;  ///< header + payload on device
  int values = 2;              ///< header length in wire values (call_header::header_values)
  int ranks = 1;               ///< P, for the fingerprint check P * sum(c^2) == sum(c)^2
  bool w64 = true;             ///< wire values of 8 bytes (robust, exact) or 4 (naive)
  bool i64 = false;            ///< int64 wire values (Stats::kExact; w64 is then true too)
  /// Where this op's count and payload are, in wire values from base; -1: the call's own
  /// (call_header::kCountIndex, and right after the header). A batched call gives each item
  /// its summed column count slot and its statistics slice.
  int count_at = -1;
  int64_t payload_at = -1;
  /// The summed count the call requires (a row norm's hidden size, which the ranks' slices
  /// must tile); a header whose count differs is rejected. < 0: any count.
  double count_want = -1;
};

/// How a call's wire values are stored: float32 (Stats::kNaive), float64 (kRobust), int64
/// (kExact).
enum class Wire { kF32, kF64, kI64 };

/// A rank's header, for a kernel that writes it into its call's device buffer itself: the row
/// norms' partial kernels do (block 0, thread 0), which saves the header kernel's launch
/// (PackedCall::take_device_header). The values travel as a kernel argument, as in
/// write_header. nh == 0: nothing to write.
struct HeaderWrite {
  void* base = nullptr;  ///< the call's device buffer (header first)
  bool w64 = true;       ///< wire type double, else float (never int64: Stats::kExact
                         ///< calls leave the header to the header kernel)
  int nh = 0;            ///< values to write, at most call_header::kFullValues
  double v[detail::call_header::kFullValues] = {};
};

/// Enqueues on `stream` (a cudaStream_t) the write of `nh` header values (given as doubles,
/// at most call_header::kFullValues) in the wire type at `base`, then `zeros` zero values
/// (the payload of a rank that failed locally). The values travel as a kernel argument, so a
/// captured graph replays them. Throws tpnorm::Error if the launch fails.
void write_header(void* base, Wire wire, const double* header, int nh, size_t zeros, void* stream);
/// write_header of a HeaderWrite (nothing when hw.nh == 0): for a partial that launches no
/// kernel (no rows) but was handed the header.
void write_header(const HeaderWrite& hw, void* stream);

/// Enqueues the write of n values (given as doubles; a host array read now, before the call
/// returns) in the wire type at `base`, e.g. a batched call's per-item counts. Graph-safe as
/// write_header: the values travel as kernel arguments.
void write_values(void* base, Wire wire, const double* values, int64_t n, void* stream);

/// Enqueues the write of a rank's row of a slice table (ops/slices.h) at value `at` from
/// `base`: 2 * ranks values, (offset, count) in slot `rank`, zeros elsewhere. One launch.
void write_slice_row(void* base, Wire wire, int64_t at, int ranks, int rank, int64_t offset,
                     int64_t count, void* stream);

/// Enqueues the check of a summed slice table at value `at` from `base` (the call's summed
/// header + payload): when the slices do not tile [0, total) (common/slice_tiling.h) it marks
/// the header failed (its error slot), so the call's apply kernels reject it on every rank.
void fail_untiled(void* base, Wire wire, int64_t at, int ranks, int64_t total, void* stream);

}  // namespace tpnorm::kernels::cuda
