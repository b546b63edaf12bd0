// batched_runner.cpp — see batched_runner.h.
#include "batched_runner.h"

#include "storage.h"
#include "tpnorm/batched.h"

namespace tpnorm_test {

std::vector<BatchedOut> run_batched(tpnorm::Communicator& comm,
                                    const std::vector<BatchedItem>& items, bool backward,
                                    const tpnorm::NormOptions& opt) {
  using namespace tpnorm;
  struct Bufs {
    Buffer x, gamma, beta, dy, y, mean, rstd, dx, dgamma, dbeta;
  };
  std::vector<Bufs> b(items.size());
  std::vector<RowNormItem> fwd(items.size());
  std::vector<RowNormGradItem> bwd(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const BatchedItem& it = items[i];
    const size_t n = static_cast<size_t>(it.rows * it.h);
    b[i] = {Buffer(it.dt, it.x),       Buffer(it.dt, it.gamma), Buffer(it.dt, it.beta),
            Buffer(it.dt, it.dy),      Buffer(it.dt, n),        Buffer(it.saved, it.rows),
            Buffer(it.saved, it.rows), Buffer(it.dt, n),        Buffer(it.dt, it.h),
            Buffer(it.dt, it.h)};
    const Shape s{it.rows, it.h}, p{it.h}, r{it.rows};
    Bufs& q = b[i];
    const TensorView g = it.affine ? q.gamma.view(p) : TensorView{};
    const TensorView be = it.affine && it.centered ? q.beta.view(p) : TensorView{};
    const TensorView mean = it.centered ? q.mean.view(r) : TensorView{};
    fwd[i] = {it.centered, q.x.view(s), g, be, q.y.view(s), mean, q.rstd.view(r)};
    bwd[i] = {it.centered,
              q.dy.view(s),
              q.x.view(s),
              g,
              mean,
              q.rstd.view(r),
              q.dx.view(s),
              q.dgamma.view(p),
              it.centered ? q.dbeta.view(p) : TensorView{}};
  }
  batched_norm_forward(comm, fwd.data(), fwd.size(), opt);
  if (backward) batched_norm_backward(comm, bwd.data(), bwd.size(), opt);
  std::vector<BatchedOut> out(items.size());
  for (size_t i = 0; i < items.size(); ++i)
    out[i] = {b[i].y.floats(),  b[i].mean.floats(),   b[i].rstd.floats(),
              b[i].dx.floats(), b[i].dgamma.floats(), b[i].dbeta.floats()};
  return out;
}

}  // namespace tpnorm_test
