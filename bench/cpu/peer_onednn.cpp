// peer_onednn.cpp — the peers table's oneDNN column (compiled when CMake finds oneDNN): the
// layer_normalization primitive (forward training with mean and variance outputs, backward with
// diff scale and shift) for LayerNorm, and the batch_normalization primitive (forward training,
// backward with use_scale | use_shift) for SyncBatchNorm in nchw and nhwc, on tpnorm's problems
// (peers.h). oneDNN 2.x has no RMS normalization (its layer normalization has no RMS flag), so the
// RMSNorm rows have no oneDNN cell.
//
// Primitives, their user-mode scratchpads and every output are made before the timed loop, at
// the benchmark's thread count (oneDNN's OpenMP runtime sizes its work by omp_get_max_threads()
// when a primitive is made and run). Before it is timed, each primitive's output is checked
// against tpnorm's on the same inputs, every value (peers.h: compare). The backward takes
// tpnorm's forward statistics (oneDNN's variance = 1 / rstd^2 - eps).
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <memory>
#include <set>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <unordered_map>

#include "peers.h"

namespace {

using namespace tpnorm_perf;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

struct Onednn {
  Problem p;
  PeerInputs in;
  PeerResult ref;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  Floats out, dgamma, dbeta, mean, var, scratch;
  dnnl::primitive prim;
  std::unordered_map<int, memory> args;
  int threads = 0;

  bool checking;

  // checking: compute tpnorm's result to check against (else the backward's statistics are
  // those of x's distribution, which the timing does not depend on).
  Onednn(const Problem& pr, bool check)
      : p(pr), in(pr), ref(check ? tpnorm_result(pr, in) : PeerResult{}), checking(check) {
    const int64_t stats = p.op == "SyncBN" ? p.channels() : p.rows();
    out.resize(p.numel());
    mean.resize(stats);
    var.resize(stats);
    dgamma.resize(in.gamma.size());
    dbeta.resize(in.gamma.size());
    if (p.backward() && !checking) {
      std::fill(mean.begin(), mean.end(), 3.5f);
      std::fill(var.begin(), var.end(), 0.087f);
    } else if (p.backward()) {  // tpnorm's forward statistics as oneDNN's inputs
      const Floats& m = ref.get("mean");
      const Floats& r = ref.get(p.op == "SyncBN" ? "invstd" : "rstd");
      for (int64_t i = 0; i < stats; ++i) {
        mean[i] = m[i];
        var[i] = static_cast<float>(1.0 / (static_cast<double>(r[i]) * r[i]) - kPeerEps);
      }
    }
  }

  memory mem(const memory::desc& d, const float* p) {
    return memory(d, eng, const_cast<float*>(p));
  }

  // Makes the primitive at `t` threads, runs it once and checks it.
  // Returns "" or how the output differs from tpnorm's.
  std::string make(int t) {
    omp_set_num_threads(t);
    threads = t;
    const bool bn = p.op == "SyncBN";
    const memory::desc data =
        bn ? memory::desc({p.dims[0], p.channels(), p.layout == "NCHW" ? p.dims[2] : p.dims[1],
                           p.layout == "NCHW" ? p.dims[3] : p.dims[2]},
                          memory::data_type::f32, p.layout == "NCHW" ? tag::nchw : tag::nhwc)
           : memory::desc({p.rows(), p.h()}, memory::data_type::f32, tag::ab);
    const memory::desc stat({static_cast<int64_t>(mean.size())}, memory::data_type::f32, tag::a);
    const memory::desc param({static_cast<int64_t>(in.gamma.size())}, memory::data_type::f32,
                             tag::a);
    const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    memory::desc scratch_desc;
    args = {{DNNL_ARG_SRC, mem(data, in.x.data())},
            {DNNL_ARG_MEAN, mem(stat, mean.data())},
            {DNNL_ARG_VARIANCE, mem(stat, var.data())},
            {DNNL_ARG_SCALE, mem(param, in.gamma.data())},
            {DNNL_ARG_SHIFT, mem(param, in.beta.data())}};
    const auto fwd_kind = dnnl::prop_kind::forward_training;
    if (bn) {
      const dnnl::batch_normalization_forward::primitive_desc fwd(
          {fwd_kind, data, static_cast<float>(kPeerEps), flags}, attr, eng);
      if (!p.backward()) {
        prim = dnnl::batch_normalization_forward(fwd);
        scratch_desc = fwd.scratchpad_desc();
        args[DNNL_ARG_DST] = mem(data, out.data());
      } else {
        const dnnl::batch_normalization_backward::primitive_desc bwd(
            {dnnl::prop_kind::backward, data, data, static_cast<float>(kPeerEps), flags}, attr,
            eng, fwd);
        prim = dnnl::batch_normalization_backward(bwd);
        scratch_desc = bwd.scratchpad_desc();
      }
    } else {
      const dnnl::layer_normalization_forward::primitive_desc fwd(
          {fwd_kind, data, stat, static_cast<float>(kPeerEps), flags}, attr, eng);
      if (!p.backward()) {
        prim = dnnl::layer_normalization_forward(fwd);
        scratch_desc = fwd.scratchpad_desc();
        args[DNNL_ARG_DST] = mem(data, out.data());
      } else {
        const dnnl::layer_normalization_backward::primitive_desc bwd(
            {dnnl::prop_kind::backward, data, data, stat, static_cast<float>(kPeerEps), flags},
            attr, eng, fwd);
        prim = dnnl::layer_normalization_backward(bwd);
        scratch_desc = bwd.scratchpad_desc();
      }
    }
    if (p.backward()) {
      args[DNNL_ARG_DIFF_DST] = mem(data, in.dy.data());
      args[DNNL_ARG_DIFF_SRC] = mem(data, out.data());
      args[DNNL_ARG_DIFF_SCALE] = mem(param, dgamma.data());
      args[DNNL_ARG_DIFF_SHIFT] = mem(param, dbeta.data());
    }
    scratch.assign(scratch_desc.get_size() / sizeof(float) + 1, 0.0f);
    args[DNNL_ARG_SCRATCHPAD] = memory(scratch_desc, eng, scratch.data());
    run();
    return checking ? check() : "";
  }

  void run() {
    prim.execute(strm, args);
    strm.wait();
  }

  std::string check() {
    std::string err;
    auto add = [&](const std::string& e) {
      if (!e.empty()) err += (err.empty() ? "" : "; ") + e;
    };
    if (!p.backward()) {
      add(compare("y", out.data(), ref.get("y")));
      add(compare("mean", mean.data(), ref.get("mean")));
      const Floats& r = ref.get(p.op == "SyncBN" ? "invstd" : "rstd");
      Floats rs(var.size());
      for (size_t i = 0; i < var.size(); ++i)
        rs[i] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var[i]) + kPeerEps));
      add(compare(p.op == "SyncBN" ? "invstd" : "rstd", rs.data(), r));
    } else {
      add(compare("dx", out.data(), ref.get("dx")));
      add(compare("dgamma", dgamma.data(), ref.get("dgamma")));
      add(compare("dbeta", dbeta.data(), ref.get("dbeta")));
    }
    return err.empty() ? "" : "oneDNN's output differs from tpnorm's: " + err;
  }
};

void register_all() {
  const dnnl_version_t* v = dnnl_version();
  add_peer_info("oneDNN", std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                              std::to_string(v->patch) +
                              (v->cpu_runtime == DNNL_RUNTIME_OMP ? " (OpenMP runtime)" : ""));
  for (const Problem& p : peer_problems()) {
    if (p.op == "RMSNorm") continue;  // no RMS normalization in oneDNN 2.x
    // Checked at the first make at each thread count; later makes (repetitions) only time.
    auto checked = std::make_shared<std::set<int>>();
    add_peer("oneDNN", p, [p, checked](int t) -> PeerCall {
      auto o = std::make_shared<Onednn>(p, checked->insert(t).second);
      std::string mismatch = o->make(t);
      return {[o](int t) {
                omp_set_num_threads(t);
                o->run();
              },
              mismatch};
    });
  }
}
const bool registered = on_load(register_all);

}  // namespace
