// exact_bn_support.h — what the GPU tests of SyncBatchNorm's Stats::kExact share
// (test_gpu_exact_bn.cpp, mpi/test_gpu_exact_bn_mpi.cpp): a case's full batch, the tensors of
// a rank's samples, and one sequence of calls (training forward + backward, eval forward +
// backward, eval backward without dgamma / dbeta) on any communicator, whose every output the
// tests compare bit for bit.
#pragma once

#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "exact_support.h"
#include "harness.h"
#include "tpnorm/batch_norm.h"

namespace tpnorm_gpu {

struct BnCase {
  const char* name;
  int64_t n, c;
  std::vector<int64_t> spatial;
  tpnorm::DType dt = tpnorm::DType::F32;
  tpnorm::DType stat = tpnorm::DType::F32;  ///< saved and running statistics
  double offset = 0.0;
  bool affine = true;
  bool cumulative = false;  ///< momentum NaN (cumulative average)
  bool bad = false;         ///< channel 0 holds an inf: its statistics NaN

  int64_t inner() const {
    return std::accumulate(spatial.begin(), spatial.end(), int64_t{1}, std::multiplies<int64_t>());
  }
};

inline void PrintTo(const BnCase& c, std::ostream* os) { *os << c.name; }

/// [n, C, *spatial] or [n, *spatial, C].
inline tpnorm::Shape bn_shape(const BnCase& cs, int64_t n, bool channels_last) {
  tpnorm::Shape s;
  s.ndim = 2 + static_cast<int>(cs.spatial.size());
  s.dims[0] = n;
  const int cd = channels_last ? s.ndim - 1 : 1;
  s.dims[cd] = cs.c;
  for (size_t i = 0; i < cs.spatial.size(); ++i) s.dims[(cd == 1 ? 2 : 1) + i] = cs.spatial[i];
  return s;
}

/// The case's full batch in its layout (a sample's values contiguous in both layouts), rounded
/// to the storage dtype; x holds an inf in channel 0 when cs.bad.
struct BnData {
  std::vector<float> x, dy, gamma, beta;
};
inline BnData bn_data(const BnCase& cs, bool channels_last) {
  const int64_t total = cs.n * cs.c * cs.inner();
  auto rounded = [&](std::vector<float> v) { return tpnorm_test::Buffer(cs.dt, v).floats(); };
  BnData d;
  d.x = rounded(tpnorm_test::normal(43, 0, total, cs.offset, 1.5));
  if (cs.bad) d.x[channels_last ? cs.c : 1] = std::numeric_limits<float>::infinity();
  d.dy = rounded(tpnorm_test::normal(43, 1, total));
  d.gamma = rounded(tpnorm_test::normal(43, 2, cs.c, 1.0, 0.5));
  d.beta = rounded(tpnorm_test::normal(43, 3, cs.c));
  return d;
}

/// The tensors of samples [b0, b0 + nb): inputs, and every output of bn_calls (running
/// statistics start at 0.25 / 2).
inline Tensors bn_tensors(const BnCase& cs, const BnData& d, int64_t b0, int64_t nb) {
  const int64_t per = cs.c * cs.inner(), C = cs.c;
  const std::vector<float> x(d.x.begin() + b0 * per, d.x.begin() + (b0 + nb) * per),
      dy(d.dy.begin() + b0 * per, d.dy.begin() + (b0 + nb) * per);
  Tensors t;
  t.in("x", cs.dt, x);
  t.in("dy", cs.dt, dy);
  t.in("gamma", cs.dt, d.gamma);
  t.in("beta", cs.dt, d.beta);
  for (const char* name : {"y", "dx", "y_eval", "dx_eval", "dx_eval_nograd"})
    t.out(name, cs.dt, static_cast<size_t>(nb * per));
  for (const char* name : {"dgamma", "dbeta", "dgamma_eval", "dbeta_eval"}) t.out(name, cs.dt, C);
  for (const char* name : {"save_mean", "save_invstd", "save_mean_eval", "save_invstd_eval",
                           "running_mean", "running_var"})
    t.out(name, cs.stat, C);
  t.host["running_mean"] = tpnorm_test::Buffer(cs.stat, std::vector<float>(C, 0.25f));
  t.host["running_var"] = tpnorm_test::Buffer(cs.stat, std::vector<float>(C, 2.0f));
  return t;
}

inline tpnorm::BatchNormOptions bn_exact_options(const BnCase& cs, bool channels_last,
                                                 bool training) {
  tpnorm::BatchNormOptions o;
  o.stats = tpnorm::Stats::kExact;
  o.layout = channels_last ? tpnorm::Layout::kChannelsLast : tpnorm::Layout::kNCHW;
  o.training = training;
  if (cs.cumulative) o.momentum = tpnorm::BatchNormOptions::cumulative();
  return o;
}

/// Training forward + backward, then eval forward + backward (with the updated running
/// statistics), and the eval backward without dgamma / dbeta, on `comm` over nb samples.
/// Returns num_batches_tracked after the calls (it starts at 3).
inline int64_t bn_calls(tpnorm::Communicator& comm, const ViewOf& v, const BnCase& cs, int64_t nb,
                        bool channels_last) {
  using namespace tpnorm;
  const Shape s = bn_shape(cs, nb, channels_last), p{cs.c};
  const TensorView g = cs.affine ? v("gamma", p) : TensorView{};
  const TensorView b = cs.affine ? v("beta", p) : TensorView{};
  const TensorView dg = cs.affine ? v("dgamma", p) : TensorView{};
  const TensorView db = cs.affine ? v("dbeta", p) : TensorView{};
  const TensorView dge = cs.affine ? v("dgamma_eval", p) : TensorView{};
  const TensorView dbe = cs.affine ? v("dbeta_eval", p) : TensorView{};
  int64_t tracked = 3;
  const BatchNormOptions tr = bn_exact_options(cs, channels_last, true),
                         ev = bn_exact_options(cs, channels_last, false);
  sync_batch_norm_forward(comm, v("x", s), g, b, v("running_mean", p), v("running_var", p),
                          &tracked, v("y", s), v("save_mean", p), v("save_invstd", p), tr);
  sync_batch_norm_backward(comm, v("dy", s), v("x", s), g, v("save_mean", p), v("save_invstd", p),
                           v("dx", s), dg, db, tr);
  sync_batch_norm_forward(comm, v("x", s), g, b, v("running_mean", p), v("running_var", p),
                          &tracked, v("y_eval", s), v("save_mean_eval", p),
                          v("save_invstd_eval", p), ev);
  sync_batch_norm_backward(comm, v("dy", s), v("x", s), g, v("save_mean_eval", p),
                           v("save_invstd_eval", p), v("dx_eval", s), dge, dbe, ev);
  sync_batch_norm_backward(comm, v("dy", s), v("x", s), g, v("save_mean_eval", p),
                           v("save_invstd_eval", p), v("dx_eval_nograd", s), {}, {}, ev);
  return tracked;
}

}  // namespace tpnorm_gpu
