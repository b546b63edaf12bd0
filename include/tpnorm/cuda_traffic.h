// tpnorm/cuda_traffic.h — the bytes each CUDA kernel of a call reads from and writes to global
// memory, for a shape, computed on the host from the same launch plans the CUDA backend's
// launchers use. Plain C++ (no CUDA types); the definitions are compiled only with the CUDA
// backend (TPNORM_WITH_CUDA), so a CPU-only build of tpnorm has none of these functions.
// The GPU benchmark (bench/gpu) prints it next to the op's minimum bytes; a host test
// (tests/gpu/host_test_gpu_traffic.cpp) checks it against hand-computed numbers without a GPU.
//
// Counting rule: every distinct byte a kernel touches counts once for that kernel, however
// often the kernel reads it (gamma, read by every row, counts h * s; the robust pivot's re-read
// of a row's first values counts nothing extra). A byte read by two kernels counts twice: that
// is the re-read an op's "minimum bytes" excludes (the apply's x after the partial's x).
// Kernels are listed in launch order with the launchers' names ("row partial_fwd", ...); the
// row norms' partial kernel writes the call header (the header kernel only when there is no
// row), SyncBatchNorm's header kernel writes it. Not counted: the collective (NCCL or the
// communicator's own, not a kernel of tpnorm). It is a model worked from the kernels' code,
// not a measurement: caches may serve a re-read, which still counts here.
//
// Covered, forward and backward, of a call that succeeds: the row norms (LayerNorm / RMSNorm),
// SyncBatchNorm (training and eval), the fused residual add + row norm, batched row norms,
// GroupNorm / InstanceNorm.
#pragma once

#include <cstdint>
#include <vector>

namespace tpnorm {

struct KernelBytes {
  const char* kernel;  ///< the launcher's name, e.g. "row apply_fwd"
  int64_t read = 0, written = 0;
};

struct Traffic {
  std::vector<KernelBytes> kernels;  ///< in launch order
  int64_t read() const {
    int64_t b = 0;
    for (const KernelBytes& k : kernels) b += k.read;
    return b;
  }
  int64_t written() const {
    int64_t b = 0;
    for (const KernelBytes& k : kernels) b += k.written;
    return b;
  }
  int64_t total() const { return read() + written(); }
};

/// A row norm call: `elem` bytes per stored element (x, y, dy, dx, gamma, beta, dgamma, dbeta),
/// `wire` bytes per statistic value (8: Stats::kRobust, 4: kNaive), `saved` bytes per saved
/// mean / rstd value, `header` the call header's values (tpnorm::call_header_values).
struct RowTrafficArgs {
  int64_t rows = 0, h = 0;
  int64_t elem = 4, wire = 8, saved = 4, header = 10;
  bool centered = true;  ///< LayerNorm (mean and variance) or RMSNorm
  bool gamma = true, beta = true;
  bool save_mean = true, save_rstd = true;  ///< forward: which saved statistics are written
  bool dgamma = true, dbeta = true;         ///< backward: which parameter gradients are written
};

/// The kernels of a successful row norm forward / backward call and their bytes.
Traffic row_forward_traffic(const RowTrafficArgs& a);
Traffic row_backward_traffic(const RowTrafficArgs& a);

/// A SyncBatchNorm call on this rank's [outer, c, inner] (NCHW: outer = n, inner =
/// prod(spatial); channels-last: outer = n * prod(spatial), inner = 1).
struct BnTrafficArgs {
  int64_t outer = 0, c = 0, inner = 1;
  bool channels_last = false;
  int64_t elem = 4, wire = 8, saved = 4, running = 4, header = 10;
  /// false: eval with running statistics (forward: no sums, no collective; backward: no
  /// collective, no sums either unless dgamma / dbeta are requested, dx from dy alone)
  bool training = true;
  bool robust = true;          ///< forward: the sums kernel stores each channel's pivot
  bool update_running = true;  ///< forward, training: running mean / var read and written
  bool gamma = true, beta = true;
  bool dgamma = true, dbeta = true;
};

/// The kernels of a successful SyncBatchNorm forward / backward call and their bytes: a
/// training forward moves 3 N s (x for the sums, x again and y in the apply), a training
/// backward 5 N s (dy, x; dy, x, dx), an eval forward 2 N s, an eval backward 2 N s without
/// parameter gradients (4 N s with), plus per-channel terms.
Traffic bn_forward_traffic(const BnTrafficArgs& a);
Traffic bn_backward_traffic(const BnTrafficArgs& a);

// ---- composite calls: the fused residual add, batched row norms, GroupNorm ------------------

/// The fused residual add + row norm (tpnorm/fused.h) of `norm`'s shape: forward "residual add"
/// (x and f read, h written) then the row norm's forward on h; backward the row norm's
/// backward (its dx written into df) then "residual epilogue" (df, and dh_extra when given,
/// read; df and dx written).
Traffic fused_forward_traffic(const RowTrafficArgs& norm);
Traffic fused_backward_traffic(const RowTrafficArgs& norm, bool dh_extra);

/// A batched row norm call (tpnorm/batched.h) of `items` (one RowTrafficArgs each, sharing
/// wire and header): "write values" (the K column counts at the head of the payload), every
/// item's partial kernels in order, ONE call header, then every item's apply kernels in order
/// (each reads the header and its own count slot: as many values as a single call's header).
Traffic batched_forward_traffic(const std::vector<RowTrafficArgs>& items);
Traffic batched_backward_traffic(const std::vector<RowTrafficArgs>& items);

/// GroupNorm / InstanceNorm (tpnorm/group_norm.h) on this rank's [n, c_local, spatial], its
/// channels [c0, c0 + c_local) of groups of cpg channels. Per (sample, group) slot: the payload
/// holds all n * groups slots; the element kernels read the constants of the slots this rank's
/// channels touch only.
struct GroupTrafficArgs {
  int64_t n = 0, c_local = 0, spatial = 0, c0 = 0, groups = 1, cpg = 1;
  int64_t elem = 4, wire = 8, saved = 4, header = 10;
  bool gamma = true, beta = true;
  bool save_mean = true, save_rstd = true;  ///< forward: which saved statistics are written
  bool dgamma = true, dbeta = true;
};

/// The kernels of a successful GroupNorm forward / backward call and their bytes: the row
/// kernels' partials over the (sample, channel) planes, the fold into (sample, group) slots,
/// the header, then slot constants and the element-wise applies. x is read by the partial and
/// again by the apply (forward 3 N s), dy and x likewise backward (5 N s), plus per-plane and
/// per-slot terms.
Traffic group_forward_traffic(const GroupTrafficArgs& a);
Traffic group_backward_traffic(const GroupTrafficArgs& a);

}  // namespace tpnorm
