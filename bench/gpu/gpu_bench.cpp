// gpu_bench — GB/s of each row-norm op's forward and backward on one GPU, next to a
// device-to-device copy of the same bytes in the same run (the practical ceiling).
//
// Bytes per call are the minimum the op must move: forward reads x and writes y; backward
// reads dy and x and writes dx (gamma, beta, the statistics and dgamma are small and not
// counted). The copy moves the same total (it reads and writes half each). Calls run on a
// single-GPU communicator in the steady state (set_strict_calls(0)), so the collective is the
// identity and the time is the kernels' (plus the header write). Median of `iters` calls timed
// with CUDA events.
//
// SyncBatchNorm (training mode) runs on the same buffers viewed as N x 64 channels x 64x64
// (N = rows*hidden / 2^18, when that is at least 1), NCHW and channels-last.
//
//   gpu_bench [rows=16384] [hidden=8192] [iters=30]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "tpnorm/batch_norm.h"
#include "tpnorm/cuda.h"
#include "tpnorm/norm.h"

using namespace tpnorm;

namespace {

#define BENCH_CUDA(expr)                                                          \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "gpu_bench: %s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

double median_ms(cudaStream_t s, int iters, const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(a, s));
    fn();
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t R = argc > 1 ? std::atoll(argv[1]) : 16384;
  const int64_t H = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 30;
  cudaStream_t s;
  BENCH_CUDA(cudaSetDevice(0));
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  auto comm = make_cuda_single_communicator(s, 0);
  comm->set_strict_calls(0);
  std::printf("gpu_bench: %s, rows %lld, hidden %lld, median of %d calls\n", prop.name,
              static_cast<long long>(R), static_cast<long long>(H), iters);
  std::printf("%-10s %-9s %-5s %9s %9s %9s %7s\n", "op", "pass", "dtype", "ms", "GB/s",
              "copyGB/s", "ofcopy");
  const size_t n = static_cast<size_t>(R * H);
  for (DType dt : {DType::BF16, DType::F32}) {
    const size_t es = dtype_size(dt);
    void *x, *y, *dy, *dx, *g, *b, *dg, *db, *mean, *rstd, *copy_src, *copy_dst;
    for (void** p : {&x, &y, &dy, &dx}) BENCH_CUDA(cudaMalloc(p, n * es));
    for (void** p : {&g, &b, &dg, &db}) BENCH_CUDA(cudaMalloc(p, H * es));
    for (void** p : {&mean, &rstd}) BENCH_CUDA(cudaMalloc(p, R * 4));
    BENCH_CUDA(cudaMalloc(&copy_src, n * es * 2));
    BENCH_CUDA(cudaMalloc(&copy_dst, n * es * 2));
    BENCH_CUDA(cudaMemset(x, 0x3c, n * es));  // finite values in every dtype
    BENCH_CUDA(cudaMemset(dy, 0x3c, n * es));
    BENCH_CUDA(cudaMemset(g, 0x3c, H * es));
    BENCH_CUDA(cudaMemset(b, 0, H * es));
    const Shape sx{R, H}, sp{H}, sr{R};
    auto v = [&](void* p, Shape sh) { return TensorView(p, dt, sh, Device::cuda(0)); };
    auto f = [&](void* p) { return TensorView(p, DType::F32, sr, Device::cuda(0)); };
    struct Row {
      const char* op;
      const char* pass;
      double bytes;
      std::function<void()> fn;
    };
    const std::vector<Row> rows = {
        {"LayerNorm", "forward", 2.0 * n * es,
         [&] { layer_norm_forward(*comm, v(x, sx), v(g, sp), v(b, sp), v(y, sx), f(mean), f(rstd)); }},
        {"LayerNorm", "backward", 3.0 * n * es,
         [&] {
           layer_norm_backward(*comm, v(dy, sx), v(x, sx), v(g, sp), f(mean), f(rstd), v(dx, sx),
                               v(dg, sp), v(db, sp));
         }},
        {"RMSNorm", "forward", 2.0 * n * es,
         [&] { rms_norm_forward(*comm, v(x, sx), v(g, sp), v(y, sx), f(rstd)); }},
        {"RMSNorm", "backward", 3.0 * n * es,
         [&] {
           rms_norm_backward(*comm, v(dy, sx), v(x, sx), v(g, sp), f(rstd), v(dx, sx), v(dg, sp));
         }},
    };
    // SyncBatchNorm over the same elements: C = 64 channels of 64x64, N = n / (64*4096).
    const int64_t bc = 64, bhw = 64, bn = static_cast<int64_t>(n) / (bc * bhw * bhw);
    BatchNormOptions bopt;
    auto cv = [&](void* p) { return TensorView(p, DType::F32, Shape{bc}, Device::cuda(0)); };
    void *rmean, *rvar;
    BENCH_CUDA(cudaMalloc(&rmean, bc * 4));
    BENCH_CUDA(cudaMalloc(&rvar, bc * 4));
    BENCH_CUDA(cudaMemset(rmean, 0, bc * 4));
    BENCH_CUDA(cudaMemset(rvar, 0, bc * 4));
    int64_t tracked = 0;
    std::vector<Row> all = rows;
    for (Layout lay : {Layout::kNCHW, Layout::kChannelsLast}) {
      if (bn < 1) break;
      const Shape bs = lay == Layout::kNCHW ? Shape{bn, bc, bhw, bhw} : Shape{bn, bhw, bhw, bc};
      const size_t bytes = static_cast<size_t>(bn * bc * bhw * bhw) * es;
      const char* name = lay == Layout::kNCHW ? "SyncBN" : "SyncBN-CL";
      all.push_back({name, "forward", 2.0 * bytes, [&, bs, lay] {
                       BatchNormOptions o = bopt;
                       o.layout = lay;
                       sync_batch_norm_forward(*comm, v(x, bs), v(g, Shape{bc}), v(b, Shape{bc}),
                                               cv(rmean), cv(rvar), &tracked, v(y, bs),
                                               cv(mean), cv(rstd), o);
                     }});
      all.push_back({name, "backward", 3.0 * bytes, [&, bs, lay] {
                       BatchNormOptions o = bopt;
                       o.layout = lay;
                       sync_batch_norm_backward(*comm, v(dy, bs), v(x, bs), v(g, Shape{bc}),
                                                cv(mean), cv(rstd), v(dx, bs), v(dg, Shape{bc}),
                                                v(db, Shape{bc}), o);
                     }});
    }
    for (const Row& r : all) {
      const double ms = median_ms(s, iters, r.fn);
      // The copy moves the same bytes: it reads half of them and writes the other half.
      const size_t half = static_cast<size_t>(r.bytes / 2);
      const double cms = median_ms(s, iters, [&] {
        BENCH_CUDA(cudaMemcpyAsync(copy_dst, copy_src, half, cudaMemcpyDeviceToDevice, s));
      });
      const double gbs = r.bytes / (ms * 1e6), cgbs = r.bytes / (cms * 1e6);
      std::printf("%-10s %-9s %-5s %9.3f %9.0f %9.0f %6.0f%%\n", r.op, r.pass, dtype_name(dt), ms,
                  gbs, cgbs, 100.0 * gbs / cgbs);
    }
    try {
      cuda_check_errors(*comm);
    } catch (const std::exception& e) {
      std::printf("gpu_bench: %s\n", e.what());
      return 1;
    }
    for (void* p : {x, y, dy, dx, g, b, dg, db, mean, rstd, copy_src, copy_dst, rmean, rvar})
      cudaFree(p);
  }
  comm.reset();
  cudaStreamDestroy(s);
  return 0;
}
