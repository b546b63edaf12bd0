// gpu_support.h — what the GPU tests share: the skip rule, device copies of test buffers, and
// one forward + backward of a row norm on any communicator.
//
// Without a usable CUDA device every GPU test calls TPNORM_REQUIRE_GPU(), which skips it with
// the reason; ctest matches the "tpnorm-gpu: no CUDA device" marker and reports the test as
// skipped (not passed).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "storage.h"
#include "tpnorm/norm.h"

namespace tpnorm_gpu {

/// True when a CUDA device can be used; else *why says what cudaGetDeviceCount reported.
inline bool have_gpu(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (n == 0) *why = "cudaGetDeviceCount returned 0";
  return n > 0;
}

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) cudaGetLastError(), n = 0;
  return n;
}

#define TPNORM_REQUIRE_GPU()                                         \
  do {                                                               \
    std::string why_;                                                \
    if (!::tpnorm_gpu::have_gpu(&why_))                              \
      GTEST_SKIP() << "tpnorm-gpu: no CUDA device (" << why_ << ")"; \
  } while (0)

#define TPNORM_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

/// A device copy of a test Buffer; `misalign` shifts it by one element so that no 16-byte
/// vector path can be taken.
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(const tpnorm_test::Buffer& host, bool misalign = false, int device = 0)
      : dtype_(host.dtype()), n_(host.size()), device_(device) {
    const size_t es = tpnorm::dtype_size(dtype_);
    off_ = misalign ? es : 0;
    if (cudaMalloc(&raw_, n_ * es + 16 + off_) != cudaSuccess) raw_ = nullptr;
    upload(host);
  }
  ~DevBuf() {
    if (raw_) cudaFree(raw_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept { *this = std::move(o); }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(raw_, o.raw_);
    dtype_ = o.dtype_, n_ = o.n_, off_ = o.off_, device_ = o.device_;
    return *this;
  }

  void* data() const { return raw_ ? static_cast<char*>(raw_) + off_ : nullptr; }
  void upload(const tpnorm_test::Buffer& host, cudaStream_t s = nullptr) {
    tpnorm_test::Buffer h = host;
    if (raw_)
      cudaMemcpyAsync(data(), h.view(tpnorm::Shape{int64_t(n_)}).data, bytes(),
                      cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
  }
  tpnorm_test::Buffer download() const {
    tpnorm_test::Buffer h(dtype_, n_);
    if (raw_)
      cudaMemcpy(h.view(tpnorm::Shape{int64_t(n_)}).data, data(), bytes(), cudaMemcpyDeviceToHost);
    return h;
  }
  std::vector<float> floats() const { return download().floats(); }
  tpnorm::TensorView view(tpnorm::Shape s) const {
    return {data(), dtype_, s, tpnorm::Device::cuda(device_)};
  }
  size_t bytes() const { return n_ * tpnorm::dtype_size(dtype_); }

 private:
  void* raw_ = nullptr;
  tpnorm::DType dtype_ = tpnorm::DType::F32;
  size_t n_ = 0, off_ = 0;
  int device_ = 0;
};

struct RowOut {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

/// Host inputs of one row-norm call (already rounded to the storage dtype).
struct RowIn {
  int64_t rows = 0, h = 0;
  tpnorm::DType dtype = tpnorm::DType::F32, saved = tpnorm::DType::F32;
  std::vector<float> x, dy, gamma, beta;  // gamma / beta empty: absent
};

/// Forward + backward on `comm`: on the GPU (device >= 0, buffers shifted when misalign) or
/// on host buffers (device < 0).
inline RowOut run_rows(tpnorm::Communicator& comm, bool centered, const RowIn& in, int device,
                       bool misalign = false, tpnorm::NormOptions opt = {}) {
  using namespace tpnorm;
  using tpnorm_test::Buffer;
  const int64_t R = in.rows, h = in.h;
  const Shape s{R, h}, p{h}, r{R};
  Buffer x(in.dtype, in.x), dy(in.dtype, in.dy), y(in.dtype, R * h), dx(in.dtype, R * h);
  Buffer gamma(in.dtype, in.gamma), beta(in.dtype, in.beta), dg(in.dtype, h), db(in.dtype, h);
  Buffer mean(in.saved, R), rstd(in.saved, R);
  const bool affine = !in.gamma.empty();
  auto run = [&](auto&& V) {
    const TensorView gv = affine ? V(gamma, p) : TensorView{};
    const TensorView bv = affine && centered ? V(beta, p) : TensorView{};
    if (centered) {
      layer_norm_forward(comm, V(x, s), gv, bv, V(y, s), V(mean, r), V(rstd, r), opt);
      layer_norm_backward(comm, V(dy, s), V(x, s), gv, V(mean, r), V(rstd, r), V(dx, s), V(dg, p),
                          V(db, p), opt);
    } else {
      rms_norm_forward(comm, V(x, s), gv, V(y, s), V(rstd, r), opt);
      rms_norm_backward(comm, V(dy, s), V(x, s), gv, V(rstd, r), V(dx, s), V(dg, p), opt);
    }
  };
  if (device < 0) {
    run([](Buffer& b, Shape sh) { return b.view(sh); });
    return {y.floats(), mean.floats(), rstd.floats(), dx.floats(), dg.floats(), db.floats()};
  }
  std::vector<DevBuf> dev;
  dev.reserve(10);
  Buffer* order[] = {&x, &dy, &y, &dx, &gamma, &beta, &dg, &db, &mean, &rstd};
  for (Buffer* b : order) dev.emplace_back(*b, misalign, device);
  run([&](Buffer& b, Shape sh) {
    for (size_t i = 0; i < 10; ++i)
      if (order[i] == &b) return dev[i].view(sh);
    return TensorView{};
  });
  cudaStreamSynchronize(static_cast<cudaStream_t>(comm.stream()));
  return {dev[2].floats(), dev[8].floats(), dev[9].floats(),
          dev[3].floats(), dev[6].floats(), dev[7].floats()};
}

}  // namespace tpnorm_gpu
