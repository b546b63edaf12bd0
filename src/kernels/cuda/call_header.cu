// call_header.cu — the header-writing kernel; see call_header.h.
#include <algorithm>

#include "common/call_header.h"
#include "kernels/cuda/call_header.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launch.cuh"

namespace tpnorm::kernels::cuda {
namespace {

struct HeaderValues {
  double v[detail::call_header::kFullValues];
};

__global__ void header_kernel(void* base, Wire wire, HeaderValues hv, int nh, size_t zeros) {
  const size_t total = static_cast<size_t>(nh) + zeros;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double v = i < static_cast<size_t>(nh) ? hv.v[i] : 0.0;
    if (wire == Wire::kI64)  // header values are small integers, exact in double
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
    else
      store_fd(base, static_cast<int64_t>(i), wire == Wire::kF64, v);
  }
}

}  // namespace

void write_header(void* base, Wire wire, const double* header, int nh, size_t zeros, void* stream) {
  HeaderValues hv{};
  nh = std::min(nh, detail::call_header::kFullValues);
  for (int i = 0; i < nh; ++i) hv.v[i] = header[i];
  const size_t total = static_cast<size_t>(nh) + zeros;
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((total + 255) / 256, 1024));
  launch("header_kernel", header_kernel, dim3(blocks), dim3(256), static_cast<cudaStream_t>(stream),
         base, wire, hv, nh, zeros);
}

void write_header(const HeaderWrite& hw, void* stream) {
  if (hw.nh > 0) write_header(hw.base, hw.w64 ? Wire::kF64 : Wire::kF32, hw.v, hw.nh, 0, stream);
}

void write_values(void* base, Wire wire, const double* values, int64_t n, void* stream) {
  constexpr int kPer = detail::call_header::kFullValues;
  char* p = static_cast<char*>(base);
  for (int64_t i = 0; i < n; i += kPer)
    write_header(p + i * (wire == Wire::kF32 ? 4 : 8), wire, values + i,
                 static_cast<int>(std::min<int64_t>(kPer, n - i)), 0, stream);
}

}  // namespace tpnorm::kernels::cuda
