// eager_api.cpp — _tpnorm's side of eager_api.h: the table's calls and its capsule.
#include "eager_api.h"

#include <pybind11/pybind11.h>

#include <vector>

#include "dlpack.h"
#include "tensor_args.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/batched.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/norm.h"
#include "tpnorm/rms_norm_gated.h"

namespace py = pybind11;

namespace tpnorm::python {
namespace {

// The description as the DLTensor that TensorArgs checks (shape and strides are only read).
TensorView view(TensorArgs& a, const eager::Tensor* t, const char* name) {
  if (!t) return {};
  DLTensor d{};
  d.data = t->data;
  d.device = {static_cast<DLDeviceType>(t->device_type), t->device_id};
  d.ndim = t->ndim;
  d.dtype = {t->dtype_code, t->dtype_bits, 1};
  d.shape = const_cast<int64_t*>(t->shape);
  d.strides = const_cast<int64_t*>(t->strides);
  d.byte_offset = 0;
  return a.add(d, name);
}

// Runs op(args), returning false with the Python error set as the binding's translator sets it.
template <class F>
bool guarded(F&& op) {
  try {
    op();
    return true;
  } catch (...) {
    set_python_error(std::current_exception());
    return false;
  }
}

bool row_norm_forward(void* comm, const void* opt, bool centered, const eager::Tensor* x,
                      const eager::Tensor* gamma, const eager::Tensor* beta,
                      const eager::Tensor* y, const eager::Tensor* mean,
                      const eager::Tensor* rstd) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    auto X = view(a, x, "x"), G = view(a, gamma, "gamma"), Y = view(a, y, "y");
    auto R = view(a, rstd, "rstd");
    if (centered) {
      auto B = view(a, beta, "beta"), M = view(a, mean, "mean");
      a.run([&] { layer_norm_forward(c, X, G, B, Y, M, R, o); });
    } else {
      a.run([&] { rms_norm_forward(c, X, G, Y, R, o); });
    }
  });
}

bool row_norm_backward(void* comm, const void* opt, bool centered, const eager::Tensor* dy,
                       const eager::Tensor* x, const eager::Tensor* gamma,
                       const eager::Tensor* mean, const eager::Tensor* rstd,
                       const eager::Tensor* dx, const eager::Tensor* dgamma,
                       const eager::Tensor* dbeta) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    auto DY = view(a, dy, "dy"), X = view(a, x, "x"), G = view(a, gamma, "gamma");
    auto R = view(a, rstd, "rstd"), DX = view(a, dx, "dx"), DG = view(a, dgamma, "dgamma");
    if (centered) {
      auto M = view(a, mean, "mean"), DB = view(a, dbeta, "dbeta");
      a.run([&] { layer_norm_backward(c, DY, X, G, M, R, DX, DG, DB, o); });
    } else {
      a.run([&] { rms_norm_backward(c, DY, X, G, R, DX, DG, o); });
    }
  });
}

bool fused_forward(void* comm, const void* opt, bool centered, double alpha,
                   const eager::Tensor* x, const eager::Tensor* f, const eager::Tensor* gamma,
                   const eager::Tensor* beta, const eager::Tensor* h, const eager::Tensor* y,
                   const eager::Tensor* mean, const eager::Tensor* rstd) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    auto X = view(a, x, "x"), F = view(a, f, "f"), G = view(a, gamma, "gamma");
    auto H = view(a, h, "h"), Y = view(a, y, "y"), R = view(a, rstd, "rstd");
    if (centered) {
      auto B = view(a, beta, "beta"), M = view(a, mean, "mean");
      a.run([&] { fused_add_layer_norm_forward(c, X, F, alpha, G, B, H, Y, M, R, o); });
    } else {
      a.run([&] { fused_add_rms_norm_forward(c, X, F, alpha, G, H, Y, R, o); });
    }
  });
}

bool fused_backward(void* comm, const void* opt, bool centered, double alpha,
                    const eager::Tensor* dy, const eager::Tensor* dh_extra,
                    const eager::Tensor* h, const eager::Tensor* gamma,
                    const eager::Tensor* mean, const eager::Tensor* rstd,
                    const eager::Tensor* dx, const eager::Tensor* df,
                    const eager::Tensor* dgamma, const eager::Tensor* dbeta) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    auto DY = view(a, dy, "dy"), DE = view(a, dh_extra, "dh_extra"), H = view(a, h, "h");
    auto G = view(a, gamma, "gamma"), R = view(a, rstd, "rstd"), DX = view(a, dx, "dx");
    auto DF = view(a, df, "df"), DG = view(a, dgamma, "dgamma");
    if (centered) {
      auto M = view(a, mean, "mean"), DB = view(a, dbeta, "dbeta");
      a.run([&] {
        fused_add_layer_norm_backward(c, DY, DE, H, G, M, R, alpha, DX, DF, DG, DB, o);
      });
    } else {
      a.run([&] { fused_add_rms_norm_backward(c, DY, DE, H, G, R, alpha, DX, DF, DG, o); });
    }
  });
}

bool group_forward(void* comm, const void* opt, int64_t groups, int64_t channels, int64_t offset,
                   bool instance, const eager::Tensor* x, const eager::Tensor* gamma,
                   const eager::Tensor* beta, const eager::Tensor* y, const eager::Tensor* mean,
                   const eager::Tensor* rstd) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    const ChannelGroups cg{groups, channels, offset};
    TensorArgs a;
    auto X = view(a, x, "x"), G = view(a, gamma, "gamma"), B = view(a, beta, "beta");
    auto Y = view(a, y, "y"), M = view(a, mean, "mean"), R = view(a, rstd, "rstd");
    a.run([&] {
      (instance ? instance_norm_forward : group_norm_forward)(c, X, cg, G, B, Y, M, R, o);
    });
  });
}

bool group_backward(void* comm, const void* opt, int64_t groups, int64_t channels, int64_t offset,
                    bool instance, const eager::Tensor* dy, const eager::Tensor* x,
                    const eager::Tensor* gamma, const eager::Tensor* mean,
                    const eager::Tensor* rstd, const eager::Tensor* dx,
                    const eager::Tensor* dgamma, const eager::Tensor* dbeta) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    const ChannelGroups cg{groups, channels, offset};
    TensorArgs a;
    auto DY = view(a, dy, "dy"), X = view(a, x, "x"), G = view(a, gamma, "gamma");
    auto M = view(a, mean, "mean"), R = view(a, rstd, "rstd"), DX = view(a, dx, "dx");
    auto DG = view(a, dgamma, "dgamma"), DB = view(a, dbeta, "dbeta");
    a.run([&] {
      (instance ? instance_norm_backward : group_norm_backward)(c, DY, X, cg, G, M, R, DX, DG,
                                                                DB, o);
    });
  });
}

bool gated_forward(void* comm, const void* opt, int64_t group_size, int64_t hidden,
                   int64_t offset, bool norm_before_gate, const eager::Tensor* x,
                   const eager::Tensor* z, const eager::Tensor* weight, const eager::Tensor* y,
                   const eager::Tensor* rstd) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    const GatedGroups gg{group_size, hidden, offset, norm_before_gate};
    TensorArgs a;
    auto X = view(a, x, "x"), Z = view(a, z, "z"), W = view(a, weight, "weight");
    auto Y = view(a, y, "y"), R = view(a, rstd, "rstd");
    a.run([&] { rms_norm_gated_forward(c, X, Z, gg, W, Y, R, o); });
  });
}

bool gated_backward(void* comm, const void* opt, int64_t group_size, int64_t hidden,
                    int64_t offset, bool norm_before_gate, const eager::Tensor* dy,
                    const eager::Tensor* x, const eager::Tensor* z, const eager::Tensor* weight,
                    const eager::Tensor* rstd, const eager::Tensor* dx, const eager::Tensor* dz,
                    const eager::Tensor* dweight) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    const GatedGroups gg{group_size, hidden, offset, norm_before_gate};
    TensorArgs a;
    auto DY = view(a, dy, "dy"), X = view(a, x, "x"), Z = view(a, z, "z");
    auto W = view(a, weight, "weight"), R = view(a, rstd, "rstd"), DX = view(a, dx, "dx");
    auto DZ = view(a, dz, "dz"), DW = view(a, dweight, "dweight");
    a.run([&] { rms_norm_gated_backward(c, DY, X, Z, gg, W, R, DX, DZ, DW, o); });
  });
}

BatchNormOptions bn_options(double eps, double momentum, bool training, bool channels_last,
                            int stats) {
  BatchNormOptions o;
  o.eps = eps;
  o.momentum = momentum;
  o.training = training;
  o.layout = channels_last ? Layout::kChannelsLast : Layout::kNCHW;
  o.stats = static_cast<Stats>(stats);
  return o;
}

bool batch_norm_forward(void* comm, double eps, double momentum, bool training,
                        bool channels_last, int stats, const eager::Tensor* x,
                        const eager::Tensor* gamma, const eager::Tensor* beta,
                        const eager::Tensor* running_mean, const eager::Tensor* running_var,
                        const eager::Tensor* y, const eager::Tensor* save_mean,
                        const eager::Tensor* save_invstd) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const BatchNormOptions o = bn_options(eps, momentum, training, channels_last, stats);
    TensorArgs a;
    auto X = view(a, x, "x"), G = view(a, gamma, "gamma"), B = view(a, beta, "beta");
    auto RM = view(a, running_mean, "running_mean"), RV = view(a, running_var, "running_var");
    auto Y = view(a, y, "y"), SM = view(a, save_mean, "save_mean");
    auto SI = view(a, save_invstd, "save_invstd");
    a.run([&] { sync_batch_norm_forward(c, X, G, B, RM, RV, nullptr, Y, SM, SI, o); });
  });
}

bool batch_norm_backward(void* comm, double eps, bool training, bool channels_last, int stats,
                         const eager::Tensor* dy, const eager::Tensor* x,
                         const eager::Tensor* gamma, const eager::Tensor* save_mean,
                         const eager::Tensor* save_invstd, const eager::Tensor* dx,
                         const eager::Tensor* dgamma, const eager::Tensor* dbeta) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const BatchNormOptions o = bn_options(eps, 0.0, training, channels_last, stats);
    TensorArgs a;
    auto DY = view(a, dy, "dy"), X = view(a, x, "x"), G = view(a, gamma, "gamma");
    auto SM = view(a, save_mean, "save_mean"), SI = view(a, save_invstd, "save_invstd");
    auto DX = view(a, dx, "dx"), DG = view(a, dgamma, "dgamma"), DB = view(a, dbeta, "dbeta");
    a.run([&] { sync_batch_norm_backward(c, DY, X, G, SM, SI, DX, DG, DB, o); });
  });
}

bool batched_forward(void* comm, const void* opt, int64_t k, const bool* centered,
                     const int64_t* hidden, const eager::Tensor* const* t) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    std::vector<RowNormItem> v(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
      const eager::Tensor* const* q = t + 6 * i;
      RowNormItem& it = v[static_cast<size_t>(i)];
      it.centered = centered[i];
      it.x = view(a, q[0], "x");
      it.gamma = view(a, q[1], "gamma");
      it.beta = view(a, q[2], "beta");
      it.y = view(a, q[3], "y");
      it.mean = view(a, q[4], "mean");
      it.rstd = view(a, q[5], "rstd");
      it.hidden_size = hidden[i];
    }
    a.run([&] { batched_norm_forward(c, v.data(), v.size(), o); });
  });
}

bool batched_backward(void* comm, const void* opt, int64_t k, const bool* centered,
                      const int64_t* hidden, const eager::Tensor* const* t) {
  return guarded([&] {
    auto& c = *static_cast<Communicator*>(comm);
    const auto& o = *static_cast<const NormOptions*>(opt);
    TensorArgs a;
    std::vector<RowNormGradItem> v(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
      const eager::Tensor* const* q = t + 8 * i;
      RowNormGradItem& it = v[static_cast<size_t>(i)];
      it.centered = centered[i];
      it.dy = view(a, q[0], "dy");
      it.x = view(a, q[1], "x");
      it.gamma = view(a, q[2], "gamma");
      it.mean = view(a, q[3], "mean");
      it.rstd = view(a, q[4], "rstd");
      it.dx = view(a, q[5], "dx");
      it.dgamma = view(a, q[6], "dgamma");
      it.dbeta = view(a, q[7], "dbeta");
      it.hidden_size = hidden[i];
    }
    a.run([&] { batched_norm_backward(c, v.data(), v.size(), o); });
  });
}

const eager::Api kApi{eager::kVersion,    &row_norm_forward,   &row_norm_backward,
                      &fused_forward,     &fused_backward,     &group_forward,
                      &group_backward,    &gated_forward,      &gated_backward,
                      &batch_norm_forward, &batch_norm_backward, &batched_forward,
                      &batched_backward};

}  // namespace

void bind_eager_api(py::module_& m) {
  m.attr("eager_api") = py::capsule(const_cast<eager::Api*>(&kApi), eager::kCapsuleName);
  // The addresses the table's calls take (the Python package keeps the objects alive).
  m.def("address_of", [](const Communicator& c) {
    return reinterpret_cast<uintptr_t>(&c);
  });
  m.def("address_of", [](const NormOptions& o) { return reinterpret_cast<uintptr_t>(&o); });
}

}  // namespace tpnorm::python
