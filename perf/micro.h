// micro.h — the microbenchmark harness shared by every op file (perf/micro_*.cpp).
//
// An op file calls add_op() at static-initialisation time for each (op, pass, shape); the
// harness (micro_main.cpp) registers it at 1 and 2 threads, registers the memory limit for the
// same byte count (memcpy and a streaming-store copy, same threads), runs everything with
// Google Benchmark and prints a table of median bytes/s against the faster copy.
//
// Bytes are the op's minimum traffic: forward reads x and writes y, backward reads x and dy and
// writes dx (parameters and per-row statistics are negligible and not counted).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace tpnorm_perf {

/// One call of the op at `threads` OpenMP threads (NormOptions::num_threads).
using Call = std::function<void(int threads)>;

/// [in] make: allocates and fills the op's buffers when its benchmark starts (not at
/// registration, so only one case's tensors are alive at a time) and returns the call.
void add_op(const std::string& op, const std::string& pass, const std::string& shape,
            int64_t bytes, std::function<Call()> make);

/// Registers from a namespace-scope initialiser: `static const bool r = tpnorm_perf::on_load(f);`
inline bool on_load(void (*f)()) { f(); return true; }

}  // namespace tpnorm_perf
