// gpu_bench — what a user decides on, per op, pass, dtype and shape, on one GPU:
//
//   min_MB    the bytes the op must move: forward reads x and writes y (2 N s), backward reads
//             dy and x and writes dx (3 N s); gamma, beta, statistics and dgamma not counted
//   ms        median time of the whole call (partial, header, collective, apply) on the bench's
//             communicator: NCCL at world size 1 when the build has NCCL, else the single-GPU one
//   GB/s      min_MB / ms; copyGB/s: a device-to-device copy of the same bytes (read half,
//             write half) in the same run; ofcopy: the ratio (the target)
//   kern_MB   the bytes the call's kernels really move, from the library's own accounting
//             (tpnorm/cuda_traffic.h); kern/min: kern_MB / min_MB
//   local_ms  the same call on a single-GPU communicator (its collective is the identity: the
//             local kernels and the header write)
//   ar_ms     a bare all_reduce_sum of the call's header + payload (float64) on the bench's
//             communicator; call/sum = ms / (local_ms + ar_ms) (the issue's <= 1.15 target)
//
// Shapes: the row norms at 4096x1024, 16384x1024, 16384x1536, 16384x8192 (or only ROWSxHIDDEN
// when given), SyncBatchNorm at 32x64x56x56, NCHW and channels-last, training (forward,
// backward) and eval with running statistics (eval-fwd, and eval-bwd without dgamma / dbeta:
// 2 N s each, no collective, so ar_ms and call/sum say nothing there); fp32 and bf16.
// Calls run in the steady state (set_strict_calls(0): no host check); median of `iters`
// timed calls after 3 warm-up calls, CUDA events on the communicator's stream.
//
//   gpu_bench [ROWS HIDDEN [ITERS]] [--iters N] [--json FILE]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tpnorm/batch_norm.h"
#include "tpnorm/cuda.h"
#include "tpnorm/cuda_traffic.h"
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

// One measured call: its name, its minimum bytes, its payload (float64 values) and the
// kernels' accounting; run(comm) makes the call on a communicator.
struct Case {
  std::string op, pass, shape;
  double min_bytes;
  size_t payload_values;
  Traffic traffic;
  std::function<void(Communicator&)> run;
};

struct Result {
  const Case* c;
  const char* dtype;
  double ms, copy_ms, local_ms, ar_ms;
};

void print_json(FILE* f, const std::vector<Result>& rs, const char* device, const char* comm,
                int iters, size_t header_values) {
  std::fprintf(f, "{\n  \"device\": \"%s\", \"comm\": \"%s\", \"iters\": %d,\n  \"rows\": [\n",
               device, comm, iters);
  for (size_t i = 0; i < rs.size(); ++i) {
    const Result& r = rs[i];
    const Case& c = *r.c;
    const double gbs = c.min_bytes / (r.ms * 1e6), cgbs = c.min_bytes / (r.copy_ms * 1e6);
    std::fprintf(f,
                 "    {\"op\": \"%s\", \"pass\": \"%s\", \"dtype\": \"%s\", \"shape\": \"%s\", "
                 "\"min_bytes\": %.0f, \"ms\": %.6f, \"gbps\": %.2f, \"copy_gbps\": %.2f, "
                 "\"of_copy\": %.4f, \"local_ms\": %.6f, \"allreduce_ms\": %.6f, "
                 "\"allreduce_bytes\": %zu, \"call_over_local_plus_allreduce\": %.4f, "
                 "\"kernel_bytes\": {\"read\": %lld, \"written\": %lld}, \"kernels\": [",
                 c.op.c_str(), c.pass.c_str(), r.dtype, c.shape.c_str(), c.min_bytes, r.ms, gbs,
                 cgbs, gbs / cgbs, r.local_ms, r.ar_ms, (header_values + c.payload_values) * 8,
                 r.ms / (r.local_ms + r.ar_ms), static_cast<long long>(c.traffic.read()),
                 static_cast<long long>(c.traffic.written()));
    for (size_t k = 0; k < c.traffic.kernels.size(); ++k) {
      const KernelBytes& kb = c.traffic.kernels[k];
      std::fprintf(f, "%s{\"kernel\": \"%s\", \"read\": %lld, \"written\": %lld}", k ? ", " : "",
                   kb.kernel, static_cast<long long>(kb.read), static_cast<long long>(kb.written));
    }
    std::fprintf(f, "]}%s\n", i + 1 < rs.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<long long> pos;
  int iters = 30;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json = argv[++i];
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (argv[i][0] != '-' && std::atoll(argv[i]) > 0) {
      pos.push_back(std::atoll(argv[i]));
    } else {
      std::fprintf(stderr, "usage: gpu_bench [ROWS HIDDEN [ITERS]] [--iters N] [--json FILE]\n");
      return 2;
    }
  }
  if (pos.size() == 1 || pos.size() > 3) {
    std::fprintf(stderr, "gpu_bench: give ROWS and HIDDEN together\n");
    return 2;
  }
  if (pos.size() == 3) iters = static_cast<int>(pos[2]);
  if (iters < 1) iters = 1;
  struct RowShape {
    int64_t rows, h;
  };
  std::vector<RowShape> shapes = {{4096, 1024}, {16384, 1024}, {16384, 1536}, {16384, 8192}};
  if (pos.size() >= 2) shapes = {{pos[0], pos[1]}};
  const int64_t bn_n = 32, bn_c = 64, bn_hw = 56;

  cudaStream_t s;
  BENCH_CUDA(cudaSetDevice(0));
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  auto local = make_cuda_single_communicator(s, 0);
  local->set_strict_calls(0);
  std::unique_ptr<Communicator> nccl;
  const char* comm_name = "single";
#ifdef TPNORM_WITH_NCCL
  ncclComm_t nc = nullptr;
  int dev0 = 0;
  if (ncclCommInitAll(&nc, 1, &dev0) == ncclSuccess) {
    nccl = make_nccl_communicator(nc, s);
    nccl->set_strict_calls(0);
    comm_name = "nccl";
  } else {
    std::printf("gpu_bench: ncclCommInitAll failed; the calls run on the single-GPU one\n");
  }
#endif
  Communicator& comm = nccl ? *nccl : *local;

  // One set of buffers for the largest case, 4 bytes per element; smaller cases use prefixes.
  int64_t max_n = bn_n * bn_c * bn_hw * bn_hw, max_rows = 0, max_h = bn_c;
  for (const RowShape& r : shapes) {
    max_n = std::max(max_n, r.rows * r.h);
    max_rows = std::max(max_rows, r.rows);
    max_h = std::max(max_h, r.h);
  }
  const size_t nb = static_cast<size_t>(max_n) * 4;
  void *x, *y, *dy, *dx, *g, *b, *dg, *db, *mean, *rstd, *rmean, *rvar, *copy_src, *copy_dst;
  void* ar;
  for (void** p : {&x, &y, &dy, &dx}) BENCH_CUDA(cudaMalloc(p, nb));
  // The copy of a backward's 3 N s moves 1.5 N s each way: up to 1.5 * nb.
  for (void** p : {&copy_src, &copy_dst}) BENCH_CUDA(cudaMalloc(p, 2 * nb));
  for (void** p : {&g, &b, &dg, &db}) BENCH_CUDA(cudaMalloc(p, max_h * 4));
  for (void** p : {&mean, &rstd, &rmean, &rvar})
    BENCH_CUDA(cudaMalloc(p, std::max(max_rows, bn_c) * 4));
  const size_t header_values = static_cast<size_t>(call_header_values(true));
  const size_t max_payload = static_cast<size_t>(std::max(2 * max_rows, 2 * bn_c));
  BENCH_CUDA(cudaMalloc(&ar, (header_values + max_payload) * 8));
  BENCH_CUDA(cudaMemset(ar, 0, (header_values + max_payload) * 8));
  BENCH_CUDA(cudaMemset(x, 0x3c, nb));  // finite values in every dtype
  BENCH_CUDA(cudaMemset(dy, 0x3c, nb));
  BENCH_CUDA(cudaMemset(g, 0x3c, max_h * 4));
  BENCH_CUDA(cudaMemset(b, 0, max_h * 4));
  BENCH_CUDA(cudaMemset(rmean, 0, bn_c * 4));
  BENCH_CUDA(cudaMemset(rvar, 0, bn_c * 4));

  std::printf("gpu_bench: %s, comm %s (world size 1), median of %d calls; MB = 1e6 bytes\n",
              prop.name, comm_name, iters);
  std::printf("%-10s %-8s %-5s %-13s %8s %9s %7s %8s %6s %8s %8s %9s %8s %8s\n", "op", "pass",
              "dtype", "shape", "min_MB", "ms", "GB/s", "copyGB/s", "ofcopy", "kern_MB", "kern/min",
              "local_ms", "ar_ms", "call/sum");
  std::vector<Result> results;
  std::vector<std::unique_ptr<Case>> cases;
  int64_t tracked = 0;
  for (DType dt : {DType::F32, DType::BF16}) {
    const int64_t es = static_cast<int64_t>(dtype_size(dt));
    auto v = [dt](void* p, Shape sh) { return TensorView(p, dt, sh, Device::cuda(0)); };
    auto f = [](void* p, int64_t len) {
      return TensorView(p, DType::F32, Shape{len}, Device::cuda(0));
    };
    std::vector<Case*> now;
    auto add = [&](Case c) {
      cases.push_back(std::make_unique<Case>(std::move(c)));
      now.push_back(cases.back().get());
    };
    for (const RowShape& rs : shapes) {
      const int64_t R = rs.rows, H = rs.h;
      const double ns = static_cast<double>(R * H * es);
      const Shape sx{R, H}, sp{H};
      const std::string shape = std::to_string(R) + "x" + std::to_string(H);
      RowTrafficArgs t;
      t.rows = R;
      t.h = H;
      t.elem = es;
      t.header = static_cast<int64_t>(header_values);
      RowTrafficArgs rms = t;
      rms.centered = false;
      rms.beta = rms.dbeta = rms.save_mean = false;
      const size_t r2 = static_cast<size_t>(2 * R), r1 = static_cast<size_t>(R);
      add({"LayerNorm", "forward", shape, 2 * ns, r2, row_forward_traffic(t), [=](Communicator& c) {
             layer_norm_forward(c, v(x, sx), v(g, sp), v(b, sp), v(y, sx), f(mean, R), f(rstd, R));
           }});
      add({"LayerNorm", "backward", shape, 3 * ns, r2, row_backward_traffic(t),
           [=](Communicator& c) {
             layer_norm_backward(c, v(dy, sx), v(x, sx), v(g, sp), f(mean, R), f(rstd, R),
                                 v(dx, sx), v(dg, sp), v(db, sp));
           }});
      add({"RMSNorm", "forward", shape, 2 * ns, r1, row_forward_traffic(rms), [=](Communicator& c) {
             rms_norm_forward(c, v(x, sx), v(g, sp), v(y, sx), f(rstd, R));
           }});
      add({"RMSNorm", "backward", shape, 3 * ns, r1, row_backward_traffic(rms),
           [=](Communicator& c) {
             rms_norm_backward(c, v(dy, sx), v(x, sx), v(g, sp), f(rstd, R), v(dx, sx), v(dg, sp));
           }});
    }
    for (Layout lay : {Layout::kNCHW, Layout::kChannelsLast}) {
      const bool cl = lay == Layout::kChannelsLast;
      const Shape bs = cl ? Shape{bn_n, bn_hw, bn_hw, bn_c} : Shape{bn_n, bn_c, bn_hw, bn_hw};
      const double ns = static_cast<double>(bn_n * bn_c * bn_hw * bn_hw * es);
      const std::string shape = cl ? "32x56x56x64" : "32x64x56x56";
      BnTrafficArgs t;
      t.outer = cl ? bn_n * bn_hw * bn_hw : bn_n;
      t.c = bn_c;
      t.inner = cl ? 1 : bn_hw * bn_hw;
      t.channels_last = cl;
      t.elem = es;
      t.header = static_cast<int64_t>(header_values);
      BatchNormOptions o;
      o.layout = lay;
      const Shape sc{bn_c};
      const size_t pay = static_cast<size_t>(2 * bn_c);
      const char* name = cl ? "SyncBN-CL" : "SyncBN";
      add({name, "forward", shape, 2 * ns, pay, bn_forward_traffic(t),
           [=, &tracked](Communicator& c) {
             sync_batch_norm_forward(c, v(x, bs), v(g, sc), v(b, sc), f(rmean, bn_c), f(rvar, bn_c),
                                     &tracked, v(y, bs), f(mean, bn_c), f(rstd, bn_c), o);
           }});
      add({name, "backward", shape, 3 * ns, pay, bn_backward_traffic(t), [=](Communicator& c) {
             sync_batch_norm_backward(c, v(dy, bs), v(x, bs), v(g, sc), f(mean, bn_c),
                                      f(rstd, bn_c), v(dx, bs), v(dg, sc), v(db, sc), o);
           }});
      // Eval with running statistics: no collective; the backward without dgamma / dbeta has
      // no partial pass. Both move 2 N s.
      BnTrafficArgs te = t;
      te.training = false;
      te.dgamma = te.dbeta = false;
      BatchNormOptions oe = o;
      oe.training = false;
      add({name, "eval-fwd", shape, 2 * ns, 0, bn_forward_traffic(te),
           [=, &tracked](Communicator& c) {
             sync_batch_norm_forward(c, v(x, bs), v(g, sc), v(b, sc), f(rmean, bn_c), f(rvar, bn_c),
                                     &tracked, v(y, bs), f(mean, bn_c), f(rstd, bn_c), oe);
           }});
      add({name, "eval-bwd", shape, 2 * ns, 0, bn_backward_traffic(te), [=](Communicator& c) {
             sync_batch_norm_backward(c, v(dy, bs), v(x, bs), v(g, sc), f(mean, bn_c),
                                      f(rstd, bn_c), v(dx, bs), {}, {}, oe);
           }});
    }
    for (const Case* c : now) {
      Result r{c, dtype_name(dt), 0, 0, 0, 0};
      r.ms = median_ms(s, iters, [&] { c->run(comm); });
      r.local_ms = median_ms(s, iters, [&] { c->run(*local); });
      // The copy moves the same bytes: it reads half of them and writes the other half.
      const size_t half = static_cast<size_t>(c->min_bytes / 2);
      r.copy_ms = median_ms(s, iters, [&] {
        BENCH_CUDA(cudaMemcpyAsync(copy_dst, copy_src, half, cudaMemcpyDeviceToDevice, s));
      });
      r.ar_ms = median_ms(s, iters, [&] {
        comm.all_reduce_sum(ar, header_values + c->payload_values, DType::F64);
      });
      const double gbs = c->min_bytes / (r.ms * 1e6), cgbs = c->min_bytes / (r.copy_ms * 1e6);
      std::printf(
          "%-10s %-8s %-5s %-13s %8.1f %9.4f %7.0f %8.0f %5.0f%% %8.1f %8.2f %9.4f %8.4f "
          "%8.2f\n",
          c->op.c_str(), c->pass.c_str(), r.dtype, c->shape.c_str(), c->min_bytes / 1e6, r.ms, gbs,
          cgbs, 100.0 * gbs / cgbs, c->traffic.total() / 1e6, c->traffic.total() / c->min_bytes,
          r.local_ms, r.ar_ms, r.ms / (r.local_ms + r.ar_ms));
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  int rc = 0;
  for (Communicator* c : {&comm, local.get()}) {
    try {
      cuda_check_errors(*c);
    } catch (const std::exception& e) {
      std::printf("gpu_bench: %s\n", e.what());
      rc = 1;
    }
  }
  if (json) {
    FILE* jf = std::fopen(json, "w");
    if (!jf) {
      std::fprintf(stderr, "gpu_bench: cannot write %s\n", json);
      rc = 1;
    } else {
      print_json(jf, results, prop.name, comm_name, iters, header_values);
      std::fclose(jf);
    }
  }
  for (void* p : {x, y, dy, dx, g, b, dg, db, mean, rstd, rmean, rvar, copy_src, copy_dst, ar})
    cudaFree(p);
  nccl.reset();
  local.reset();
#ifdef TPNORM_WITH_NCCL
  if (nc) ncclCommDestroy(nc);
#endif
  cudaStreamDestroy(s);
  return rc;
}
