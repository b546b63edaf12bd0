// slices.h — the check that the ranks' slices of a sharded dimension tile it exactly (no gap, no
// overlap), made inside the call's one collective. Each rank writes its slice [offset, offset +
// count) into its own slot of a table of 2P values at the end of the payload (zeros in the other
// slots); after the sum every rank holds every rank's slice and reaches the same verdict, so a
// bad layout is the same tpnorm::Error on every rank. A sum of the counts alone (the call
// header's count) would accept overlapping slices whose counts add up: every rank at offset 0
// holding half of the channels.
//
// The runner (run_op.cpp) appends the table for a spec whose PayloadSize names a Slice, at
// P > 1, writes this rank's slot after the partial (PackedCall::write_slice) and checks the
// summed table before the apply: on a host here, on a device by a kernel that marks the summed
// header failed (PackedCall::check_slices_on_device), so the apply kernels write nothing. The
// verdict itself is common/slice_tiling.h's, on both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tpnorm::detail {

/// This rank's slice of a sharded dimension of `total` elements (PayloadSize::slice).
struct Slice {
  const char* dim = nullptr;  ///< what is sliced, e.g. "channel" (nullptr: not sliced)
  int64_t offset = 0;         ///< first element of this rank's slice
  int64_t count = 0;          ///< elements of this rank's slice (0: none)
  int64_t total = 0;          ///< elements of the whole dimension (agreed)
  bool present() const { return dim != nullptr; }
};

/// Values of the table: 2 per rank; none at one rank (the validator's own checks suffice).
inline size_t slice_table_values(int ranks) {
  return ranks > 1 ? 2 * static_cast<size_t>(ranks) : 0;
}

/// Throws tpnorm::Error (kInvalidArgument) unless the summed table (2 * ranks values, every
/// rank's (offset, count)) tiles [0, total): the message lists every rank's slice and names the
/// first element held twice or by no rank. Empty slices are ignored wherever they sit.
void check_slice_table(const std::vector<double>& table, int ranks, const Slice& s, const char* op);

/// The message of check_slice_table, or "" when the slices tile (for tests and the device).
std::string slice_table_problem(const std::vector<double>& table, int ranks, int64_t total,
                                const char* dim);

}  // namespace tpnorm::detail
