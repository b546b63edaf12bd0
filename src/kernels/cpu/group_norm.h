// group_norm.h — CPU kernels of GroupNorm / InstanceNorm on NCHW with channels sharded.
//
// x is [n, c_local, spatial] (spatial = product of the spatial dims, contiguous per channel):
// each (sample, local channel) plane is a "row" of `spatial` elements. This rank's channels are
// [c0, c0 + c_local) of all channels; channel c belongs to group c / cpg. Group statistics are
// per (sample, group) for ALL groups: slots of groups this rank does not touch stay 0.
//
// Stats layout per (sample, group): forward {sum x, sum x^2}; backward {sum g, sum g*xhat}
// with g = dy * gamma[c]. The partials reuse the row kernels (row_norm.h) per plane and fold
// the planes into their groups: forward sums are pivoted per plane in the robust mode; the
// backward's gamma is constant over a plane, so it multiplies the plane's sums.
#pragma once

#include <cstdint>

namespace tpnorm::kernels::cpu {

struct GroupNormArgs {
  int64_t n = 0;        ///< samples
  int64_t c_local = 0;  ///< this rank's channels
  int64_t spatial = 0;  ///< elements per channel plane
  int64_t c0 = 0;       ///< first channel of this rank
  int64_t groups = 1;   ///< all groups
  int64_t cpg = 1;      ///< channels per group
  int threads = 0;
  /// Stats::kExact: group_apply_forward's stats hold each slot's {mean, variance}, rounded once
  /// from exact sums (kernels/cpu/exact_groups.h), used as they are.
  bool final_stats = false;
};

/// Adds this rank's planes into stats [n * groups * 2] (zeroed by the caller).
template <class T, class W>
void group_partial_forward(const GroupNormArgs& a, const T* x, W* stats);

/// count: elements per group over all ranks. Writes y, and mean / rstd [n * groups] (all
/// groups) when non-null.
template <class T, class W, class S>
void group_apply_forward(const GroupNormArgs& a, const T* x, const T* gamma, const T* beta,
                         const W* stats, double count, double eps, T* y, S* mean, S* rstd);

/// Adds this rank's planes into stats [n * groups * 2]; writes dparams [2 * c_local] =
/// {sum dy*xhat per channel, sum dy per channel} over this rank's samples (in float64).
template <class T, class W, class S>
void group_partial_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                            const S* mean, const S* rstd, W* stats, double* dparams);

/// Writes dx, and dgamma / dbeta [c_local] from dparams when non-null.
template <class T, class W, class S>
void group_apply_backward(const GroupNormArgs& a, const T* dy, const T* x, const T* gamma,
                          const S* mean, const S* rstd, const W* stats, double count,
                          const double* dparams, T* dx, T* dgamma, T* dbeta);

// float64 storage: double kernels of their own (kernels/cpu/float64.cpp), every sum and
// element formula in double, for every wire and saved-statistics type.
#define TPNORM_GROUP_F64_W(W) \
  template <>                 \
  void group_partial_forward<double, W>(const GroupNormArgs&, const double*, W*);
#define TPNORM_GROUP_F64_WS(W, S)                                                                 \
  template <>                                                                                     \
  void group_apply_forward<double, W, S>(const GroupNormArgs&, const double*, const double*,      \
                                         const double*, const W*, double, double, double*, S*,    \
                                         S*);                                                     \
  template <>                                                                                     \
  void group_partial_backward<double, W, S>(const GroupNormArgs&, const double*, const double*,   \
                                            const double*, const S*, const S*, W*, double*);      \
  template <>                                                                                     \
  void group_apply_backward<double, W, S>(const GroupNormArgs&, const double*, const double*,     \
                                          const double*, const S*, const S*, const W*, double,    \
                                          const double*, double*, double*, double*);
TPNORM_GROUP_F64_W(float)
TPNORM_GROUP_F64_W(double)
TPNORM_GROUP_F64_WS(float, float)
TPNORM_GROUP_F64_WS(float, double)
TPNORM_GROUP_F64_WS(double, float)
TPNORM_GROUP_F64_WS(double, double)
#undef TPNORM_GROUP_F64_W
#undef TPNORM_GROUP_F64_WS

}  // namespace tpnorm::kernels::cpu
