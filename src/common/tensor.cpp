// tensor.cpp — TensorView helpers.
#include "tpnorm/tensor.h"

#include <sstream>

namespace tpnorm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::F64:
    case DType::I64:
      return 8;
    default:
      return 4;
  }
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F16:
      return "fp16";
    case DType::BF16:
      return "bf16";
    case DType::F64:
      return "fp64";
    case DType::I64:
      return "int64";
    default:
      return "fp32";
  }
}

Shape::Shape(std::initializer_list<int64_t> d) {
  for (int64_t v : d) {
    if (ndim == kMaxDims) break;
    dims[ndim++] = v;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < ndim; ++i) s << (i ? ", " : "") << dims[i];
  s << ']';
  return s.str();
}

}  // namespace tpnorm
