// tensor_args.cpp — DLPack capsules to tpnorm::TensorView (see tensor_args.h).
#include "tensor_args.h"

#include "ops/caller_failure.h"

namespace py = pybind11;

namespace tpnorm::python {
namespace {

constexpr const char* kCapsule = "dltensor";
constexpr const char* kUsedCapsule = "used_dltensor";

// "float32"-style names for the error text.
std::string dl_type_name(const DLDataType& t) {
  const char* kind = t.code == kDLFloat    ? "float"
                     : t.code == kDLBfloat ? "bfloat"
                     : t.code == kDLInt    ? "int"
                     : t.code == kDLUInt   ? "uint"
                                           : "code?";
  std::string s = kind + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

bool to_dtype(const DLDataType& t, DType* out) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 32)
    *out = DType::F32;
  else if (t.code == kDLFloat && t.bits == 16)
    *out = DType::F16;
  else if (t.code == kDLFloat && t.bits == 64)
    *out = DType::F64;
  else if (t.code == kDLBfloat && t.bits == 16)
    *out = DType::BF16;
  else
    return false;
  return true;
}

std::string shape_text(const DLTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// Row-major and dense: every dim longer than 1 has the stride of the dims after it (size-1
// dims may carry any stride, as torch reports for them; an empty tensor has no layout).
bool row_major(const DLTensor& t) {
  if (!t.strides) return true;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return true;
  int64_t want = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != want) return false;
    want *= t.shape[i];
  }
  return true;
}

}  // namespace

std::string error_text(const py::error_already_set& e) {
  return py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
         py::str(e.value()).cast<std::string>();
}

TensorArgs::~TensorArgs() {
  for (DLManagedTensor* m : owned_)
    if (m->deleter) m->deleter(m);
}

void TensorArgs::fail(const char* name, const std::string& what) {
  if (failure_.empty()) failure_ = std::string("argument '") + name + "' " + what;
}

DLManagedTensor* TensorArgs::import(py::handle obj, const char* name) {
  py::object capsule;
  try {
    if (PyCapsule_CheckExact(obj.ptr())) {
      capsule = py::reinterpret_borrow<py::object>(obj);
    } else if (py::hasattr(obj, "__dlpack__")) {
      capsule = obj.attr("__dlpack__")();
    } else {
      fail(name, std::string("must be a tensor with __dlpack__, got ") +
                     py::str(obj.get_type().attr("__name__")).cast<std::string>());
      return nullptr;
    }
  } catch (py::error_already_set& e) {
    fail(name, std::string("could not be exported through DLPack: ") + error_text(e));
    return nullptr;
  }
  if (!PyCapsule_IsValid(capsule.ptr(), kCapsule)) {
    fail(name, "is not an unused DLPack capsule");
    return nullptr;
  }
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), kCapsule));
  // Ownership moves here: the capsule's destructor must no longer free it.
  PyCapsule_SetName(capsule.ptr(), kUsedCapsule);
  owned_.push_back(m);
  return m;
}

TensorView TensorArgs::add(py::handle obj, const char* name) {
  if (obj.is_none()) return {};
  DLManagedTensor* m = import(obj, name);
  if (!m) return {};
  return add(m->dl_tensor, name);
}

TensorView TensorArgs::add(const DLTensor& t, const char* name) {
  TensorView v;
  if (t.ndim < 1 || t.ndim > Shape::kMaxDims) {
    fail(name, "has " + std::to_string(t.ndim) + " dimensions; tpnorm takes 1 to " +
                   std::to_string(Shape::kMaxDims));
    return {};
  }
  v.shape.ndim = t.ndim;
  for (int i = 0; i < t.ndim; ++i) v.shape.dims[i] = t.shape[i];
  bool ok = true;
  if (!to_dtype(t.dtype, &v.dtype)) {
    fail(name, "has dtype " + dl_type_name(t.dtype) +
                   "; tpnorm takes float32, float16, bfloat16 (and float64 where the op says)");
    ok = false;
  }
  if (t.device.device_type == kDLCPU) {
    v.device = Device::cpu();
  } else if (t.device.device_type == kDLCUDA) {
    v.device = Device::cuda(t.device.device_id);
  } else {
    fail(name, "lives on DLPack device type " + std::to_string(t.device.device_type) +
                   "; tpnorm takes CPU or CUDA memory");
    ok = false;
  }
  if (!row_major(t)) {
    fail(name, "is not contiguous (shape " + shape_text(t) +
                   "): pass a row-major dense tensor, e.g. x.contiguous()");
    ok = false;
  }
  // A rejected tensor keeps its shape (collective sizes stay equal on every rank) but no data.
  v.data = ok ? static_cast<char*>(t.data) + t.byte_offset : nullptr;
  return v;
}

namespace {
thread_local std::string t_pending;
}  // namespace

void set_pending_failure(const std::string& message) { t_pending = message; }

void TensorArgs::run(const std::function<void()>& op) {
  std::string pending;
  pending.swap(t_pending);
  detail::set_caller_failure(pending.empty() ? failure_ : pending);
  try {
    py::gil_scoped_release nogil;
    op();
  } catch (...) {
    detail::set_caller_failure("");  // never leak into a later call
    throw;
  }
  detail::set_caller_failure("");
}

}  // namespace tpnorm::python
