// mpi_world.h — an MPI communicator over MPI_COMM_WORLD in one of the agreement modes the
// failure tests run every case in:
//   -1            strict (the MPI default): small calls check their header inside their one
//                 size-checked sum, large ones send it first in its own sum
//   kHeaderFirst  strict, every call sending its header first whatever its size (a wrapper
//                 that reports no size-checked sums): the large calls' path at test sizes
//   0             folded: the header rides with the payload, checked when it is back
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <unordered_map>
#include <utility>

#include "tpnorm/communicator.h"
#include "tpnorm/mpi.h"

namespace tpnorm_test {

inline constexpr int64_t kHeaderFirst = -2;

class HeaderFirstCommunicator final : public tpnorm::Communicator {
 public:
  explicit HeaderFirstCommunicator(std::unique_ptr<tpnorm::Communicator> inner)
      : inner_(std::move(inner)) {
    set_strict_calls(-1);
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  tpnorm::Device device() const override { return inner_->device(); }
  size_t size_checked_sum_bytes() const override { return 0; }
  [[noreturn]] void abort_job(const std::string& message) override {
    inner_->abort_job(message);
    std::abort();  // not reached: abort_job does not return
  }

 protected:
  void do_all_reduce_sum(void* buf, size_t count, tpnorm::DType dtype) override {
    inner_->all_reduce_sum(buf, count, dtype);
  }
  void do_start_all_reduce_sum(uint64_t id, void* buf, size_t count, tpnorm::DType dtype) override {
    started_[id] = inner_->start_all_reduce_sum(buf, count, dtype);
  }
  void do_progress_in_background() override { inner_->progress_in_background(); }
  void do_wait(uint64_t id) override {
    Request r = std::move(started_[id]);
    started_.erase(id);
    inner_->wait(r);
  }

 private:
  std::unique_ptr<tpnorm::Communicator> inner_;
  std::unordered_map<uint64_t, Request> started_;
};

inline std::unique_ptr<tpnorm::Communicator> mpi_world(int64_t mode) {
  auto c = tpnorm::make_mpi_communicator(MPI_COMM_WORLD);
  if (mode == kHeaderFirst) return std::make_unique<HeaderFirstCommunicator>(std::move(c));
  c->set_strict_calls(mode);
  return c;
}

}  // namespace tpnorm_test
