// group_reference.h — float64 GroupNorm reference on full NCHW data, and a runner for tpnorm's
// group_norm_* / instance_norm_* on one rank's channel slice.
#pragma once

#include <cstdint>
#include <vector>

#include "tpnorm/communicator.h"
#include "tpnorm/group_norm.h"

namespace tpnorm_test {

struct GroupRef {
  std::vector<double> y, mean, rstd, dx, dgamma, dbeta;  // mean/rstd [N*G]; dgamma/dbeta [C]
};

/// x [n, c, s]; gamma/beta [c] or empty; backward too when dy is non-empty.
GroupRef group_norm_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t s,
                              int64_t groups, const std::vector<float>& gamma,
                              const std::vector<float>& beta, double eps,
                              const std::vector<float>& dy = {});

/// Channels [c0, c0 + nc) of x [n, c, s].
std::vector<float> channel_slice(const std::vector<float>& x, int64_t n, int64_t c, int64_t s,
                                 int64_t c0, int64_t nc);
std::vector<double> channel_slice(const std::vector<double>& x, int64_t n, int64_t c, int64_t s,
                                  int64_t c0, int64_t nc);

struct GroupSetup {
  tpnorm::DType dt = tpnorm::DType::F32, saved = tpnorm::DType::F32;
  int64_t n = 0, c_local = 0, s = 1;  // this rank's shape [n, c_local, s]
  tpnorm::ChannelGroups cg;
  bool affine = false, backward = true, instance = false;
  tpnorm::NormOptions opt;
};
struct GroupOut {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};
/// Inputs are rounded to st.dt; mean / rstd hold st.cg.groups (or C, instance) per sample.
GroupOut run_group(tpnorm::Communicator& comm, const GroupSetup& st, const std::vector<float>& x,
                   const std::vector<float>& gamma, const std::vector<float>& beta,
                   const std::vector<float>& dy);

}  // namespace tpnorm_test
