// fused_reference.cpp — see fused_reference.h.
#include "fused_reference.h"

#include "storage.h"
#include "tpnorm/fused.h"

namespace tpnorm_test {

FusedRef fused_reference(bool centered, tpnorm::DType dt, const std::vector<float>& x,
                         const std::vector<float>& f, double alpha, int64_t rows, int64_t h,
                         const std::vector<float>& gamma, const std::vector<float>& beta,
                         double eps, const std::vector<float>& dy,
                         const std::vector<float>& dh_extra) {
  FusedRef r;
  std::vector<float> hf(x.size());
  for (size_t i = 0; i < x.size(); ++i) hf[i] = static_cast<float>(alpha * x[i] + f[i]);
  r.h = Buffer(dt, hf).floats();
  r.norm = row_norm_reference(centered, r.h, rows, h, gamma, beta, eps, dy);
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

FusedOut run_fused(tpnorm::Communicator& comm, bool centered, tpnorm::DType dt,
                   tpnorm::DType saved, const std::vector<float>& x, const std::vector<float>& f,
                   double alpha, int64_t rows, int64_t h, const std::vector<float>& gamma,
                   const std::vector<float>& beta, const std::vector<float>& dy,
                   const std::vector<float>& dh_extra, bool in_place,
                   const tpnorm::NormOptions& opt) {
  using namespace tpnorm;
  Buffer xb(dt, x), fb(dt, f), hb(dt, x.size()), yb(dt, x.size()), g(dt, gamma), b(dt, beta);
  Buffer mean(saved, rows), rstd(saved, rows);
  const Shape s{rows, h}, p{h}, r{rows};
  const TensorView gv = gamma.empty() ? TensorView{} : g.view(p);
  const TensorView bv = beta.empty() ? TensorView{} : b.view(p);
  Buffer& hout = in_place ? xb : hb;
  if (centered)
    fused_add_layer_norm_forward(comm, xb.view(s), fb.view(s), alpha, gv, bv, hout.view(s),
                                 yb.view(s), mean.view(r), rstd.view(r), opt);
  else
    fused_add_rms_norm_forward(comm, xb.view(s), fb.view(s), alpha, gv, hout.view(s), yb.view(s),
                               rstd.view(r), opt);
  FusedOut o{hout.floats(), yb.floats(), mean.floats(), rstd.floats(), {}, {}, {}, {}};
  if (dy.empty()) return o;
  Buffer dyb(dt, dy), ex(dt, dh_extra), dx(dt, x.size()), df(dt, x.size()), dg(dt, h), db(dt, h);
  const TensorView exv = dh_extra.empty() ? TensorView{} : ex.view(s);
  if (centered)
    fused_add_layer_norm_backward(comm, dyb.view(s), exv, hout.view(s), gv, mean.view(r),
                                  rstd.view(r), alpha, dx.view(s), df.view(s), dg.view(p),
                                  db.view(p), opt);
  else
    fused_add_rms_norm_backward(comm, dyb.view(s), exv, hout.view(s), gv, rstd.view(r), alpha,
                                dx.view(s), df.view(s), dg.view(p), opt);
  o.dx = dx.floats();
  o.df = df.floats();
  o.dgamma = dg.floats();
  o.dbeta = db.floats();
  return o;
}

}  // namespace tpnorm_test
