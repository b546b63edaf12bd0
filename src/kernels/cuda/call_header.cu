// call_header.cu — the header-writing kernel; see call_header.h.
#include <algorithm>

#include "common/call_header.h"
#include "common/slice_tiling.h"
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

__global__ void slice_row_kernel(void* base, Wire wire, int64_t at, int ranks, int rank,
                                 int64_t offset, int64_t count) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < 2 * ranks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = i == 2 * rank ? offset : i == 2 * rank + 1 ? count : 0;
    if (wire == Wire::kI64)
      static_cast<int64_t*>(base)[at + i] = v;
    else
      store_fd(base, at + i, wire == Wire::kF64, static_cast<double>(v));
  }
}

__global__ void untiled_kernel(void* base, Wire wire, int64_t at, int ranks, int64_t total) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  auto load = [&](int i) -> double {
    if (wire == Wire::kI64) return static_cast<double>(static_cast<const int64_t*>(base)[at + i]);
    return load_fd(base, at + i, wire == Wire::kF64);
  };
  if (detail::slices_tile(load, ranks, total)) return;
  namespace ch = detail::call_header;
  if (wire == Wire::kI64)
    static_cast<int64_t*>(base)[ch::kErrorIndex] = 1;
  else
    store_fd(base, ch::kErrorIndex, wire == Wire::kF64, 1.0);
}

}  // namespace

void write_slice_row(void* base, Wire wire, int64_t at, int ranks, int rank, int64_t offset,
                     int64_t count, void* stream) {
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((2 * ranks + 255) / 256, 64));
  launch("slice_row_kernel", slice_row_kernel, dim3(blocks), dim3(256),
         static_cast<cudaStream_t>(stream), base, wire, at, ranks, rank, offset, count);
}

void fail_untiled(void* base, Wire wire, int64_t at, int ranks, int64_t total, void* stream) {
  launch("untiled_kernel", untiled_kernel, dim3(1), dim3(32), static_cast<cudaStream_t>(stream),
         base, wire, at, ranks, total);
}

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
