// batch_norm_cuda.cpp — see batch_norm_cuda.h. Differences from the CPU path, all because the
// host never reads device memory here: a training forward whose global count per channel is
// <= 1 is detected on device (outputs, saved and running statistics untouched, the
// communicator's error word set; tpnorm::cuda_check_errors reports it) instead of throwing;
// num_batches_tracked (a host counter) is incremented when the call is enqueued.
#include "ops/cuda/batch_norm_cuda.h"

#include <cmath>
#include <optional>
#include <string>

#include "common/dispatch.h"
#include "kernels/cuda/batch_norm.h"
#include "ops/cuda/device_call.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

DeviceCommunicator& device_of(Communicator& comm, const char* op) {
  auto* d = dynamic_cast<DeviceCommunicator*>(&comm);
  if (!d)  // only a single-rank communicator can be a CUDA one without a stream
    throw Error(ErrorCode::kInvalidArgument,
                std::string("tpnorm: ") + op +
                    ": the communicator's device is CUDA but it has no stream or workspace "
                    "(make it with tpnorm/cuda.h)");
  return *d;
}

// Both layouts as [outer, c, inner] (see kernels/cuda/batch_norm.h).
kcu::BnArgs bn_args(const kernels::cpu::BatchNormArgs& a, void* stream) {
  kcu::BnArgs b;
  b.outer = a.channels_last ? a.n * a.inner : a.n;
  b.c = a.c;
  b.inner = a.channels_last ? 1 : a.inner;
  b.channels_last = a.channels_last;
  b.stream = stream;
  return b;
}

}  // namespace

void sync_batch_norm_forward_cuda(Communicator& comm, PackedCall& call,
                                  const kernels::cpu::BatchNormArgs& a, bool batch_stats,
                                  bool tracking, const TensorView& x, const TensorView& gamma,
                                  const TensorView& beta, const TensorView& running_mean,
                                  const TensorView& running_var, int64_t* num_batches_tracked,
                                  const TensorView& y, const TensorView& save_mean,
                                  const TensorView& save_invstd, const BatchNormOptions& opt) {
  DeviceCommunicator& dev = device_of(comm, "sync_batch_norm_forward");
  const kcu::BnArgs b = bn_args(a, dev.stream());
  kcu::Header hd{};  // eval: no collective, nothing to check on device
  void* scratch = nullptr;
  std::optional<DeviceGuard> guard;
  if (batch_stats) {
    enter_device(call, dev, guard);
    prepare_device(call, comm, dev, static_cast<size_t>(2 * a.c),
                   static_cast<double>(a.n * a.inner),
                   call.failed() ? 0 : kcu::bn_scratch_bytes(b));
    scratch = call.scratch();
    if (!call.failed()) {
      before_collective(call, [&] {
        dispatch_storage(x.dtype, [&](auto t) {
          using T = decltype(t);
          kcu::bn_partial_forward<T>(b, static_cast<const T*>(x.data),
                                     opt.stats == Stats::kRobust, call.wire() == DType::F64,
                                     device_payload(call), scratch);
        });
      });
    }
    call.reduce();
    hd = device_header(call, comm);
  } else {
    call.throw_if_failed_locally(comm.rank());  // no collective: a local error strands no one
    guard.emplace(dev.device_index());
    scratch = dev.workspace(kcu::bn_scratch_bytes(b));
  }
  kcu::BnForwardStats f;
  f.hd = hd;
  f.eps = opt.eps;
  f.update_running = opt.training && tracking;
  const int64_t tracked = num_batches_tracked ? *num_batches_tracked + 1 : 0;
  f.momentum = std::isnan(opt.momentum) ? 1.0 / static_cast<double>(tracked) : opt.momentum;
  f.running_mean = running_mean.data;
  f.running_var = running_var.data;
  f.r64 = running_mean.dtype == DType::F64;
  f.save_mean = save_mean.data;
  f.save_invstd = save_invstd.data;
  f.mean64 = save_mean.dtype == DType::F64;
  f.invstd64 = save_invstd.dtype == DType::F64;
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::bn_forward_stats<T>(b, f, static_cast<const T*>(gamma.data),
                             static_cast<const T*>(beta.data), scratch, dev.error_word());
    kcu::bn_apply_forward<T>(b, hd, static_cast<const T*>(x.data), static_cast<T*>(y.data),
                             scratch, dev.error_word());
  });
  if (f.update_running && num_batches_tracked) *num_batches_tracked = tracked;
}

void sync_batch_norm_backward_cuda(Communicator& comm, PackedCall& call,
                                   const kernels::cpu::BatchNormArgs& a, const TensorView& dy,
                                   const TensorView& x, const TensorView& gamma,
                                   const TensorView& save_mean, const TensorView& save_invstd,
                                   const TensorView& dx, const TensorView& dgamma,
                                   const TensorView& dbeta, const BatchNormOptions& opt) {
  DeviceCommunicator& dev = device_of(comm, "sync_batch_norm_backward");
  const kcu::BnArgs b = bn_args(a, dev.stream());
  const bool s64 = save_mean.dtype == DType::F64;
  kcu::Header hd{};  // eval: zero global sums, dx = gamma * invstd * dy
  void* scratch = nullptr;
  void* pay = nullptr;
  std::optional<DeviceGuard> guard;
  if (opt.training) {
    enter_device(call, dev, guard);
    prepare_device(call, comm, dev, static_cast<size_t>(2 * a.c),
                   static_cast<double>(a.n * a.inner),
                   call.failed() ? 0 : kcu::bn_scratch_bytes(b));
    scratch = call.scratch();
    if (!call.failed()) pay = device_payload(call);
  } else {
    call.throw_if_failed_locally(comm.rank());  // no collective: a local error strands no one
    guard.emplace(dev.device_index());
    scratch = dev.workspace(kcu::bn_scratch_bytes(b));
  }
  if (!call.failed()) {
    before_collective(call, [&] {
      dispatch_storage(x.dtype, [&](auto t) {
        using T = decltype(t);
        kcu::bn_partial_backward<T>(b, static_cast<const T*>(dy.data),
                                    static_cast<const T*>(x.data), save_mean.data, s64,
                                    call.wire() == DType::F64, pay, scratch);
      });
    });
  }
  if (opt.training) {
    call.reduce();
    hd = device_header(call, comm);
  } else {
    call.throw_if_failed_locally(comm.rank());
  }
  dispatch_storage(x.dtype, [&](auto t) {
    using T = decltype(t);
    kcu::bn_apply_backward<T>(b, hd, static_cast<const T*>(dy.data), static_cast<const T*>(x.data),
                              static_cast<const T*>(gamma.data), save_mean.data,
                              save_invstd.data, s64, static_cast<T*>(dx.data),
                              static_cast<T*>(dgamma.data), static_cast<T*>(dbeta.data), scratch,
                              dev.error_word());
  });
}

}  // namespace tpnorm::detail
