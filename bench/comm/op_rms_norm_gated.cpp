// op_rms_norm_gated.cpp — the gated RMSNorm for the benchmark (the case is
// rms_norm_gated_case.h).
#include "rms_norm_gated_case.h"

namespace tpnorm_bench {

std::unique_ptr<BenchCase> make_rmsnormgated(const BenchConfig& c, int rank, int size) {
  return std::make_unique<GatedCase>(c, rank, size);
}

}  // namespace tpnorm_bench
