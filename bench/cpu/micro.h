// micro.h — the microbenchmark harness shared by every op file (micro_*.cpp).
//
// An op file calls add_op() at static-initialisation time for each (op, pass, shape); the
// harness (micro_main.cpp) registers it at 1 and 2 threads, registers the memory limit for the
// same byte count (memcpy and a streaming-store copy, same threads), runs everything with
// Google Benchmark and prints a table of median bytes/s against the faster copy. add_mode_pair()
// registers an op's two statistics modes timed against each other (a second table).
//
// Bytes are the op's minimum traffic: forward reads x and writes y, backward reads x and dy and
// writes dx (parameters and per-row statistics are negligible and not counted). An op that must
// read an input again after its collective (SyncBatchNorm: the apply cannot start before the
// channel statistics are summed) also states the bytes it really moves (`moved`), and the table
// gives its ratio to the memory limit over those bytes too.
#pragma once

#include <cstdint>
#include <functional>
#include <new>
#include <string>
#include <vector>

namespace tpnorm_perf {

/// One call of the op at `threads` OpenMP threads (NormOptions::num_threads).
using Call = std::function<void(int threads)>;

/// [in] make: allocates and fills the op's buffers when its benchmark starts (not at
/// registration, so only one case's tensors are alive at a time) and returns the call.
/// moved: the bytes the op really moves (0: `bytes`).
void add_op(const std::string& op, const std::string& pass, const std::string& shape, int64_t bytes,
            std::function<Call()> make, int64_t moved = 0);

/// One op in Stats::kRobust and in Stats::kExact on the same buffers, for the exact-vs-robust
/// table: `bytes_sent` reads the payload counter of the communicator both calls use.
struct ModePair {
  Call robust, exact;
  std::function<uint64_t()> bytes_sent;
};

/// [in] make: as for add_op, once per benchmark. The harness times the two calls alternately,
/// call by call, in the same benchmark (so both see the same load), at 1 and 2 threads, and
/// reports each mode's median bytes/s, the median of the per-pair ratios exact / robust, and
/// each mode's payload bytes per call.
void add_mode_pair(const std::string& op, const std::string& pass, const std::string& shape,
                   int64_t bytes, std::function<ModePair()> make);

/// Registers from a namespace-scope initialiser: `static const bool r = tpnorm_perf::on_load(f);`
inline bool on_load(void (*f)()) {
  f();
  return true;
}

/// Allocates on 64-byte boundaries, as PyTorch's CPU allocator and the memory limit's copy
/// buffers do. (std::vector's 16-byte alignment put every vector load of a row across two cache
/// lines: the fused LayerNorm backward at [16384, 4096] ran ~25 % slower on such buffers.)
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Aligned64&) const { return true; }
  bool operator!=(const Aligned64&) const { return false; }
};
/// The benchmarks' tensors.
using Floats = std::vector<float, Aligned64<float>>;

/// Cheap deterministic inputs of n elements each: x around 3.5 (mean != 0), dy around 0.
inline void fill_inputs(int64_t n, Floats& x, Floats& dy) {
  x.resize(n);
  dy.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = 3.0f + static_cast<float>((i * 37) & 1023) * 1e-3f;
    dy[i] = static_cast<float>((i * 11) & 511) * 1e-3f - 0.25f;
  }
}

}  // namespace tpnorm_perf
