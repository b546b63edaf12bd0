// packed_call.cpp — see packed_call.h for the buffer layout and the agreement rule.
#include "ops/packed_call.h"

#include "ops/caller_failure.h"

#ifdef TPNORM_WITH_CUDA
#include "common/cuda_check.h"
#include "kernels/cuda/call_header.h"
#include "ops/cuda/device_call.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "tpnorm/norm.h"

namespace tpnorm::detail {
namespace {

namespace ch = call_header;

// Header values are small integers in every wire type (int64 in Stats::kExact).
double load(const void* base, DType wire, size_t i) {
  if (wire == DType::I64) return static_cast<double>(static_cast<const int64_t*>(base)[i]);
  return wire == DType::F64 ? static_cast<const double*>(base)[i]
                            : static_cast<double>(static_cast<const float*>(base)[i]);
}
void store(void* base, DType wire, size_t i, double v) {
  if (wire == DType::I64)
    static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
  else if (wire == DType::F64)
    static_cast<double*>(base)[i] = v;
  else
    static_cast<float*>(base)[i] = static_cast<float>(v);
}

std::string fmt(double v) {
  char b[32];
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15)
    std::snprintf(b, sizeof b, "%.0f", v);
  else
    std::snprintf(b, sizeof b, "%.9g", v);
  return b;
}

// Diagnostic table row: [failed, code, nfields, fields[16], op name[32], message[160]].
constexpr size_t kMaxFields = 16, kOpChars = 32, kMsgChars = 160;
constexpr size_t kRowFields = 3, kRowOp = kRowFields + kMaxFields, kRowMsg = kRowOp + kOpChars;
constexpr size_t kRow = kRowMsg + kMsgChars;

void put_text(double* dst, size_t cap, const std::string& s) {
  for (size_t i = 0; i < cap - 1 && i < s.size(); ++i) dst[i] = static_cast<unsigned char>(s[i]);
}
std::string get_text(const double* src, size_t cap) {
  std::string s;
  for (size_t i = 0; i < cap && src[i] != 0; ++i) s.push_back(static_cast<char>(src[i]));
  return s;
}

thread_local std::string t_caller_failure;
thread_local ErrorCode t_caller_code = ErrorCode::kInvalidArgument;

}  // namespace

void set_caller_failure(const std::string& message, ErrorCode code) {
  t_caller_failure = message;
  t_caller_code = code;
}

PackedCall::PackedCall(Communicator& comm, const char* op, DType wire, bool check_agreement)
    : comm_(comm), op_(op), wire_(wire), check_(check_agreement) {
  comm_.set_current_op(op);  // so that the watchdog can name the call
  sequence_ = comm.next_sequence();
  agree("sequence", static_cast<double>(sequence_));
  strict_ = comm_.strict_now();
  if (strict_) check_ = true;
  if (!t_caller_failure.empty()) {  // found by a wrapper before the call (caller_failure.h)
    fail(t_caller_failure, t_caller_code);
    t_caller_failure.clear();
  }
  header_values_ = static_cast<size_t>(ch::header_values(check_));
  if (comm.device().kind == DeviceKind::CUDA) {
    dev_ = dynamic_cast<DeviceCommunicator*>(&comm);
    if (!dev_) fail(kNoDeviceStream);
  }
}

PackedCall::~PackedCall() {
  // A call abandoned between its phases (an exception, a dropped split-phase handle): finish
  // the sums every rank started, so that their buffer outlives them. Errors cannot leave here.
  try {
    comm_.wait(header_req_);
    comm_.wait(payload_req_);
  } catch (...) {
  }
  release_workspace();  // stream order: a later user's work runs after this call's
}

void PackedCall::agree(const char* name, double value) {
  if (fields_.size() < kMaxFields) fields_.push_back({name, value});
}

void PackedCall::fail(const std::string& message, ErrorCode code) {
  if (failed_) return;
  failed_ = true;
  code_ = code;
  message_ = message;
}

void PackedCall::throw_if_failed_locally(int rank) const {
  if (failed_)
    throw Error(code_, std::string("tpnorm: ") + op_ + " failed: rank " + std::to_string(rank) +
                           ": " + message_);
}

void PackedCall::prepare(size_t payload_values, double local_count, size_t scratch_bytes) {
  payload_values_ = payload_values;
  local_count_ = local_count;
  const size_t bytes = (header_values_ + payload_values) * dtype_size(wire_);
  if (!dev_) {
    bytes_.assign((bytes + 7) / 8, 0.0);
    return;
  }
  const size_t at = (bytes + 255) / 256 * 256;
  release_workspace();  // a second prepare (prepare(0, 0) after a failed one) replaces it
  dev_base_ = scratch_ = nullptr;
  dev_base_ = dev_->acquire_workspace(at + scratch_bytes);
  region_owner_ = dev_;
  region_ = dev_base_;
  scratch_ = static_cast<char*>(dev_base_) + at;
}

void PackedCall::write_slice(size_t at, int64_t offset, int64_t count) {
  const int P = comm_.size(), r = comm_.rank();
  if (!dev_) {
    for (int q = 0; q < P; ++q) {
      store(payload_data(), wire_, at + 2 * static_cast<size_t>(q), q == r ? offset : 0);
      store(payload_data(), wire_, at + 2 * static_cast<size_t>(q) + 1, q == r ? count : 0);
    }
    return;
  }
#ifdef TPNORM_WITH_CUDA
  const DeviceGuard guard(dev_->device_index());
  kernels::cuda::write_slice_row(payload_data(), device_wire(wire_), static_cast<int64_t>(at), P,
                                 r, offset, count, dev_->stream());
#else
  throw Error(ErrorCode::kInternal, "tpnorm: a device call in a build without CUDA");
#endif
}

void PackedCall::check_slices_on_device(size_t at, int64_t total) {
#ifdef TPNORM_WITH_CUDA
  const DeviceGuard guard(dev_->device_index());
  kernels::cuda::fail_untiled(dev_base_, device_wire(wire_), static_cast<int64_t>(header_values_ + at),
                              comm_.size(), total, dev_->stream());
#else
  (void)at;
  (void)total;
  throw Error(ErrorCode::kInternal, "tpnorm: a device call in a build without CUDA");
#endif
}

std::vector<double> PackedCall::read_payload(size_t at, size_t n) const {
  std::vector<double> v(n);
  const void* p = static_cast<const char*>(static_cast<const void*>(bytes_.data())) +
                  header_values_ * dtype_size(wire_);
  for (size_t i = 0; i < n; ++i) v[i] = load(p, wire_, at + i);
  return v;
}

void PackedCall::prepare_local_scratch(DeviceCommunicator& dev, size_t scratch_bytes) {
  release_workspace();
  region_ = dev.acquire_workspace(scratch_bytes);
  region_owner_ = &dev;
  scratch_ = region_;
}

void PackedCall::release_workspace() {
  if (region_owner_ && region_) region_owner_->release_workspace(region_);
  region_owner_ = nullptr;
  region_ = nullptr;
}

void PackedCall::write_header(void* base, DType as) const {
  store(base, as, ch::kErrorIndex, failed_ ? 1.0 : 0.0);
  store(base, as, ch::kCountIndex, failed_ ? 0.0 : local_count_);
  if (!check_) return;
  uint64_t h = fnv1a(ch::kFnvOffset, op_, std::strlen(op_));
  const double wire_id = static_cast<double>(wire_);
  h = fnv1a(h, &wire_id, sizeof wire_id);
  for (const FieldValue& f : fields_) {
    h = fnv1a(h, f.name, std::strlen(f.name));
    h = fnv1a(h, &f.value, sizeof f.value);
  }
  const int b = ch::chunk_bits(wire_ == DType::I64   ? 63
                               : wire_ == DType::F64 ? 53
                                                     : 24,
                               comm_.size());
  for (int i = 0; i < ch::kChunks; ++i) {
    const double c = static_cast<double>((h >> (ch::kChunkStride * i)) & ((1ULL << b) - 1));
    store(base, as, ch::chunk_index(i), c);
    store(base, as, ch::chunk_index(i) + 1, c * c);
  }
}

void PackedCall::check_header(const void* base, DType as) {
  bool bad = load(base, as, ch::kErrorIndex) != 0.0;
  if (check_) {
    const double p = comm_.size();
    for (int i = 0; i < ch::kChunks; ++i) {
      const double s1 = load(base, as, ch::chunk_index(i));
      const double s2 = load(base, as, ch::chunk_index(i) + 1);
      if (p * s2 != s1 * s1) bad = true;
    }
  }
  if (bad) diagnose();
  global_count_ = load(base, as, ch::kCountIndex);
}

void PackedCall::wait_checked(Communicator::Request& r) {
  try {
    comm_.wait(r);
  } catch (const Error& e) {
    // A size-checked sum whose counts differ (one rank's header-only sum against another's
    // header + payload, or payloads of different sizes): every rank sees it, so every rank
    // names the field the ranks disagree on, as for any other disagreement.
    if (e.code() != ErrorCode::kMismatch) throw;
    diagnose();
  }
}

bool PackedCall::check_in_sum() const {
  return (header_values_ + payload_values_) * dtype_size(wire_) <= comm_.size_checked_sum_bytes();
}

void PackedCall::begin_check() {
  if (dev_ || !strict_ || header_req_.id || header_checked_ || check_in_sum()) return;
  if (bytes_.empty()) prepare(0, 0);
  write_header(bytes_.data(), wire_);
  header_sent_ok_ = !failed_;
  header_req_ = comm_.start_all_reduce_sum(bytes_.data(), header_values_, wire_);
}

void PackedCall::force_strict() {
  if (strict_) return;
  strict_ = true;
  check_ = true;
  header_values_ = static_cast<size_t>(ch::header_values(true));
}

void PackedCall::check_header_first() {
  if (header_checked_ || !strict_) return;
  if (dev_) {
    std::vector<double> head(header_values_);
    write_header(head.data(), DType::F64);
    std::vector<double> sum = head;
    control_sum(sum.data(), sum.size());
    header_checked_ = true;
    check_header(sum.data(), DType::F64);  // throws on every rank together
    // Device memory only once every rank has accepted the call (see reduce_device).
    if (!dev_base_) prepare(0, 0);
    enqueue_device_header(head.data());
    return;
  }
  if (bytes_.empty()) prepare(0, 0);
  // The header first, in its own sum (started under the partial by begin_check), so that
  // ranks that disagree on sizes never enter payload sums of different lengths. A call whose
  // one sum could have carried it (check_in_sum) sends it now: its payload goes in slices.
  if (!header_req_.id) {
    write_header(bytes_.data(), wire_);
    header_sent_ok_ = !failed_;
    header_req_ = comm_.start_all_reduce_sum(bytes_.data(), header_values_, wire_);
  }
  wait_checked(header_req_);
  // Failed after its header said it had not (a host partial that threw: std::bad_alloc):
  // the others would apply this rank's missing statistics, and this rank cannot stay out of
  // their payload sum without stranding them. End the job instead.
  if (failed_ && header_sent_ok_)
    comm_.abort_job("tpnorm: rank " + std::to_string(comm_.rank()) + " of " +
                    std::to_string(comm_.size()) + ": " + op_ +
                    " failed after its call header was sent: " + message_ +
                    "; ending the job (the other ranks would use this rank's missing "
                    "statistics)");
  header_checked_ = true;
  check_header(bytes_.data(), wire_);  // throws on every rank together
}

Communicator::Request PackedCall::start_slice(size_t first, size_t count) {
  const size_t w = dtype_size(wire_);
  if (dev_) {
    // The first slice carries the header (written by check_header_first) to the apply kernels.
    const size_t at = first == 0 ? 0 : header_values_ + first;
    const size_t n = first == 0 ? header_values_ + count : count;
    return comm_.start_all_reduce_sum(static_cast<char*>(dev_base_) + at * w, n, wire_);
  }
  return comm_.start_all_reduce_sum(static_cast<char*>(payload_data()) + first * w, count, wire_);
}

void PackedCall::start_reduce() {
  if (dev_ && !header_checked_) return reduce_device();
  if (dev_) {  // header checked and written (check_header_first): header + payload at once
    comm_.all_reduce_sum(dev_base_, header_values_ + payload_values_, wire_);
    return;
  }
  if (bytes_.empty()) prepare(0, 0);
  void* base = bytes_.data();
  if (header_checked_ || (strict_ && !check_in_sum())) {
    check_header_first();  // nothing left to do when a chunked call's runner checked it first
    payload_req_ = comm_.start_all_reduce_sum(payload_data(), payload_values_, wire_);
  } else {
    write_header(base, wire_);
    if (failed_) std::memset(payload_data(), 0, payload_values_ * dtype_size(wire_));
    payload_req_ = comm_.start_all_reduce_sum(base, header_values_ + payload_values_, wire_);
  }
}

void PackedCall::finish_reduce() {
  if (dev_) return;
  if (header_checked_)
    comm_.wait(payload_req_);
  else
    wait_checked(payload_req_);
  if (!header_checked_) check_header(bytes_.data(), wire_);
}

// One collective on device; the host only reads the header in strict calls, via the control
// all-reduce, before anything is enqueued. A rank that failed locally joins with its error
// flag and a zero payload, then throws its own message; the other ranks' apply kernels see the
// flag on device (see tpnorm/cuda.h).
void PackedCall::reduce_device() {
  std::vector<double> head(header_values_);
  write_header(head.data(), DType::F64);
  if (strict_) {
    std::vector<double> sum = head;
    control_sum(sum.data(), sum.size());
    check_header(sum.data(), DType::F64);  // throws on every rank together
  }
  // Device memory is asked for only after the host check: a rank whose workspace could not be
  // had (its failure is in the header) must join that check, not throw alone from a second
  // allocation that fails too. Past the strict calls such a rank has already ended the job.
  if (!dev_base_) prepare(0, 0);
  // The partial kernel wrote the same header already (take_device_header), unless this rank
  // failed since: then the header kernel writes the failure and a zero payload.
  if (!header_by_partial_ || failed_) enqueue_device_header(head.data());
  comm_.all_reduce_sum(dev_base_, header_values_ + payload_values_, wire_);
  throw_if_failed_locally(comm_.rank());
}

// The header kernel (kernels/cuda/call_header.h) writes this rank's header, and a failed
// rank's zero payload, into the device buffer. Nothing here may keep the rank out of the
// collective that follows: a launch that fails poisons the header (DeviceCommunicator::poison:
// NaN, or kInt64Poison for Stats::kExact; every rank's apply kernels reject the call) and
// becomes this rank's failure, thrown after the collective.
void PackedCall::enqueue_device_header(const double* head) {
  try {
#ifdef TPNORM_WITH_CUDA
    kernels::cuda::write_header(dev_base_, device_wire(wire_), head, static_cast<int>(header_values_),
                                failed_ ? payload_values_ : 0, dev_->stream());
#else
    (void)head;
    throw Error(ErrorCode::kInternal, "tpnorm: a device call in a build without CUDA");
#endif
  } catch (const std::exception& e) {
    fail(e.what(), ErrorCode::kCommunication);
    dev_->poison(dev_base_, header_values_ * dtype_size(wire_), wire_ == DType::I64);
  }
}

bool PackedCall::take_device_header(double* head) {
  if (!dev_ || !dev_base_ || failed_) return false;
  write_header(head, DType::F64);
  header_by_partial_ = true;
  return true;
}

void PackedCall::control_sum(double* buf, size_t n) {
  if (dev_)
    dev_->control_all_reduce_sum(buf, n);
  else
    comm_.all_reduce_sum(buf, n, DType::F64);
}

void PackedCall::diagnose() {
  const int p = comm_.size(), me = comm_.rank();
  std::vector<double> table(static_cast<size_t>(p) * kRow, 0.0);
  double* row = table.data() + static_cast<size_t>(me) * kRow;
  row[0] = failed_ ? 1 : 0;
  row[1] = static_cast<double>(code_);
  row[2] = static_cast<double>(fields_.size());
  for (size_t i = 0; i < fields_.size(); ++i) row[kRowFields + i] = fields_[i].value;
  put_text(row + kRowOp, kOpChars, op_);
  put_text(row + kRowMsg, kMsgChars, message_);
  control_sum(table.data(), table.size());

  auto at = [&](int r) { return table.data() + static_cast<size_t>(r) * kRow; };
  std::ostringstream s;
  ErrorCode code = ErrorCode::kMismatch;
  int shown = 0;
  for (int r = 0; r < p; ++r) {
    if (at(r)[0] == 0) continue;
    if (shown == 0) {
      code = static_cast<ErrorCode>(static_cast<int>(at(r)[1]));
      s << "tpnorm: " << get_text(at(r) + kRowOp, kOpChars) << " failed";
    }
    if (shown < 4)
      s << (shown ? "; " : ": ") << "rank " << r << ": " << get_text(at(r) + kRowMsg, kMsgChars);
    ++shown;
  }
  if (shown > 4) s << "; and " << shown - 4 << " more ranks";
  if (shown == 0) {
    const std::string op0 = get_text(at(0) + kRowOp, kOpChars);
    bool same_op = true;
    for (int r = 1; r < p; ++r) same_op &= get_text(at(r) + kRowOp, kOpChars) == op0;
    if (!same_op) {
      s << "tpnorm: ranks disagree on the call:";
      for (int r = 0; r < p; ++r)
        s << (r ? "," : "") << " rank " << r << " called " << get_text(at(r) + kRowOp, kOpChars);
    } else {
      size_t field = fields_.size();
      for (size_t i = 0; i < fields_.size() && field == fields_.size(); ++i)
        for (int r = 1; r < p; ++r)
          if (at(r)[kRowFields + i] != at(0)[kRowFields + i]) field = i;
      s << "tpnorm: " << op0 << ": ranks disagree on ";
      if (field == fields_.size()) {
        s << "the statistics mode (wire dtype)";
      } else {
        auto value = [&](int r) { return at(r)[kRowFields + field]; };
        s << "'" << fields_[field].name << "': values by rank [";
        for (int r = 0; r < p; ++r) s << (r ? ", " : "") << fmt(value(r));
        // Name the odd ranks out: those that differ from a strict majority, else from rank 0.
        int ref = 0, best = 0;
        for (int r = 0; r < p; ++r) {
          int n = 0;
          for (int q = 0; q < p; ++q) n += value(q) == value(r);
          if (n > best) best = n, ref = r;
        }
        if (2 * best <= p) ref = 0;
        s << "]; differing from " << (ref == 0 && 2 * best <= p ? "rank 0" : "the majority")
          << ": rank";
        for (int r = 0, k = 0; r < p; ++r)
          if (value(r) != value(ref)) s << (k++ ? "," : " ") << r;
      }
    }
  }
  throw Error(code, s.str());
}

}  // namespace tpnorm::detail

namespace tpnorm {

int call_header_values(bool check_agreement) {
  return detail::call_header::header_values(check_agreement);
}

}  // namespace tpnorm
