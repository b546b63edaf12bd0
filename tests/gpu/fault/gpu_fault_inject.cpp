// gpu_fault_inject — a loop of LayerNorm forward calls on device, with a failure injected on
// one rank after the strict (warm-up) window of 16 calls; run_gpu_fault_test.sh checks what
// every rank saw. Modes:
//   bad-arg       (2 ranks sharing the GPU, MPI-staged): rank 1 passes eps = -1 at call 20.
//                 Every rank must error on that call: rank 1 throws after joining the
//                 collective, the others' device check fails (cuda_check_errors). Exit 0.
//   stall-rank    (2 ranks, MPI-staged): rank 1 stops calling at call 20; rank 0's watchdog
//                 (TPNORM_TIMEOUT) must end the job: MPI_Abort, exit 124, the message.
//   stall-stream  (1 rank, NCCL): a host function that sleeps blocks the stream before call
//                 20's collective; the NCCL watchdog thread must see the event overdue,
//                 ncclCommAbort and exit 124 with its message.
//   stall-borrowed (1 rank, NCCL communicator borrowed from the caller, no MPI control
//                 channel): the stream is blocked before strict call 5, whose host-side check
//                 waits for the control all-reduce; that wait must be bounded by the watchdog
//                 (exit 124, its message), not by the stream.
//   init-fail     (2 ranks, NCCL made from MPI_COMM_WORLD): rank 1's NCCL finds no network
//                 interface for its bootstrap (NCCL_SOCKET_IFNAME names none), so it fails
//                 inside ncclCommInitRank while rank 0 waits there for it. Rank 0's wait must
//                 be bounded by TPNORM_TIMEOUT: both ranks throw the factory's one agreed error
//                 naming ncclCommInitRank. Exit 0.
// Prints "tpnorm-gpu: no CUDA device" (the tests' skip marker) and exits 0 without a GPU.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tpnorm/cuda_mpi.h"
#include "tpnorm/error.h"
#include "tpnorm/norm.h"

using namespace tpnorm;

namespace {

constexpr int kCalls = 24, kInjectAt = 20;

void CUDART_CB sleep_on_stream(void*) { std::this_thread::sleep_for(std::chrono::seconds(120)); }

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "bad-arg";
  int me = 0, np = 1, ngpu = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &np);
  if (cudaGetDeviceCount(&ngpu) != cudaSuccess || ngpu == 0) {
    if (me == 0) std::printf("tpnorm-gpu: no CUDA device (gpu_fault_inject %s)\n", mode.c_str());
    MPI_Finalize();
    return 0;
  }
  const int dev = local_cuda_device(MPI_COMM_WORLD);
  cudaSetDevice(dev);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::unique_ptr<Communicator> comm;
#ifdef TPNORM_WITH_NCCL
  ncclComm_t borrowed = nullptr;
#endif
  const bool borrowed_mode = mode == "stall-borrowed";
  if (mode == "init-fail") {
#ifdef TPNORM_WITH_NCCL
    if (me == 1) setenv("NCCL_SOCKET_IFNAME", "tpnorm-no-such-interface", 1);
    const auto t0 = std::chrono::steady_clock::now();
    bool threw = false;
    try {
      comm = make_nccl_communicator(MPI_COMM_WORLD, s);
    } catch (const Error& e) {
      threw = std::strstr(e.what(), "ncclCommInitRank") != nullptr;
      std::printf("gpu_fault_inject: rank %d: init: error: %s\n", me, e.what());
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("gpu_fault_inject: rank %d finished: the factory %s after %.1f s\n", me,
                threw ? "threw the agreed error" : "did not throw it", took);
    comm.reset();
    MPI_Finalize();
    return threw ? 0 : 1;
#else
    if (me == 0) std::printf("PASS-SKIP: built without NCCL\n");
    MPI_Finalize();
    return 0;
#endif
  }
  if (mode == "stall-stream" || borrowed_mode) {
#ifdef TPNORM_WITH_NCCL
    if (borrowed_mode) {
      ncclUniqueId id;
      ncclGetUniqueId(&id);
      ncclCommInitRank(&borrowed, 1, id, 0);
      comm = make_nccl_communicator(borrowed, s);
    } else {
      comm = make_nccl_communicator(MPI_COMM_WORLD, s);
    }
#else
    if (me == 0) std::printf("PASS-SKIP: built without NCCL\n");
    MPI_Finalize();
    return 0;
#endif
  } else {
    comm = make_mpi_staged_cuda_communicator(MPI_COMM_WORLD, s, dev);
  }
  const int64_t R = 64, h = 256;
  const Shape sh{R, h}, r{R};
  std::vector<float> hx(R * h);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = static_cast<float>((i * 37 + me) % 101) / 7.0f;
  float *x = nullptr, *y = nullptr, *mean = nullptr, *rstd = nullptr;
  cudaMalloc(&x, hx.size() * 4);
  cudaMalloc(&y, hx.size() * 4);
  cudaMalloc(&mean, R * 4);
  cudaMalloc(&rstd, R * 4);
  cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice);
  const Device d = Device::cuda(dev);
  int errors = 0, error_call = -1;
  for (int call = 1; call <= kCalls; ++call) {
    NormOptions opt;
    if (borrowed_mode && call == 5) {
      std::printf("gpu_fault_inject: stream blocked before strict call %d\n", call);
      std::fflush(stdout);
      cudaLaunchHostFunc(s, sleep_on_stream, nullptr);
    }
    if (call == kInjectAt) {
      if (mode == "bad-arg" && me == 1) opt.eps = -1;
      if (mode == "stall-rank" && me == 1) {
        std::printf("gpu_fault_inject: rank 1 stops calling at call %d\n", call);
        std::fflush(stdout);
        std::this_thread::sleep_for(std::chrono::seconds(120));
      }
      if (mode == "stall-stream") {
        std::printf("gpu_fault_inject: stream blocked before call %d\n", call);
        std::fflush(stdout);
        cudaLaunchHostFunc(s, sleep_on_stream, nullptr);
      }
    }
    try {
      layer_norm_forward(*comm, {x, DType::F32, sh, d}, {}, {}, {y, DType::F32, sh, d},
                         {mean, DType::F32, r, d}, {rstd, DType::F32, r, d}, opt);
      if (mode != "stall-stream" && !borrowed_mode) cuda_check_errors(*comm);
    } catch (const Error& e) {
      ++errors;
      error_call = call;
      std::printf("gpu_fault_inject: rank %d: call %d: error: %s\n", me, call, e.what());
    }
  }
  if (mode == "stall-stream" || borrowed_mode)
    cudaStreamSynchronize(s);  // the watchdog must end us before
  const bool ok = mode == "bad-arg" && errors == 1 && error_call == kInjectAt;
  std::printf("gpu_fault_inject: rank %d finished: %d error(s)%s\n", me, errors,
              ok ? ", as expected" : "");
  comm.reset();
#ifdef TPNORM_WITH_NCCL
  if (borrowed) ncclCommDestroy(borrowed);
#endif
  MPI_Finalize();
  return ok ? 0 : 1;
}
