// batch_norm_cuda.cpp — see batch_norm_cuda.h. Differences from the CPU path, all because the
// host never reads device memory here: a training forward whose global count per channel is
// <= 1 is detected on device (outputs, saved and running statistics untouched, the
// communicator's error word set; tpnorm::cuda_check_errors reports it) instead of throwing,
// unless the call checked its header on the host. A call that advances num_batches_tracked (a
// host counter) always does (OpSpec::needs_host_verdict, run_op): the host knows the call is
// accepted and the global count before the apply, throws as on CPU when it is not, and only
// then advances the counter and computes the cumulative momentum 1 / counter.
#include "ops/cuda/batch_norm_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/dispatch.h"
#include "kernels/cuda/batch_norm.h"
#include "kernels/cuda/exact_channels.h"
#include "ops/cuda/device_call.h"
#include "ops/op_spec.h"

namespace tpnorm::detail {
namespace {

namespace kcu = kernels::cuda;

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

size_t bn_scratch_cuda(const kernels::cpu::BatchNormArgs& a) {
  const kcu::BnArgs b = bn_args(a, nullptr);
  return std::max(kcu::bn_scratch_bytes(b), kcu::exact_bn_scratch_bytes(b));
}

void bn_forward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const BnForward& f) {
  if (!f.batch_stats) return;  // eval: the running statistics are the statistics
  DeviceGuard guard(dev.device_index());
  const kcu::BnArgs b = bn_args(f.a, dev.stream());
  dispatch_device_storage(f.x.dtype, [&](auto t) {
    using T = decltype(t);
    if (f.opt.stats == Stats::kExact)  // kernels/cuda/exact_channels.h
      return kcu::exact_bn_partial_forward<T>(b, static_cast<const T*>(f.x.data),
                                              call.payload<int64_t>(), call.scratch());
    kcu::bn_partial_forward<T>(b, static_cast<const T*>(f.x.data), f.opt.stats == Stats::kRobust,
                               call.wire() == DType::F64, call.payload_data(), call.scratch());
  });
}

void bn_forward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const BnForward& f) {
  DeviceGuard guard(dev.device_index());
  const kcu::BnArgs b = bn_args(f.a, dev.stream());
  void* s = call.scratch();
  kcu::BnForwardStats st;
  st.hd = f.batch_stats ? device_header(call, dev) : kcu::Header{};  // eval: nothing to check
  st.eps = f.opt.eps;
  st.update_running = f.opt.training && f.tracking;
  // The host verdict (strict: the summed header was checked on the host): the same count on
  // every rank, so every rank throws here together, before anything is enqueued.
  // Stats::kNaive's float32 wire counts exactly only below 2^24: refused here as on a host
  // (whose check this is), rather than by the apply kernel's header check after the host has
  // already counted the call in num_batches_tracked.
  if (f.batch_stats && call.strict()) {
    check_naive_count(f.opt.stats, call.global_count(), "sync_batch_norm_forward", "channel");
    if (call.global_count() <= 1)
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: sync_batch_norm_forward: expected more than 1 value per channel over "
                  "all ranks, got " +
                      std::to_string(static_cast<int64_t>(call.global_count())));
  }
  const int64_t tracked = f.num_batches_tracked ? *f.num_batches_tracked + 1 : 0;
  st.momentum = f.cumulative ? 1.0 / static_cast<double>(tracked) : f.opt.momentum;
  st.running_mean = f.running_mean.data;
  st.running_var = f.running_var.data;
  st.r64 = f.running_mean.dtype == DType::F64;
  st.save_mean = f.save_mean.data;
  st.save_invstd = f.save_invstd.data;
  st.mean64 = f.save_mean.dtype == DType::F64;
  st.invstd64 = f.save_invstd.dtype == DType::F64;
  dispatch_device_storage(f.x.dtype, [&](auto t) {
    using T = decltype(t);
    if (f.opt.stats == Stats::kExact)
      return kcu::exact_bn_apply_forward<T>(
          b, st, static_cast<const T*>(f.gamma.data), static_cast<const T*>(f.beta.data),
          static_cast<const T*>(f.x.data), static_cast<T*>(f.y.data), s, dev.error_word());
    kcu::bn_forward_stats<T>(b, st, static_cast<const T*>(f.gamma.data),
                             static_cast<const T*>(f.beta.data), s, dev.error_word());
    kcu::bn_apply_forward<T>(b, st.hd, static_cast<const T*>(f.x.data), static_cast<T*>(f.y.data),
                             s, dev.error_word());
  });
  // Accepted on the host (needs_host_verdict): this call counts.
  if (st.update_running && f.num_batches_tracked) *f.num_batches_tracked = tracked;
}

void bn_backward_partial_cuda(PackedCall& call, DeviceCommunicator& dev, const BnBackward& b) {
  DeviceGuard guard(dev.device_index());
  const kcu::BnArgs k = bn_args(b.a, dev.stream());
  const bool training = b.opt.training;
  // Eval needs this rank's sums only for dgamma / dbeta: without them, no partial pass (dx =
  // gamma * invstd * dy reads dy alone).
  if (!training && !b.dgamma.present() && !b.dbeta.present()) return;
  void* pay = training ? call.payload_data() : nullptr;  // eval: zero global sums
  void* s = call.scratch();
  dispatch_device_storage(b.x.dtype, [&](auto t) {
    using T = decltype(t);
    if (b.opt.stats == Stats::kExact)
      return kcu::exact_bn_partial_backward<T>(
          k, static_cast<const T*>(b.dy.data), static_cast<const T*>(b.x.data), b.save_mean.data,
          b.save_mean.dtype == DType::F64, static_cast<int64_t*>(pay), s);
    kcu::bn_partial_backward<T>(k, static_cast<const T*>(b.dy.data),
                                static_cast<const T*>(b.x.data), b.save_mean.data,
                                b.save_mean.dtype == DType::F64, call.wire() == DType::F64, pay, s);
  });
}

void bn_backward_apply_cuda(PackedCall& call, DeviceCommunicator& dev, const BnBackward& b) {
  DeviceGuard guard(dev.device_index());
  const kcu::BnArgs k = bn_args(b.a, dev.stream());
  const bool training = b.opt.training;
  // eval: zero global sums, dx = gamma * invstd * dy
  const kcu::Header hd = training ? device_header(call, dev) : kcu::Header{};
  void* s = call.scratch();
  dispatch_device_storage(b.x.dtype, [&](auto t) {
    using T = decltype(t);
    if (b.opt.stats == Stats::kExact)
      return kcu::exact_bn_apply_backward<T>(
          k, hd, static_cast<const T*>(b.dy.data), static_cast<const T*>(b.x.data),
          static_cast<const T*>(b.gamma.data), b.save_mean.data, b.save_invstd.data,
          b.save_mean.dtype == DType::F64, static_cast<T*>(b.dx.data),
          static_cast<T*>(b.dgamma.data), static_cast<T*>(b.dbeta.data), s, dev.error_word());
    kcu::bn_apply_backward<T>(k, hd, static_cast<const T*>(b.dy.data),
                              static_cast<const T*>(b.x.data), static_cast<const T*>(b.gamma.data),
                              b.save_mean.data, b.save_invstd.data, b.save_mean.dtype == DType::F64,
                              static_cast<T*>(b.dx.data), static_cast<T*>(b.dgamma.data),
                              static_cast<T*>(b.dbeta.data), s, dev.error_word());
  });
}

}  // namespace tpnorm::detail
