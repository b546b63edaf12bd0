// slice_tiling.h — whether the ranks' slices of a dimension tile it: the verdict on a summed
// slice table (ops/slices.h), shared by the host check and the device kernel that marks a call
// whose table does not tile (kernels/cuda/call_header.cu), so both decide alike.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace tpnorm::detail {

/// True when the slices [at(2r), at(2r) + at(2r + 1)), r < ranks, tile [0, total): every
/// non-empty slice inside it, the counts adding up to total and no two non-empty slices
/// overlapping (then none is missing). Empty slices may sit anywhere. O(ranks^2), for the
/// tensor-parallel group sizes it serves.
template <class At>
TPNORM_HD bool slices_tile(At at, int ranks, int64_t total) {
  int64_t sum = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto o = static_cast<int64_t>(at(2 * r)), n = static_cast<int64_t>(at(2 * r + 1));
    if (n < 0 || (n > 0 && (o < 0 || o > total - n))) return false;
    sum += n;
  }
  if (sum != total) return false;
  for (int r = 0; r < ranks; ++r) {
    const auto o = static_cast<int64_t>(at(2 * r)), n = static_cast<int64_t>(at(2 * r + 1));
    for (int q = r + 1; n > 0 && q < ranks; ++q) {
      const auto p = static_cast<int64_t>(at(2 * q)), m = static_cast<int64_t>(at(2 * q + 1));
      if (m > 0 && p < o + n && o < p + m) return false;
    }
  }
  return true;
}

}  // namespace tpnorm::detail
