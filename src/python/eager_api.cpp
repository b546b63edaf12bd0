// eager_api.cpp — _tpnorm's side of eager_api.h: the table's calls and its capsule.
#include "eager_api.h"

#include <pybind11/pybind11.h>

#include "dlpack.h"
#include "tensor_args.h"
#include "tpnorm/norm.h"

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

const eager::Api kApi{eager::kVersion, &row_norm_forward, &row_norm_backward};

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
