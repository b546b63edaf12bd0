// sync_batch_norm.cpp — the SyncBatchNorm module: state and mode around the functional calls.
#include "tpnorm/sync_batch_norm.h"

#include "common/dispatch.h"

namespace tpnorm {
namespace {

// C values of `dtype` set to v (storage rounding as the kernels do).
std::vector<unsigned char> filled(int64_t c, DType dtype, float v) {
  std::vector<unsigned char> b(static_cast<size_t>(c) * dtype_size(dtype));
  detail::dispatch_storage(dtype, [&](auto t) {
    using T = decltype(t);
    T* p = reinterpret_cast<T*>(b.data());
    for (int64_t i = 0; i < c; ++i) p[i] = from_float<T>(v);
  });
  return b;
}

}  // namespace

SyncBatchNorm::SyncBatchNorm(Communicator& comm, int64_t channels, DType dtype,
                             const BatchNormOptions& opt, bool affine, bool track_running_stats)
    : comm_(comm), channels_(channels), dtype_(dtype), opt_(opt) {
  if (channels < 1)
    throw Error(ErrorCode::kInvalidArgument, "tpnorm: SyncBatchNorm: channels must be >= 1");
  if (dtype != DType::F32 && dtype != DType::F16 && dtype != DType::BF16 && dtype != DType::F64)
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: SyncBatchNorm: dtype must be fp32/fp16/bf16/fp64");
  if (affine) {
    weight_ = filled(channels, dtype, 1.f);
    bias_ = filled(channels, dtype, 0.f);
    grad_weight_ = filled(channels, dtype, 0.f);
    grad_bias_ = filled(channels, dtype, 0.f);
  }
  if (track_running_stats) {
    running_mean_.assign(channels, 0.f);
    running_var_.assign(channels, 1.f);
  }
  save_mean_.assign(channels, 0.f);
  save_invstd_.assign(channels, 0.f);
}

TensorView SyncBatchNorm::param(std::vector<unsigned char>& bytes) {
  return bytes.empty() ? TensorView{}
                       : TensorView{bytes.data(), dtype_, {channels_}, comm_.device()};
}

void SyncBatchNorm::forward(const TensorView& x, const TensorView& y) {
  sync_batch_norm_forward(comm_, x, weight(), bias(), stat(running_mean_), stat(running_var_),
                          &num_batches_tracked_, y, stat(save_mean_), stat(save_invstd_), opt_);
}

void SyncBatchNorm::backward(const TensorView& dy, const TensorView& x, const TensorView& dx) {
  BatchNormOptions o = opt_;
  o.training = opt_.training || running_mean_.empty();  // the saves were batch statistics
  sync_batch_norm_backward(comm_, dy, x, weight(), stat(save_mean_), stat(save_invstd_), dx,
                           grad_weight(), grad_bias(), o);
}

}  // namespace tpnorm
