// communicator.cpp — the counted all_reduce_sum front, the single-process communicator, and
// the shared failure path of the TPNORM_CHECK family.
#include "tpnorm/communicator.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "comm/device_comm.h"
#include "common/check.h"
#include "tpnorm/error.h"

namespace tpnorm {

void Communicator::all_reduce_sum(void* buf, size_t count, DType dtype) {
  counters_.calls += 1;
  counters_.bytes_sent += count * dtype_size(dtype);
  if (count > 0) do_all_reduce_sum(buf, count, dtype);
}

Communicator::Request Communicator::start_all_reduce_sum(void* buf, size_t count, DType dtype) {
  counters_.calls += 1;
  counters_.bytes_sent += count * dtype_size(dtype);
  if (count == 0) return {};
  const uint64_t id = ++next_request_;
  do_start_all_reduce_sum(id, buf, count, dtype);
  ++in_flight_;
  return Request(id);
}

void Communicator::wait(Request& r) {
  if (r.id == 0) return;
  const uint64_t id = r.id;
  r.id = 0;  // a failed wait is not retried: the transport is broken either way
  --in_flight_;
  // The quick wait (see note_quick_wait): everything it reads is in this object, except the
  // word, which the MPI communicator keeps in its own part of it.
  QuickWait& q = quick_[id % kQuickWaits];
  if (q.id == id && quick_count_ < kQuickWaits &&
      q.word->load(std::memory_order_acquire) == q.value) {
    q.id = 0;
    quick_taken_[quick_count_++] = id;
    ++quick_waits_;
    return;
  }
  do_wait(id);
}

size_t Communicator::take_quick_waits(uint64_t* ids) {
  const size_t n = quick_count_;
  for (size_t k = 0; k < n; ++k) ids[k] = quick_taken_[k];
  quick_count_ = 0;
  return n;
}

bool Communicator::strict_calls_from_env() {
  const char* v = std::getenv("TPNORM_STRICT_CALLS");
  return v && *v;
}

int64_t Communicator::default_strict_calls() {
  return strict_calls_from_env() ? std::strtoll(std::getenv("TPNORM_STRICT_CALLS"), nullptr, 10)
                                 : 16;
}

double Communicator::default_timeout() {
  const char* v = std::getenv("TPNORM_TIMEOUT");
  return v && *v ? std::strtod(v, nullptr) : 300.0;
}

void Communicator::abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string Communicator::watchdog_message() const {
  return watchdog_message(current_op_, sequence_);
}

std::string Communicator::watchdog_message(const char* op, uint64_t sequence) const {
  std::ostringstream s;
  s << "tpnorm watchdog: rank " << rank() << " of " << size() << ": " << (op ? op : "a collective")
    << " (call " << sequence << " on this communicator) did not finish within " << timeout_s_
    << " s (TPNORM_TIMEOUT): a rank died or stopped calling; aborting the job";
  return s.str();
}

namespace {

class SingleCommunicator final : public Communicator {
 public:
  explicit SingleCommunicator(Device d) : device_(d) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  // One rank cannot disagree with itself.
  size_t size_checked_sum_bytes() const override { return SIZE_MAX; }

 protected:
  void do_all_reduce_sum(void*, size_t, DType) override {}  // the sum over one rank

 private:
  Device device_;
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator(Device device) {
  return std::make_unique<SingleCommunicator>(device);
}

int64_t slice_offset(Communicator& comm, int64_t count, int64_t total) {
  const int P = comm.size();
  const int r = comm.rank();
  // Every rank's (count, total) in its own slot: after the sum each rank holds all of them and
  // reaches the same verdict.
  std::vector<double> t(2 * static_cast<size_t>(P), 0.0);
  t[2 * static_cast<size_t>(r)] = static_cast<double>(count);
  t[2 * static_cast<size_t>(r) + 1] = static_cast<double>(total);
  if (P > 1) {
    if (auto* dev = dynamic_cast<detail::DeviceCommunicator*>(&comm))
      dev->control_all_reduce_sum(t.data(), t.size());
    else
      comm.all_reduce_sum(t.data(), t.size(), DType::F64);
  }
  double sum = 0, below = 0;
  bool bad = false;
  std::ostringstream sizes;
  for (int q = 0; q < P; ++q) {
    const double c = t[2 * static_cast<size_t>(q)], n = t[2 * static_cast<size_t>(q) + 1];
    bad = bad || c < 0 || n != t[1];
    sum += c;
    if (q < r) below += c;
    sizes << (q ? ", " : "") << static_cast<int64_t>(c) << " of " << static_cast<int64_t>(n);
  }
  if (bad || sum != t[1])
    throw Error(ErrorCode::kInvalidArgument,
                "tpnorm: slice_offset: the ranks' slices (count of total, by rank: " +
                    sizes.str() + ") do not add up to one total");
  return static_cast<int64_t>(below);
}

namespace detail {

void throw_check_failure(const char* kind, const char* stmt, const char* file, int line,
                         const std::string& detail) {
  std::ostringstream s;
  s << "tpnorm: " << kind << " call failed: " << stmt << " at " << file << ':' << line << ": "
    << detail;
  throw Error(ErrorCode::kCommunication, s.str());
}

}  // namespace detail
}  // namespace tpnorm
