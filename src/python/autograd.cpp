// autograd.cpp — tpnorm._autograd: LayerNorm and RMSNorm as C++ autograd functions, the eager
// path of tpnorm's row norms on plain torch tensors. Built against the torch that will import
// it (one build per interpreter; src/python/CMakeLists.txt), it calls the ops of tpnorm._tpnorm
// through eager_api.h's table.
//
// Why C++: at a small shape the op is a microsecond, and a Python torch.autograd.Function
// costs many of them (its Python forward and backward, the DLPack capsule per tensor, the
// allocations from Python). Here forward allocates with ATen, the backward node runs without
// Python, and only a failure touches the interpreter. The Python Function in
// tpnorm/functional.py is the fallback where this module was not built.
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "eager_api.h"

namespace {

namespace eager = tpnorm::python::eager;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const eager::Api* api = nullptr;

// at::Tensor -> the table's description (no copy; the tensor outlives the call). A dtype or
// device tpnorm does not take is described as such, so the op's checks name it.
eager::Tensor describe(const at::Tensor& a) {
  eager::Tensor t{};
  t.data = a.data_ptr();
  t.shape = a.sizes().data();
  t.strides = a.strides().data();
  t.ndim = static_cast<int32_t>(a.dim());
  t.device_type = a.is_cuda() ? 2 : a.is_cpu() ? 1 : -1;
  t.device_id = a.is_cuda() ? a.get_device() : 0;
  switch (a.scalar_type()) {
    case at::kFloat: t.dtype_code = 2; t.dtype_bits = 32; break;
    case at::kDouble: t.dtype_code = 2; t.dtype_bits = 64; break;
    case at::kHalf: t.dtype_code = 2; t.dtype_bits = 16; break;
    case at::kBFloat16: t.dtype_code = 4; t.dtype_bits = 16; break;
    default: t.dtype_code = 0; t.dtype_bits = static_cast<uint8_t>(a.element_size() * 8);
  }
  return t;
}

// Described tensors of one call: a pointer per argument, null for an absent (undefined) one.
struct Args {
  eager::Tensor slot[9];
  int n = 0;
  const eager::Tensor* operator()(const at::Tensor& a) {
    if (!a.defined()) return nullptr;
    slot[n] = describe(a);
    return &slot[n++];
  }
};

at::Tensor row_stats(const at::Tensor& x, int64_t rows) {
  return at::empty({rows}, x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble
                                                                            : at::kFloat));
}

int64_t rows_of(const at::Tensor& x) {
  if (x.dim() == 0) return 0;
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  return rows;
}

void* comm_of(int64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }

struct RowNorm : public torch::autograd::Function<RowNorm> {
  // Absent parameters are empty optionals, not undefined tensors: autograd records every
  // tensor argument as an input (its device, dtype, shape), which an undefined tensor lacks.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt, int64_t comm, int64_t opt,
                            bool centered) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t rows = rows_of(x);
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    at::Tensor rstd = row_stats(x, rows);
    at::Tensor mean = centered ? row_stats(x, rows) : at::Tensor();
    Args d;
    auto *X = d(x), *W = d(weight), *B = d(bias), *Y = d(y), *M = d(mean), *R = d(rstd);
    // The GIL is held (a pybind11 call); the table releases it while the op runs.
    if (!api->row_norm_forward(comm_of(comm), comm_of(opt), centered, X, W, B, Y, M, R))
      throw pybind11::error_already_set();
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["opt"] = opt;
    ctx->saved_data["centered"] = centered;
    // dbias in bias's dtype (mixed precision keeps it float32 next to a bf16 x); -1: no bias.
    ctx->saved_data["bias_dtype"] =
        bias.defined() ? static_cast<int64_t>(bias.scalar_type()) : int64_t{-1};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const bool centered = ctx->saved_data["centered"].toBool();
    const int64_t bias_dtype = ctx->saved_data["bias_dtype"].toInt();
    at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(x);
    at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    at::Tensor dw = weight.defined() ? at::empty_like(weight, at::MemoryFormat::Contiguous)
                                     : at::Tensor();
    at::Tensor db = bias_dtype >= 0
                        ? at::empty({x.size(-1)},
                                    x.options().dtype(static_cast<at::ScalarType>(bias_dtype)))
                        : at::Tensor();
    Args d;
    auto *DY = d(dy), *X = d(x), *W = d(weight), *M = d(mean), *R = d(rstd);
    auto *DX = d(dx), *DW = d(dw), *DB = d(db);
    {
      // The autograd engine runs this node without the GIL: take it for the table's call (it
      // is released again while the op runs) and to hand a failure to Python unchanged.
      pybind11::gil_scoped_acquire gil;
      if (!api->row_norm_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                  comm_of(ctx->saved_data["opt"].toInt()), centered, DY, X, W, M,
                                  R, DX, DW, DB)) {
        python_error e;
        e.persist();
        throw e;
      }
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor row_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                    const c10::optional<at::Tensor>& bias, int64_t comm, int64_t opt,
                    bool centered) {
  return RowNorm::apply(x, weight, bias, comm, opt, centered);
}

}  // namespace

PYBIND11_MODULE(_autograd, m) {
  m.doc() = "tpnorm's row norms as C++ autograd functions (used by the tpnorm package)";
  auto table = pybind11::module_::import("tpnorm._tpnorm").attr("eager_api");
  api = static_cast<const eager::Api*>(PyCapsule_GetPointer(table.ptr(), eager::kCapsuleName));
  if (!api) throw pybind11::error_already_set();
  if (api->version != eager::kVersion)
    throw std::runtime_error("tpnorm._autograd: tpnorm._tpnorm's eager_api has version " +
                             std::to_string(api->version) + ", this module needs " +
                             std::to_string(eager::kVersion));
  m.attr("TORCH_VERSION") = TORCH_VERSION;
  m.def("row_norm", &row_norm, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias"), pybind11::arg("comm"), pybind11::arg("opt"),
        pybind11::arg("centered"),
        "y of LayerNorm (centered) or RMSNorm over hidden-sharded rows; comm and opt are "
        "tpnorm._tpnorm.address_of(Communicator / NormOptions) of objects kept alive");
}
