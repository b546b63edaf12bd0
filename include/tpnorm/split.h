// tpnorm/split.h — split-phase calls: start the statistics exchange now, finish it later.
//
// Every collective op of tpnorm has a `_start` twin with the same arguments. It validates,
// checks that the ranks agree, computes this rank's partial statistics and starts the call's
// all-reduce without waiting for it (MPI_Iallreduce on CPU; on a device communicator the
// collective is enqueued on the stream as usual), and returns a PendingCall. finish() waits for
// the statistics and writes the outputs. The blocking call is exactly start + finish:
//
//   tpnorm::PendingCall q = tpnorm::rms_norm_forward_start(*tp, xq, gq, yq, rq);
//   tpnorm::PendingCall k = tpnorm::rms_norm_forward_start(*tp, xk, gk, yk, rk);
//   independent_work();   // e.g. the value projection: the two exchanges run meanwhile
//   q.finish();
//   k.finish();
//
// Rules (the usual ones for collectives, made explicit):
// - Every rank starts the same calls on a communicator in the same order. Several calls may be
//   in flight on one communicator; they may be finished in any order.
// - Everything the call reads or writes (views, the batched item arrays, num_batches_tracked)
//   must stay valid, and its inputs unchanged, until finish() returns.
// - Errors reach every rank together, as for the blocking call: a bad argument or a
//   disagreement throws from the `_start` call on every rank (nothing is then in flight) when
//   the call header is checked first — strict calls (every call on MPI communicators by
//   default, see Communicator::set_strict_calls) larger than the communicator's
//   size_checked_sum_bytes(); a small strict call carries its header in its one sum, and then,
//   like every call past the strict calls, throws from finish(), as does a failure found from
//   the summed statistics.
// - A PendingCall destroyed (or assigned over) without finish() is an error, not a leak or a
//   hang: its collective is completed (every rank started it), its outputs are not written,
//   and the next collective call on the communicator throws on every rank, naming the call.
// - On a device communicator finish() only enqueues the apply kernels (the collective was
//   already enqueued on the stream by start): the overlap there is the stream's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "tpnorm/batch_norm.h"
#include "tpnorm/batched.h"
#include "tpnorm/communicator.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/norm.h"
#include "tpnorm/tensor.h"

namespace tpnorm {

namespace detail {
class StartedOp;
}

/// A started call. Move-only; empty when default-constructed, moved from or finished.
class PendingCall {
 public:
  PendingCall() noexcept;
  explicit PendingCall(std::unique_ptr<detail::StartedOp> started) noexcept;
  PendingCall(PendingCall&& other) noexcept;
  /// Assigning over a call still pending drops it (see the rules above).
  PendingCall& operator=(PendingCall&& other) noexcept;
  ~PendingCall();

  /// Waits for the call's statistics and writes its outputs. Throws tpnorm::Error on every
  /// rank together if the call fails there. Afterwards (even after a throw) nothing is pending.
  void finish();
  /// True between the start and finish().
  bool pending() const noexcept { return started_ != nullptr; }

 private:
  std::unique_ptr<detail::StartedOp> started_;
};

// The `_start` twins of the blocking calls (same arguments, same meaning; see the headers
// included above).

[[nodiscard]] PendingCall layer_norm_forward_start(Communicator& comm, const TensorView& x,
                                                   const TensorView& gamma, const TensorView& beta,
                                                   const TensorView& y, const TensorView& mean,
                                                   const TensorView& rstd,
                                                   const NormOptions& opt = {});
[[nodiscard]] PendingCall layer_norm_backward_start(Communicator& comm, const TensorView& dy,
                                                    const TensorView& x, const TensorView& gamma,
                                                    const TensorView& mean, const TensorView& rstd,
                                                    const TensorView& dx, const TensorView& dgamma,
                                                    const TensorView& dbeta,
                                                    const NormOptions& opt = {});
[[nodiscard]] PendingCall rms_norm_forward_start(Communicator& comm, const TensorView& x,
                                                 const TensorView& gamma, const TensorView& y,
                                                 const TensorView& rstd,
                                                 const NormOptions& opt = {});
[[nodiscard]] PendingCall rms_norm_backward_start(Communicator& comm, const TensorView& dy,
                                                  const TensorView& x, const TensorView& gamma,
                                                  const TensorView& rstd, const TensorView& dx,
                                                  const TensorView& dgamma,
                                                  const NormOptions& opt = {});

[[nodiscard]] PendingCall fused_add_layer_norm_forward_start(
    Communicator& comm, const TensorView& x, const TensorView& f, double alpha,
    const TensorView& gamma, const TensorView& beta, const TensorView& h, const TensorView& y,
    const TensorView& mean, const TensorView& rstd, const NormOptions& opt = {});
[[nodiscard]] PendingCall fused_add_layer_norm_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& dh_extra, const TensorView& h,
    const TensorView& gamma, const TensorView& mean, const TensorView& rstd, double alpha,
    const TensorView& dx, const TensorView& df, const TensorView& dgamma, const TensorView& dbeta,
    const NormOptions& opt = {});
[[nodiscard]] PendingCall fused_add_rms_norm_forward_start(Communicator& comm, const TensorView& x,
                                                           const TensorView& f, double alpha,
                                                           const TensorView& gamma,
                                                           const TensorView& h, const TensorView& y,
                                                           const TensorView& rstd,
                                                           const NormOptions& opt = {});
[[nodiscard]] PendingCall fused_add_rms_norm_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& dh_extra, const TensorView& h,
    const TensorView& gamma, const TensorView& rstd, double alpha, const TensorView& dx,
    const TensorView& df, const TensorView& dgamma, const NormOptions& opt = {});

[[nodiscard]] PendingCall batched_norm_forward_start(Communicator& comm, const RowNormItem* items,
                                                     size_t count, const NormOptions& opt = {});
[[nodiscard]] PendingCall batched_norm_backward_start(Communicator& comm,
                                                      const RowNormGradItem* items, size_t count,
                                                      const NormOptions& opt = {});

[[nodiscard]] PendingCall group_norm_forward_start(Communicator& comm, const TensorView& x,
                                                   const ChannelGroups& cg, const TensorView& gamma,
                                                   const TensorView& beta, const TensorView& y,
                                                   const TensorView& mean, const TensorView& rstd,
                                                   const NormOptions& opt = {});
[[nodiscard]] PendingCall group_norm_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& x, const ChannelGroups& cg,
    const TensorView& gamma, const TensorView& mean, const TensorView& rstd, const TensorView& dx,
    const TensorView& dgamma, const TensorView& dbeta, const NormOptions& opt = {});
[[nodiscard]] PendingCall instance_norm_forward_start(
    Communicator& comm, const TensorView& x, const ChannelGroups& cg, const TensorView& gamma,
    const TensorView& beta, const TensorView& y, const TensorView& mean, const TensorView& rstd,
    const NormOptions& opt = {});
[[nodiscard]] PendingCall instance_norm_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& x, const ChannelGroups& cg,
    const TensorView& gamma, const TensorView& mean, const TensorView& rstd, const TensorView& dx,
    const TensorView& dgamma, const TensorView& dbeta, const NormOptions& opt = {});

/// SyncBatchNorm in eval mode with running statistics communicates nothing: its start only
/// validates (on this rank) and its finish() writes y.
[[nodiscard]] PendingCall sync_batch_norm_forward_start(
    Communicator& comm, const TensorView& x, const TensorView& gamma, const TensorView& beta,
    const TensorView& running_mean, const TensorView& running_var, int64_t* num_batches_tracked,
    const TensorView& y, const TensorView& save_mean, const TensorView& save_invstd,
    const BatchNormOptions& opt = {});
[[nodiscard]] PendingCall sync_batch_norm_backward_start(
    Communicator& comm, const TensorView& dy, const TensorView& x, const TensorView& gamma,
    const TensorView& save_mean, const TensorView& save_invstd, const TensorView& dx,
    const TensorView& dgamma, const TensorView& dbeta, const BatchNormOptions& opt = {});

}  // namespace tpnorm
