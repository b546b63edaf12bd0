// exact_device.cuh — device helpers of the Stats::kExact kernels (exact_rows.cu,
// exact_groups.cu): the integer max over a row's threads (their int64 limbs are summed by
// device_common.cuh's group_sum), the summed int64 header check, the op's payload in the
// summed buffer, and one row's (or slot's) limbs written in the CPU's layout. Integer
// operations only: any order gives the same result.
#pragma once

#include <cstdint>

#include "common/exact_sum.h"
#include "kernels/cuda/call_header.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/exact_acc.h"

namespace tpnorm::kernels::cuda {
namespace {

namespace ch = detail::call_header;

// The max of v over the tpr threads of a row (a warp, or the whole block: every thread of the
// block must call). An integer max: the same whatever the order.
__device__ __forceinline__ int group_max(int v, int tpr) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (tpr <= 32) return v;
  __shared__ int sm[32];
  const int w = threadIdx.x / 32, nw = blockDim.x / 32;
  __syncthreads();  // an earlier call's readers are done with sm
  if (threadIdx.x % 32 == 0) sm[w] = v;
  __syncthreads();
  int m = 0;
  for (int i = 0; i < nw; ++i) m = max(m, sm[i]);
  return m;
}

// The summed int64 header (layout: common/call_header.h): no rank failed, every fingerprint
// chunk agrees (P * sum(c^2) == sum(c)^2, in 128 bits) and 0 <= n < 2^32 (exact::kMaxCount).
__device__ __forceinline__ bool exact_header_ok(const Header& hd, int64_t* n) {
  const int64_t* h = static_cast<const int64_t*>(hd.base);
  bool bad = h[ch::kErrorIndex] != 0;
  for (int i = 0; i < ch::kChunks && ch::kBaseValues + 2 * i + 1 < hd.values; ++i) {
    const __int128 s1 = h[ch::kBaseValues + 2 * i], s2 = h[ch::kBaseValues + 2 * i + 1];
    if (static_cast<__int128>(hd.ranks) * s2 != s1 * s1) bad = true;
  }
  *n = h[hd.count_at >= 0 ? hd.count_at : ch::kCountIndex];
  if (*n < 0 || *n >= (int64_t{1} << 32)) bad = true;
  if (hd.count_want >= 0 && static_cast<double>(*n) != hd.count_want) bad = true;
  return !bad;
}

// This op's limbs (or, after finish, its final statistics) in the summed buffer.
__device__ __forceinline__ int64_t* exact_payload(const Header& hd) {
  const int64_t at = hd.payload_at >= 0 ? hd.payload_at : hd.values;
  return const_cast<int64_t*>(static_cast<const int64_t*>(hd.base)) + at;
}

// Writes one row's limbs from the row's summed thread limbs l = {bad, sum a (kLimbs1), sum b
// (B limbs)}: normalized (exact::pack's layout, as on the CPU) into the row's `limbs` slots,
// {bad, sum a, sum b} centred or {bad, sum b}.
template <int B, int K>
__device__ __forceinline__ void write_row_limbs(int64_t (&l)[K], int64_t* out, int limbs) {
  static_assert(K == 1 + exact::kLimbs1 + B, "limbs: bad, sum a, sum b");
  constexpr int WB = B == exact::kLimbs2 ? 8 : 4;  // exact::Sum2 or Sum1 words
  out[0] = l[0];
  if (limbs == K) {  // centred: both sums
    exact_normalize<4>(l + 1, exact::kLimbs1);
    for (int i = 0; i < exact::kLimbs1; ++i) out[1 + i] = l[1 + i];
  }
  exact_normalize<WB>(l + 1 + exact::kLimbs1, B);
  for (int i = 0; i < B; ++i) out[limbs - B + i] = l[1 + exact::kLimbs1 + i];
}

}  // namespace
}  // namespace tpnorm::kernels::cuda
