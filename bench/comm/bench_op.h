// bench_op.h — what one op gives the benchmark harness (nccl-tests style: the harness owns
// main, flags, timing, checking and the report; an op is one small file filling this table).
//
// Adding an op: write op_<name>.cpp with a make_<name>() returning a BenchCase, and add one
// line to op_table.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tpnorm/communicator.h"
#include "tpnorm/norm.h"

namespace tpnorm_bench {

struct BenchConfig {
  int64_t rows = 512, hidden = 1024;         // row norms: x [rows, hidden], hidden sharded
  int64_t kv_hidden = 0;                     // QK-norm strategies: k's width (0: hidden)
  std::vector<int64_t> shape{32, 64, 8, 8};  // syncbn: NCHW, batch N sharded
  tpnorm::DType dtype = tpnorm::DType::F32;
  tpnorm::Stats stats = tpnorm::Stats::kRobust;
};

/// One op at one world size on one rank: its shard of a seeded full input, and its buffers.
class BenchCase {
 public:
  virtual ~BenchCase() = default;
  /// This rank's input shape, e.g. "512x256".
  virtual std::string local_shape() const = 0;
  /// The op's forward / backward on `comm` (backward uses the forward's saved statistics).
  virtual void forward(tpnorm::Communicator& comm) = 0;
  virtual void backward(tpnorm::Communicator& comm) = 0;
  /// After forward + backward on the world: this rank's output elements (y, stats, dx, and
  /// parameter gradients) outside tolerance of a float64 reference on the full, unsharded input.
  /// Called on every rank together, so it may make collectives on MPI_COMM_WORLD.
  virtual int64_t count_wrong() = 0;
  /// docs/cpp-api.md, "One collective per call": values per rank in the call's payload, without the
  /// call header (forward: true / backward: false).
  virtual uint64_t payload_values(bool forward) const = 0;
};

struct BenchOp {
  const char* name;  // the --op name
  std::unique_ptr<BenchCase> (*make)(const BenchConfig& cfg, int rank, int size);
};

/// Every op the benchmark knows, in report order.
const std::vector<BenchOp>& bench_ops();

/// Values in the call header (docs/cpp-api.md, "One collective per call"), from the library.
inline uint64_t header_values(bool check_agreement) {
  return static_cast<uint64_t>(tpnorm::call_header_values(check_agreement));
}

}  // namespace tpnorm_bench
