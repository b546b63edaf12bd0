// group_reference.cpp — see group_reference.h. Two-pass float64 statistics.
#include "group_reference.h"

#include <cmath>

#include "storage.h"

namespace tpnorm_test {

GroupRef group_norm_reference(const std::vector<float>& x, int64_t n, int64_t c, int64_t s,
                              int64_t groups, const std::vector<float>& gamma,
                              const std::vector<float>& beta, double eps,
                              const std::vector<float>& dy) {
  GroupRef r;
  const int64_t cpg = c / groups, m = cpg * s;
  r.y.resize(x.size());
  r.mean.resize(n * groups);
  r.rstd.resize(n * groups);
  const bool bwd = !dy.empty();
  if (bwd) {
    r.dx.resize(x.size());
    r.dgamma.assign(c, 0.0);
    r.dbeta.assign(c, 0.0);
  }
  auto gm = [&](int64_t ch) { return gamma.empty() ? 1.0 : gamma[ch]; };
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = (i * c + g * cpg) * s;  // the group's elements are contiguous
      double mu = 0, var = 0;
      for (int64_t k = 0; k < m; ++k) mu += x[base + k];
      mu /= m;
      for (int64_t k = 0; k < m; ++k) var += (x[base + k] - mu) * (x[base + k] - mu);
      var /= m;
      const double rs = 1.0 / std::sqrt(var + eps);
      r.mean[i * groups + g] = mu;
      r.rstd[i * groups + g] = rs;
      double sg = 0, sgx = 0;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t ch = g * cpg + k / s;
        const double xhat = (x[base + k] - mu) * rs;
        r.y[base + k] = xhat * gm(ch) + (beta.empty() ? 0.0 : beta[ch]);
        if (!bwd) continue;
        const double gg = dy[base + k] * gm(ch);
        sg += gg;
        sgx += gg * xhat;
        r.dgamma[ch] += dy[base + k] * xhat;
        r.dbeta[ch] += dy[base + k];
      }
      if (!bwd) continue;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t ch = g * cpg + k / s;
        const double xhat = (x[base + k] - mu) * rs;
        r.dx[base + k] = rs * (dy[base + k] * gm(ch) - sg / m - xhat * sgx / m);
      }
    }
  }
  return r;
}

template <class V>
static V slice(const V& x, int64_t n, int64_t c, int64_t s, int64_t c0, int64_t nc) {
  V out(static_cast<size_t>(n * nc * s));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < nc * s; ++k) out[(i * nc) * s + k] = x[(i * c + c0) * s + k];
  return out;
}
std::vector<float> channel_slice(const std::vector<float>& x, int64_t n, int64_t c, int64_t s,
                                 int64_t c0, int64_t nc) {
  return slice(x, n, c, s, c0, nc);
}
std::vector<double> channel_slice(const std::vector<double>& x, int64_t n, int64_t c, int64_t s,
                                  int64_t c0, int64_t nc) {
  return slice(x, n, c, s, c0, nc);
}

GroupOut run_group(tpnorm::Communicator& comm, const GroupSetup& st, const std::vector<float>& x,
                   const std::vector<float>& gamma, const std::vector<float>& beta,
                   const std::vector<float>& dy) {
  using namespace tpnorm;
  const int64_t groups =
      st.instance ? (st.cg.channels >= 0 ? st.cg.channels : st.c_local) : st.cg.groups;
  const size_t ne = x.size();
  Buffer xb(st.dt, x), g(st.dt, gamma), b(st.dt, beta), y(st.dt, ne), mean(st.saved, st.n * groups),
      rstd(st.saved, st.n * groups);
  const Shape sh{st.n, st.c_local, st.s}, p{st.c_local}, r{st.n, groups};
  const TensorView gv = st.affine ? g.view(p) : TensorView{};
  const TensorView bv = st.affine ? b.view(p) : TensorView{};
  auto fwd = st.instance ? instance_norm_forward : group_norm_forward;
  fwd(comm, xb.view(sh), st.cg, gv, bv, y.view(sh), mean.view(r), rstd.view(r), st.opt);
  GroupOut o{y.floats(), mean.floats(), rstd.floats(), {}, {}, {}};
  if (!st.backward) return o;
  Buffer dyb(st.dt, dy), dx(st.dt, ne), dg(st.dt, st.c_local), db(st.dt, st.c_local);
  auto bwd = st.instance ? instance_norm_backward : group_norm_backward;
  bwd(comm, dyb.view(sh), xb.view(sh), st.cg, gv, mean.view(r), rstd.view(r), dx.view(sh),
      dg.view(p), db.view(p), st.opt);
  o.dx = dx.floats();
  o.dgamma = dg.floats();
  o.dbeta = db.floats();
  return o;
}

}  // namespace tpnorm_test
