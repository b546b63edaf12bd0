// workspace.h — a device communicator's workspace pool: each call in flight owns one region
// (its header + payload + kernel scratch) from its start to its finish. Host code over an
// allocator, so that a host unit test (tests/gpu/host_test_gpu_policies.cpp) checks the
// bookkeeping without a GPU.
//
// Why a pool: calls on one communicator are stream-ordered, but split-phase calls
// (tpnorm/split.h) interleave on the stream — q's partial and sum, k's partial and sum, then
// q's apply. If both used one block, q's apply would read k's header and statistics. So
// acquire() hands a region that no other call in flight holds, and release() (at the call's
// finish) makes it free again. A free region may be handed out at once: the next user's work is
// enqueued after the previous user's on the same stream.
//
// Two kinds of region. An EAGER region serves calls enqueued for execution. A CAPTURED region
// serves calls made while the stream is being captured into a CUDA graph: the graph keeps its
// address and replays into it later, at any moment between eager calls, so a captured region is
// never handed to an eager call again; it serves later captured calls only (a graph's calls
// replay in the order they were captured, like the communicator's calls). Growth during capture
// is refused (cudaMalloc cannot be captured): a captured call takes a free captured region, or
// else a free eager region (which then becomes captured for good). Running a call once before
// capturing it leaves such a free region; so does tpnorm::cuda_reserve_workspace.
//
// Growth: when no free region of the kind is large enough, a new region of
// max(bytes, 2 * the largest free one of the kind, 64 KiB) is allocated; the free regions it
// supersedes (smaller) are RETIRED, never freed while the communicator lives (earlier work on
// the stream, or a graph, may still use them). All blocks are freed by the destructor (after
// the owner has synchronised its stream). A failed allocation throws and changes nothing.
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

  /// The message of the error acquire() throws when capture forbids growth.
  static constexpr const char* kCaptureGrowth =
      "while the stream is being captured; run the call once before capturing it, or call "
      "tpnorm::cuda_reserve_workspace";

  Workspace(Alloc alloc, Free free) : alloc_(std::move(alloc)), free_(std::move(free)) {}
  ~Workspace() { release_all(); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  /// A region of at least `bytes` that no call in flight holds, until release(). Throws
  /// tpnorm::Error (kInvalidArgument) when `capturing` and no free region fits, or the
  /// allocator's error when allocation fails; nothing changes then.
  void* acquire(size_t bytes, bool capturing) {
    const Kind kind = capturing ? Kind::kCaptured : Kind::kEager;
    if (Block* b = best_free(kind, bytes)) return take(*b);
    if (capturing) {
      if (Block* b = best_free(Kind::kEager, bytes)) {
        b->kind = Kind::kCaptured;
        return take(*b);
      }
      throw Error(ErrorCode::kInvalidArgument,
                  "tpnorm: the device workspace must grow to " + std::to_string(bytes) +
                      " bytes " + kCaptureGrowth);
    }
    size_t largest = 0;
    for (const Block& b : blocks_)
      if (b.kind == kind && !b.busy && !b.retired) largest = std::max(largest, b.cap);
    const size_t n = std::max<size_t>({bytes, 2 * largest, kMinBytes});
    void* fresh = alloc_(n);  // throws: nothing changed
    for (Block& b : blocks_)
      if (b.kind == kind && !b.busy && !b.retired && b.cap < n) b.retired = true;
    blocks_.push_back({fresh, n, kind, false, false});
    return take(blocks_.back());
  }

  /// Returns the region acquire() gave (a call's finish); other pointers are ignored.
  void release(void* region) {
    for (Block& b : blocks_)
      if (b.base == region) b.busy = false;
  }

  /// Makes a free eager region of at least `bytes` exist (tpnorm::cuda_reserve_workspace).
  void reserve(size_t bytes) {
    if (best_free(Kind::kEager, bytes)) return;
    release(acquire(bytes, false));
  }

  /// Blocks alive, busy and free, retired included.
  size_t blocks() const { return blocks_.size(); }
  /// Regions held by calls in flight.
  size_t busy() const {
    return static_cast<size_t>(
        std::count_if(blocks_.begin(), blocks_.end(), [](const Block& b) { return b.busy; }));
  }
  /// The capacity of the block that holds p (0: none does).
  size_t capacity_at(const void* p) const {
    const Block* b = holder(p);
    return b ? b->cap : 0;
  }
  /// True when [p, p + bytes) lies in one block: a collective on workspace memory longer than
  /// that could not be joined (see NcclCommunicator::do_all_reduce_sum).
  bool fits(const void* p, size_t bytes) const {
    const Block* b = holder(p);
    if (!b) return false;
    const char* q = static_cast<const char*>(p);
    return bytes <= static_cast<size_t>(static_cast<const char*>(b->base) + b->cap - q);
  }
  /// True when p points into a block of the pool.
  bool owns(const void* p) const { return holder(p) != nullptr; }

  /// Frees every block (the owner synchronised its stream first).
  void release_all() {
    for (Block& b : blocks_) free_(b.base);
    blocks_.clear();
  }

  static constexpr size_t kMinBytes = size_t{1} << 16;

 private:
  enum class Kind { kEager, kCaptured };
  struct Block {
    void* base;
    size_t cap;
    Kind kind;
    bool busy;
    bool retired;  // superseded by a larger block: never handed out again
  };

  // The smallest free block of the kind that holds `bytes`.
  Block* best_free(Kind kind, size_t bytes) {
    Block* best = nullptr;
    for (Block& b : blocks_)
      if (b.kind == kind && !b.busy && !b.retired && b.cap >= bytes && (!best || b.cap < best->cap))
        best = &b;
    return best;
  }
  static void* take(Block& b) {
    b.busy = true;
    return b.base;
  }
  const Block* holder(const void* p) const {
    const char* q = static_cast<const char*>(p);
    for (const Block& b : blocks_) {
      const char* s = static_cast<const char*>(b.base);
      if (q >= s && q < s + b.cap) return &b;
    }
    return nullptr;
  }

  Alloc alloc_;
  Free free_;
  std::vector<Block> blocks_;
};

}  // namespace tpnorm::detail
