// op_table.cpp — the benchmark's list of ops: one line per op file.
#include "bench_op.h"

namespace tpnorm_bench {

std::unique_ptr<BenchCase> make_layernorm(const BenchConfig&, int rank, int size);
std::unique_ptr<BenchCase> make_rmsnorm(const BenchConfig&, int rank, int size);
std::unique_ptr<BenchCase> make_syncbn(const BenchConfig&, int rank, int size);
std::unique_ptr<BenchCase> make_rmsnormgated(const BenchConfig&, int rank, int size);

const std::vector<BenchOp>& bench_ops() {
  static const std::vector<BenchOp> ops = {
      {"layernorm", make_layernorm},
      {"rmsnorm", make_rmsnorm},
      {"syncbn", make_syncbn},
      {"rmsnormgated", make_rmsnormgated},
  };
  return ops;
}

}  // namespace tpnorm_bench
