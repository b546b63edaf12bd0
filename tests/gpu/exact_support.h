// exact_support.h — what the GPU tests of Stats::kExact share: named tensors run once on the
// GPU and once on a host communicator (or the GPU at another world size), and an element-wise
// BITWISE comparison of every output (NaN equals NaN: the GPU's NaN bits are canonical, the
// CPU's carry the input's payload; every other value must have the same bits).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_support.h"
#include "storage.h"
#include "tpnorm/communicator.h"

namespace tpnorm_gpu {

using tpnorm_test::Buffer;

/// Host inputs and zeroed outputs of one test, by name; `outputs` are compared.
struct Tensors {
  std::map<std::string, Buffer> host;
  std::vector<std::string> outputs;
  void in(const std::string& name, tpnorm::DType t, const std::vector<float>& v) {
    host[name] = Buffer(t, v);
  }
  void out(const std::string& name, tpnorm::DType t, size_t n) {
    host[name] = Buffer(t, n);
    outputs.push_back(name);
  }
};

/// Makes the view of a named tensor with a shape (an empty name: an absent view).
using ViewOf = std::function<tpnorm::TensorView(const std::string&, tpnorm::Shape)>;

/// Runs call(view) on comm: over device copies of every tensor (device >= 0; misalign shifts
/// them by one element) or over host copies (device < 0). Returns the outputs after the call.
inline std::map<std::string, Buffer> run_tensors(tpnorm::Communicator& comm, const Tensors& t,
                                                 int device,
                                                 const std::function<void(const ViewOf&)>& call,
                                                 bool misalign = false) {
  std::map<std::string, Buffer> host = t.host;
  std::map<std::string, DevBuf> dev;
  if (device >= 0)
    for (auto& [name, b] : host) dev.emplace(name, DevBuf(b, misalign, device));
  const ViewOf view = [&](const std::string& name, tpnorm::Shape s) -> tpnorm::TensorView {
    if (name.empty()) return {};
    if (device >= 0) return dev.at(name).view(s);
    return host.at(name).view(s);
  };
  call(view);
  std::map<std::string, Buffer> out;
  if (device >= 0) cudaStreamSynchronize(static_cast<cudaStream_t>(comm.stream()));
  for (const std::string& name : t.outputs)
    out[name] = device >= 0 ? dev.at(name).download() : host.at(name);
  return out;
}

/// Element i of b as its bits (widened) and whether it is a NaN.
inline uint64_t element_bits(Buffer& b, size_t i, bool* nan) {
  const size_t es = tpnorm::dtype_size(b.dtype());
  const auto* p = static_cast<const unsigned char*>(b.view(tpnorm::Shape{int64_t(b.size())}).data);
  uint64_t u = 0;
  std::memcpy(&u, p + i * es, es);
  if (b.dtype() == tpnorm::DType::F64) {
    double d;
    std::memcpy(&d, &u, 8);
    *nan = std::isnan(d);
  } else {
    *nan = std::isnan(b.get(i));
  }
  return u;
}

/// Elements whose bits differ between got and want, over every output; *first describes the
/// first one.
inline int64_t count_bit_differences(std::map<std::string, Buffer> got,
                                     std::map<std::string, Buffer> want, std::string* first) {
  int64_t diff = 0;
  for (auto& [name, g] : got) {
    Buffer& w = want.at(name);
    if (g.size() != w.size() || g.dtype() != w.dtype()) {
      if (first->empty()) *first = name + ": sizes or dtypes differ";
      ++diff;
      continue;
    }
    for (size_t i = 0; i < g.size(); ++i) {
      bool gn = false, wn = false;
      const uint64_t gb = element_bits(g, i, &gn), wb = element_bits(w, i, &wn);
      if (gn && wn) continue;
      if (gb == wb) continue;
      if (first->empty()) {
        std::ostringstream os;
        os.precision(17);
        os << name << "[" << i << "]: " << g.get(i) << " (bits " << std::hex << gb << "), want "
           << std::dec << w.get(i) << " (bits " << std::hex << wb << ")";
        *first = os.str();
      }
      ++diff;
    }
  }
  return diff;
}

}  // namespace tpnorm_gpu
