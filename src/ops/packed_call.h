// packed_call.h — the reduce phase shared by every op: one packed buffer, one collective, and
// the cross-rank agreement that makes a failure on one rank the same failure on all ranks.
//
// Buffer layout (wire type W: double for Stats::kRobust, float for Stats::kNaive): the call
// header of common/call_header.h, then the op's payload, e.g. per-row (sum x, sum x^2):
//   [0]            number of ranks whose local validation failed (each adds 0 or 1)
//   [1]            this rank's element count of every statistic set (summed: the global count)
//   [2 .. 2+2K)    K = 4 fingerprint chunks c_i and c_i^2 (only with check_agreement): all ranks
//                  sent the same chunk iff P * sum(c^2) == sum(c)^2, exact in W by choosing the
//                  chunk width from P and W's mantissa
//   [header ..)    the op's payload
//
// Ops do not drive a PackedCall by hand: run_op (ops/op_spec.h) does, for every op.
//
// On a failed or disagreeing call every rank makes one more collective (a table of every rank's
// fingerprint fields and error text) and throws the same tpnorm::Error. In strict mode
// (Communicator::strict_now) the header travels in its own small collective before the payload,
// so ranks that disagree on sizes never enter payload collectives of different lengths; on host
// communicators that collective is non-blocking, started before the partial (begin_check) and
// waited after it, so its latency hides under the partial. A strict call whose header + payload
// fit Communicator::size_checked_sum_bytes (MPI: a small sum, sent as a self-describing
// exchange) needs no pre-check: its one sum carries the header, and ranks that passed different
// sizes get kMismatch from the sum itself on every rank, then the usual diagnosis.
//
// Device communicators (src/comm/device_comm.h): the buffer is the communicator's device
// workspace and the host never reads it back. Strict calls check the header on the host
// through the communicator's control all-reduce before any device work; every call then
// writes the header into the device buffer and makes ONE device collective of header +
// payload, whose header the op's apply kernels check on device (see tpnorm/cuda.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/device_comm.h"
#include "common/call_header.h"
#include "tpnorm/communicator.h"
#include "tpnorm/error.h"

namespace tpnorm::detail {

/// Counts travel in the wire type; float32 (Stats::kNaive) is exact only below 2^24.
inline constexpr double kNaiveCountLimit = call_header::kFloatCountLimit;

/// 64-bit FNV-1a of n bytes, continuing from h (call_header::kFnvOffset to start).
inline uint64_t fnv1a(uint64_t h, const void* p, size_t n) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = call_header::fnv1a_byte(h, c[i]);
  return h;
}

class PackedCall {
 public:
  /// The failure of a call whose communicator says CUDA but has no stream or workspace.
  static constexpr const char* kNoDeviceStream =
      "the communicator's device is CUDA but it has no stream or workspace (make it with "
      "tpnorm/cuda.h), or this build has no CUDA backend";

  /// [in] op: a string literal naming the public call, e.g. "layer_norm_forward".
  PackedCall(Communicator& comm, const char* op, DType wire, bool check_agreement);
  /// Completes a sum still in flight (the peers started it too), so its buffer never outlives
  /// it.
  ~PackedCall();
  PackedCall(const PackedCall&) = delete;
  PackedCall& operator=(const PackedCall&) = delete;

  /// Adds a field every rank must agree on to the fingerprint (name: a string literal).
  void agree(const char* name, double value);
  /// Records a local failure (the first one wins); the call still joins the collective.
  void fail(const std::string& message, ErrorCode code = ErrorCode::kInvalidArgument);
  /// This call's sequence number on its communicator (the "sequence" agreement field).
  uint64_t sequence() const { return sequence_; }
  bool failed() const { return failed_; }
  /// Throws this rank's recorded failure, if any, without communicating: for calls that make no
  /// collective (SyncBatchNorm in eval mode, validated on a single-process PackedCall so the
  /// real communicator's sequence is untouched), where a local error cannot strand a peer.
  void throw_if_failed_locally(int rank) const;

  /// Sizes the zeroed payload (values of the wire type) and sets this rank's element count.
  /// On a device communicator the payload is NOT zeroed (the partial kernel writes all of it)
  /// and `scratch_bytes` of device scratch follow it (see scratch()).
  void prepare(size_t payload_values, double local_count, size_t scratch_bytes = 0);
  /// A call that makes no collective (SyncBatchNorm in eval mode, on a single-process
  /// PackedCall) but runs device kernels: `scratch_bytes` of `dev`'s workspace as scratch().
  void prepare_local_scratch(DeviceCommunicator& dev, size_t scratch_bytes);
  /// Device calls: returns this call's workspace region to its communicator's pool, once the
  /// call's last kernel is enqueued (its finish; the destructor otherwise). Each call in flight
  /// holds its own region until then, so calls started before others finish never share one.
  void release_workspace();
  template <class W>
  W* payload() {
    return reinterpret_cast<W*>(base()) + header_values_;
  }
  /// The payload as untyped memory: payload<W>() for the call's wire type W.
  void* payload_data() { return static_cast<char*>(base()) + header_values_ * dtype_size(wire_); }
  /// The start of header + payload (host, or device memory for a device communicator).
  void* base() { return dev_ ? dev_base_ : static_cast<void*>(bytes_.data()); }
  size_t header_values() const { return header_values_; }
  /// The device communicator of this call, or nullptr for host communicators.
  DeviceCommunicator* device_comm() const { return dev_; }
  /// Device calls: this rank's header (header_values() float64 values into `head`, room for
  /// call_header::kFullValues) for the op's partial kernel to write into the device buffer
  /// itself, saving the header kernel's launch (kernels/cuda/call_header.h HeaderWrite).
  /// False when the call has failed already. After true, the collective enqueues no header
  /// kernel unless the call fails before it (then the header kernel writes the failure).
  bool take_device_header(double* head);
  /// Device scratch of prepare()'s scratch_bytes, 256-byte aligned (device calls only).
  void* scratch() const { return scratch_; }
  DType wire() const { return wire_; }
  size_t payload_values() const { return payload_values_; }
  /// This rank and the number of ranks of the call's communicator.
  int rank() const { return comm_.rank(); }
  int ranks() const { return comm_.size(); }
  /// Writes the slice table's row of this rank (ops/slices.h) from payload value `at`: its
  /// (offset, count) in slot rank(), zeros in the other ranks' slots; on the host at once, on a
  /// device enqueued on its stream. Throws tpnorm::Error if a device write cannot be enqueued.
  void write_slice(size_t at, int64_t offset, int64_t count);
  /// Device calls, after the reduce: enqueues the check of the summed slice table at `at`
  /// (common/slice_tiling.h); a table that does not tile [0, total) marks the summed header
  /// failed, so every rank's apply kernels write nothing and set the error word.
  void check_slices_on_device(size_t at, int64_t total);
  /// Host calls, after the reduce: `n` summed payload values from `at`, as doubles.
  std::vector<double> read_payload(size_t at, size_t n) const;

  /// The ONE collective of the call (plus the strict pre-check while strict). Throws the same
  /// tpnorm::Error on every rank when any rank failed or the ranks disagree.
  void reduce() {
    start_reduce();
    finish_reduce();
  }
  /// The same in split phases (run_op's cut, see tpnorm/split.h), on host communicators:
  ///   begin_check()    after prepare(), before the partial: in strict calls, starts the
  ///                    header's non-blocking sum, so its latency hides under the partial;
  ///   start_reduce()   after the partial: waits for the header and checks it (throwing the
  ///                    same error on every rank), then starts the payload's non-blocking sum
  ///                    (folded calls: header + payload in one sum, checked in finish_reduce);
  ///   finish_reduce()  waits for the payload's sum.
  /// Device communicators do all of it in start_reduce (their collective is stream-ordered).
  void begin_check();
  void start_reduce();
  void finish_reduce();
  /// After reduce(): the sum of local counts over all ranks.
  double global_count() const { return global_count_; }

  /// Row chunks (ops/chunking.h, run_op.cpp): a chunked call checks its header in its own sum
  /// first (as a strict call does), then sums its payload in K slices.
  ///   force_strict()        before prepare(): this call checks its header first even after
  ///                         the communicator's strict calls (the same on every rank);
  ///   check_header_first()  strict calls: waits for the header's sum (begin_check's) and checks
  ///                         it, throwing the same error on every rank; global_count() is then
  ///                         known. Device: the host control sum, then the header's write;
  ///   start_slice()         the non-blocking sum of payload values [first, first + count);
  ///                         on device the slice at 0 also carries the header, which the apply
  ///                         kernels check (each slice's wait orders the device work after it).
  void force_strict();
  bool strict() const { return strict_; }
  /// Whether this strict call's header rides inside its one payload sum (a size-checked sum:
  /// small calls; the same on every rank), instead of going first in its own sum.
  bool check_in_sum() const;
  void check_header_first();
  Communicator::Request start_slice(size_t first, size_t count);

 private:
  struct FieldValue {
    const char* name;
    double value;
  };
  void wait_checked(Communicator::Request& r);
  void write_header(void* base, DType as) const;
  void check_header(const void* base, DType as);
  [[noreturn]] void diagnose();
  void reduce_device();
  void enqueue_device_header(const double* head);
  void control_sum(double* buf, size_t n);

  Communicator& comm_;
  const char* op_;
  DType wire_;
  bool check_;
  bool failed_ = false;
  ErrorCode code_ = ErrorCode::kInvalidArgument;
  std::string message_;
  std::vector<FieldValue> fields_;
  size_t header_values_;
  size_t payload_values_ = 0;
  double local_count_ = 0;
  double global_count_ = 0;
  std::vector<double> bytes_;  // header + payload, 8-byte aligned storage for either W
  uint64_t sequence_ = 0;
  bool strict_ = false;          // this call checks its header in its own collective first
  bool header_sent_ok_ = false;  // strict: the header left saying this rank had not failed
  bool header_checked_ = false;  // strict: the header's sum came back and agreed
  Communicator::Request header_req_, payload_req_;
  DeviceCommunicator* dev_ = nullptr;
  void* dev_base_ = nullptr;
  void* scratch_ = nullptr;
  DeviceCommunicator* region_owner_ = nullptr;  // the pool this call's region came from
  void* region_ = nullptr;
  bool header_by_partial_ = false;  // take_device_header: the partial kernel writes the header
};

}  // namespace tpnorm::detail
