// op_row_norm.cpp — LayerNorm and RMSNorm for the benchmark (the case is row_norm_case.h).
#include "row_norm_case.h"

namespace tpnorm_bench {

std::unique_ptr<BenchCase> make_layernorm(const BenchConfig& c, int rank, int size) {
  return std::make_unique<RowNormCase>(true, c, rank, size);
}
std::unique_ptr<BenchCase> make_rmsnorm(const BenchConfig& c, int rank, int size) {
  return std::make_unique<RowNormCase>(false, c, rank, size);
}

}  // namespace tpnorm_bench
