// gated_reference.cpp — see gated_reference.h. Everything in float64 from the rounded inputs.
#include "gated_reference.h"

#include <cmath>

#include "storage.h"

namespace tpnorm_test {

GatedRef rms_norm_gated_reference(const std::vector<float>& x, const std::vector<float>& z,
                                  int64_t rows, int64_t hidden, int64_t group_size,
                                  bool norm_before_gate, const std::vector<float>& weight,
                                  double eps, const std::vector<float>& dy) {
  GatedRef r;
  const int64_t groups = hidden / group_size, m = group_size;
  const bool bwd = !dy.empty(), gated = !z.empty();
  r.y.resize(x.size());
  r.rstd.resize(rows * groups);
  if (bwd) {
    r.dx.resize(x.size());
    if (gated) r.dz.resize(x.size());
    r.dweight.assign(hidden, 0.0);
  }
  auto w = [&](int64_t c) { return weight.empty() ? 1.0 : static_cast<double>(weight[c]); };
  auto sig = [&](int64_t i) { return 1.0 / (1.0 + std::exp(-static_cast<double>(z[i]))); };
  auto silu = [&](int64_t i) { return gated ? z[i] * sig(i) : 1.0; };
  auto dsilu = [&](int64_t i) { return sig(i) * (1.0 + z[i] * (1.0 - sig(i))); };
  const bool gate_first = gated && !norm_before_gate;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = row * hidden + g * m;
      auto u = [&](int64_t i) { return gate_first ? x[i] * silu(i) : static_cast<double>(x[i]); };
      double ss = 0;
      for (int64_t k = 0; k < m; ++k) ss += u(base + k) * u(base + k);
      const double rs = 1.0 / std::sqrt(ss / m + eps);
      r.rstd[row * groups + g] = rs;
      double sgu = 0;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t i = base + k, c = g * m + k;
        const double uhat = u(i) * rs;
        const double post = gated && norm_before_gate ? silu(i) : 1.0;
        r.y[i] = uhat * w(c) * post;
        if (!bwd) continue;
        const double gr = dy[i] * w(c) * post;
        sgu += gr * uhat;
        r.dweight[c] += dy[i] * uhat * post;
      }
      if (!bwd) continue;
      for (int64_t k = 0; k < m; ++k) {
        const int64_t i = base + k, c = g * m + k;
        const double uhat = u(i) * rs;
        const double post = gated && norm_before_gate ? silu(i) : 1.0;
        const double du = rs * (dy[i] * w(c) * post - uhat * sgu / m);
        if (!gated) {
          r.dx[i] = du;
        } else if (norm_before_gate) {
          r.dx[i] = du;
          r.dz[i] = dy[i] * w(c) * uhat * dsilu(i);
        } else {
          r.dx[i] = du * silu(i);
          r.dz[i] = du * x[i] * dsilu(i);
        }
      }
    }
  }
  return r;
}

GatedOut run_gated(tpnorm::Communicator& comm, const GatedSetup& st, const std::vector<float>& x,
                   const std::vector<float>& z, const std::vector<float>& weight,
                   const std::vector<float>& dy) {
  using namespace tpnorm;
  const int64_t hidden = st.gg.hidden >= 0 ? st.gg.hidden : st.c_local;
  const int64_t gs = st.gg.group_size >= 0 ? st.gg.group_size : hidden;
  const int64_t groups = gs > 0 ? hidden / gs : 0;
  const size_t ne = x.size();
  Buffer xb(st.dt, x), zb(st.dt, z), wb(st.param, weight), y(st.dt, ne),
      rstd(st.saved, st.rows * groups);
  const Shape sh{st.rows, st.c_local}, p{st.c_local}, r{st.rows, groups};
  const TensorView zv = st.gated ? zb.view(sh) : TensorView{};
  const TensorView wv = st.weighted ? wb.view(p) : TensorView{};
  rms_norm_gated_forward(comm, xb.view(sh), zv, st.gg, wv, y.view(sh), rstd.view(r), st.opt);
  GatedOut o{y.floats(), rstd.floats(), {}, {}, {}};
  if (!st.backward) return o;
  Buffer dyb(st.dt, dy), dx(st.dt, ne), dz(st.dt, ne), dw(st.param, st.c_local);
  rms_norm_gated_backward(comm, dyb.view(sh), xb.view(sh), zv, st.gg, wv, rstd.view(r), dx.view(sh),
                          st.gated ? dz.view(sh) : TensorView{},
                          st.weighted ? dw.view(p) : TensorView{}, st.opt);
  o.dx = dx.floats();
  if (st.gated) o.dz = dz.floats();
  if (st.weighted) o.dweight = dw.floats();
  return o;
}

}  // namespace tpnorm_test
