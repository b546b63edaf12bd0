// Host test (no GPU needed), compiled by nvcc: the robust pivot the CUDA kernels use is the
// CPU kernels' (common/pivot.h). The CUDA row and SyncBatchNorm kernels call
// detail::robust_pivot / detail::channel_pivot on the CUDA storage types (__half,
// __nv_bfloat16); the CPU kernels on tpnorm's (f16, bf16). Both are TPNORM_HD, so here, on the
// host, the CUDA-typed instantiations must pick bit-identical pivots to the CPU-typed ones for
// the same stored bits, rows and channels (both layouts), at offset 1e4 + N(0, 1.5).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/half.h"
#include "common/pivot.h"
#include "harness.h"
#include "storage.h"

namespace {

template <class Host, class Cuda>
void same_pivots(tpnorm::DType dt) {
  using tpnorm::detail::channel_pivot;
  using tpnorm::detail::robust_pivot;
  static_assert(sizeof(Host) == sizeof(Cuda), "layout-compatible storage types");
  const int64_t n = 3, c = 5, inner = 40;
  const tpnorm_test::Buffer b(dt, tpnorm_test::normal(31, 0, n * c * inner, 1e4, 1.5));
  std::vector<Host> host(n * c * inner);
  std::memcpy(host.data(),
              const_cast<tpnorm_test::Buffer&>(b).view(tpnorm::Shape{n * c * inner}).data,
              host.size() * sizeof(Host));
  std::vector<Cuda> dev(host.size());
  std::memcpy(dev.data(), host.data(), host.size() * sizeof(Host));
  int compared = 0;
  for (int64_t len : {1, 5, 31, 32, 33, 200}) {  // rows: spans below, at and past 32
    const float a = robust_pivot(host.data(), len), d = robust_pivot(dev.data(), len);
    EXPECT_EQ(std::memcmp(&a, &d, sizeof a), 0) << "row of " << len << ": " << a << " vs " << d;
    ++compared;
  }
  for (bool cl : {false, true})
    for (int64_t ch = 0; ch < c; ++ch) {
      const float a = channel_pivot(host.data(), n, c, inner, cl, ch);
      const float d = channel_pivot(dev.data(), n, c, inner, cl, ch);
      EXPECT_EQ(std::memcmp(&a, &d, sizeof a), 0) << "channel " << ch << (cl ? " cl" : " nchw");
      EXPECT_NEAR(a, 1e4, 70.0) << "near the values' mean (bf16 steps by 64 at 1e4)";
      ++compared;
    }
  EXPECT_EQ(compared, 16);
}

TEST(GpuPivot, CudaTypesPickTheCpuPivotFp32) { same_pivots<float, float>(tpnorm::DType::F32); }
TEST(GpuPivot, CudaTypesPickTheCpuPivotFp16) {
  same_pivots<tpnorm::f16, __half>(tpnorm::DType::F16);
}
TEST(GpuPivot, CudaTypesPickTheCpuPivotBf16) {
  same_pivots<tpnorm::bf16, __nv_bfloat16>(tpnorm::DType::BF16);
}

}  // namespace
