// tpnorm/sync_batch_norm.h — a module in the style of torch.nn.SyncBatchNorm on top of the
// functional calls of tpnorm/batch_norm.h: it owns gamma (weight, init 1), beta (bias, init 0),
// their gradients, the running statistics (fp32, init mean 0 / var 1), num_batches_tracked and
// the statistics saved by the last forward, and switches between train and eval.
//
// Parameters and their gradients have the storage dtype of x (fp32, fp16, bf16; fp64 on a CPU communicator with
// Stats::kRobust) given at
// construction. backward(dy, x, dx) needs the x of the preceding forward. The gradients are
// this rank's sums: combine them with the rest of the model's gradients (data parallelism).
// Borrows the communicator, which must outlive the module.
#pragma once

#include <cstdint>
#include <vector>

#include "tpnorm/batch_norm.h"

namespace tpnorm {

class SyncBatchNorm {
 public:
  /// opt: eps, momentum (or BatchNormOptions::cumulative()), layout, stats mode, threads;
  /// opt.training is the initial mode.
  SyncBatchNorm(Communicator& comm, int64_t channels, DType dtype = DType::F32,
                const BatchNormOptions& opt = {}, bool affine = true,
                bool track_running_stats = true);

  void train(bool on = true) { opt_.training = on; }
  void eval() { train(false); }
  bool training() const { return opt_.training; }

  /// [in] x [N_local, C, *spatial] or channels-last; [out] y like x.
  void forward(const TensorView& x, const TensorView& y);
  /// [in] dy, x like the forward's x; [out] dx. Overwrites grad_weight / grad_bias.
  void backward(const TensorView& dy, const TensorView& x, const TensorView& dx);

  /// Views of the owned tensors ([C]; absent when affine / tracking is off).
  TensorView weight() { return param(weight_); }
  TensorView bias() { return param(bias_); }
  TensorView grad_weight() { return param(grad_weight_); }
  TensorView grad_bias() { return param(grad_bias_); }
  std::vector<float>& running_mean() { return running_mean_; }
  std::vector<float>& running_var() { return running_var_; }
  int64_t num_batches_tracked() const { return num_batches_tracked_; }
  const std::vector<float>& save_mean() const { return save_mean_; }
  const std::vector<float>& save_invstd() const { return save_invstd_; }

 private:
  TensorView param(std::vector<unsigned char>& bytes);
  TensorView stat(std::vector<float>& v) {
    return v.empty() ? TensorView{} : view(v.data(), {channels_});
  }

  Communicator& comm_;
  int64_t channels_;
  DType dtype_;
  BatchNormOptions opt_;
  std::vector<unsigned char> weight_, bias_, grad_weight_, grad_bias_;  // dtype_ [C] or empty
  std::vector<float> running_mean_, running_var_, save_mean_, save_invstd_;
  int64_t num_batches_tracked_ = 0;
};

}  // namespace tpnorm
