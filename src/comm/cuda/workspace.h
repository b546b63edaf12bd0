// workspace.h — a device communicator's workspace (each call's header + payload + kernel
// scratch) and its growth policy. Host code over an allocator, so that a host unit test
// (tests/gpu/host_test_gpu_policies.cpp) checks the policy without a GPU.
//
// Policy: a call that needs more than the current block gets a new block of
// max(bytes, 2 * capacity, 64 KiB); the old block is RETIRED, never freed while the
// communicator lives. A CUDA graph captured earlier holds the old block's address and keeps
// replaying into it, and calls enqueued earlier may still be using it on the stream: freeing
// it would make both read and write freed memory. Retired blocks are freed by the destructor
// (after the owner has synchronised its stream). Cost: with doubling, all blocks together stay
// below twice the largest. Growth never synchronises the stream.
//
// Growth is refused while the stream is being captured (cudaMalloc cannot be captured): run a
// call once before capturing it, or tpnorm::cuda_reserve_workspace. A failed allocation throws
// and leaves the current block (and capacity) as they were.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "tpnorm/error.h"

namespace tpnorm::detail {

class Workspace {
 public:
  using Alloc = std::function<void*(size_t bytes)>;  ///< throws on failure
  using Free = std::function<void(void* block)>;

  Workspace(Alloc alloc, Free free) : alloc_(std::move(alloc)), free_(std::move(free)) {}
  ~Workspace() { release_all(); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  /// At least `bytes` of the current block (see the policy above).
  void* get(size_t bytes, bool capturing) {
    if (current_ && bytes <= cap_) return current_;
    if (capturing)
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: the device workspace must grow to " + std::to_string(bytes) +
                      " bytes while the stream is being captured; run the call once before "
                      "capturing it, or call tpnorm::cuda_reserve_workspace");
    const size_t n = std::max<size_t>({bytes, 2 * cap_, kMinBytes});
    void* fresh = alloc_(n);  // throws: nothing changed
    if (current_) retired_.push_back(current_);
    current_ = fresh;
    cap_ = n;
    return current_;
  }

  size_t capacity() const { return cap_; }
  /// Blocks alive: the current one and the retired ones.
  size_t blocks() const { return retired_.size() + (current_ ? 1 : 0); }
  /// True when [p, p + bytes) lies in the current block: a collective on workspace memory
  /// longer than that could not be joined (see NcclCommunicator::do_all_reduce_sum).
  bool fits(const void* p, size_t bytes) const {
    const char* b = static_cast<const char*>(current_);
    const char* q = static_cast<const char*>(p);
    return current_ && q >= b && q <= b + cap_ && bytes <= static_cast<size_t>(b + cap_ - q);
  }
  /// True when p points into the current block.
  bool owns(const void* p) const {
    const char* b = static_cast<const char*>(current_);
    const char* q = static_cast<const char*>(p);
    return current_ && q >= b && q < b + cap_;
  }

  /// Frees every block (the owner synchronised its stream first).
  void release_all() {
    for (void* b : retired_) free_(b);
    retired_.clear();
    if (current_) free_(current_);
    current_ = nullptr;
    cap_ = 0;
  }

  static constexpr size_t kMinBytes = size_t{1} << 16;

 private:
  Alloc alloc_;
  Free free_;
  void* current_ = nullptr;
  size_t cap_ = 0;
  std::vector<void*> retired_;
};

}  // namespace tpnorm::detail
