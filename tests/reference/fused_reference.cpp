// fused_reference.cpp — see fused_reference.h.
#include "fused_reference.h"

#include "storage.h"
#include "tpnorm/fused.h"

namespace tpnorm_test {

FusedRef fused_reference(bool centered, const std::vector<float>& x, const std::vector<float>& f,
                         double alpha, const std::vector<float>& h_stored, int64_t rows, int64_t h,
                         const std::vector<float>& gamma, const std::vector<float>& beta,
                         double eps, const std::vector<float>& dy,
                         const std::vector<float>& dh_extra) {
  FusedRef r;
  r.h.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) r.h[i] = alpha * x[i] + f[i];
  r.norm = row_norm_reference(centered, h_stored, rows, h, gamma, beta, eps, dy);
  if (dy.empty()) return r;
  r.dx.resize(x.size());
  r.df.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double dh = r.norm.dx[i] + (dh_extra.empty() ? 0.0 : dh_extra[i]);
    r.df[i] = dh;
    r.dx[i] = alpha * dh;
  }
  return r;
}

FusedOut run_fused(tpnorm::Communicator& comm, const FusedSetup& s, const std::vector<float>& x,
                   const std::vector<float>& f, const std::vector<float>& gamma,
                   const std::vector<float>& beta, const std::vector<float>& dy,
                   const std::vector<float>& dh_extra) {
  using namespace tpnorm;
  const DType dt = s.dt;
  Buffer xb(dt, x), fb(dt, f), hb(dt, x.size()), yb(dt, x.size()), g(dt, gamma), b(dt, beta);
  Buffer mean(s.saved, s.rows), rstd(s.saved, s.rows);
  const Shape rh{s.rows, s.h}, p{s.h}, r{s.rows};
  const TensorView gv = s.affine ? g.view(p) : TensorView{};
  const TensorView bv = s.affine && s.centered ? b.view(p) : TensorView{};
  Buffer& hout = s.in_place ? xb : hb;
  if (s.centered)
    fused_add_layer_norm_forward(comm, xb.view(rh), fb.view(rh), s.alpha, gv, bv, hout.view(rh),
                                 yb.view(rh), mean.view(r), rstd.view(r), s.opt);
  else
    fused_add_rms_norm_forward(comm, xb.view(rh), fb.view(rh), s.alpha, gv, hout.view(rh),
                               yb.view(rh), rstd.view(r), s.opt);
  FusedOut o{hout.floats(), yb.floats(), mean.floats(), rstd.floats(), {}, {}, {}, {}};
  if (!s.backward) return o;
  Buffer dyb(dt, dy), ex(dt, dh_extra), dx(dt, x.size()), df(dt, x.size()), dg(dt, s.h),
      db(dt, s.h);
  const TensorView exv = s.extra ? ex.view(rh) : TensorView{};
  if (s.centered)
    fused_add_layer_norm_backward(comm, dyb.view(rh), exv, hout.view(rh), gv, mean.view(r),
                                  rstd.view(r), s.alpha, dx.view(rh), df.view(rh), dg.view(p),
                                  db.view(p), s.opt);
  else
    fused_add_rms_norm_backward(comm, dyb.view(rh), exv, hout.view(rh), gv, rstd.view(r), s.alpha,
                                dx.view(rh), df.view(rh), dg.view(p), s.opt);
  o.dx = dx.floats();
  o.df = df.floats();
  o.dgamma = dg.floats();
  o.dbeta = db.floats();
  return o;
}

}  // namespace tpnorm_test
