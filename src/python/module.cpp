// module.cpp — tpnorm._tpnorm: the framework-neutral binding. Tensors arrive as objects with
// __dlpack__ (tensor_args.h), communicators come from communicators.h, and every function is
// one C++ call of include/tpnorm with the GIL released. The autograd functions, modules and
// process-group plumbing live in the Python package (src/python/tpnorm).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "comm/device_comm.h"
#include "communicators.h"
#include "tensor_args.h"
#include "tpnorm/batch_norm.h"
#ifdef TPNORM_WITH_CUDA
#include "tpnorm/cuda.h"
#endif
#include "tpnorm/batched.h"
#include "tpnorm/error.h"
#include "tpnorm/fused.h"
#include "tpnorm/group_norm.h"
#include "tpnorm/norm.h"
#include "tpnorm/rms_norm_gated.h"

namespace py = pybind11;
using py::arg;
using tpnorm::python::TensorArgs;

namespace tpnorm::python {
namespace {

using Obj = py::object;

// tpnorm.Error: a RuntimeError carrying the tpnorm::ErrorCode as .code. An invalid argument
// (ErrorCode::kInvalidArgument) is raised as its subclass tpnorm.InvalidArgumentError, which is
// also a ValueError: where torch's own layers raise ValueError for a bad input (one value per
// channel in training, say), tpnorm's raise an exception `except ValueError` catches too.
py::exception<Error>* error_type = nullptr;
PyObject* invalid_argument_type = nullptr;

void set_error(const Error& e) {
  PyObject* type =
      e.code() == ErrorCode::kInvalidArgument ? invalid_argument_type : error_type->ptr();
  auto exc = py::reinterpret_steal<py::object>(PyObject_CallFunction(type, "s", e.what()));
  if (!exc) return;  // the call failed and set its own Python error
  exc.attr("code") = static_cast<int>(e.code());
  PyErr_SetObject(type, exc.ptr());
}

void bind_errors(py::module_& m) {
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  error_type = &error;
  py::tuple bases = py::make_tuple(error, py::handle(PyExc_ValueError));
  invalid_argument_type =
      PyErr_NewException("tpnorm._tpnorm.InvalidArgumentError", bases.ptr(), nullptr);
  m.attr("InvalidArgumentError") = py::handle(invalid_argument_type);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      set_error(e);
    }
  });
  m.attr("INVALID_ARGUMENT") = static_cast<int>(ErrorCode::kInvalidArgument);
  m.attr("MISMATCH") = static_cast<int>(ErrorCode::kMismatch);
  m.attr("COMMUNICATION") = static_cast<int>(ErrorCode::kCommunication);
  m.attr("INTERNAL") = static_cast<int>(ErrorCode::kInternal);
}

void bind_communicators(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("device",
                             [](const Communicator& c) {
                               const Device d = c.device();
                               return d.kind == DeviceKind::CPU ? std::string("cpu")
                                                                : "cuda:" + std::to_string(d.index);
                             })
      .def_property_readonly("calls", [](const Communicator& c) { return c.counters().calls; })
      .def_property_readonly("bytes_sent",
                             [](const Communicator& c) { return c.counters().bytes_sent; })
      .def("reset_counters", &Communicator::reset_counters)
      .def_property_readonly("sequence", &Communicator::sequence)
      .def_property_readonly("size_checked_sum_bytes", &Communicator::size_checked_sum_bytes)
      .def("set_strict_calls", &Communicator::set_strict_calls, arg("n"))
      .def("set_timeout", &Communicator::set_timeout, arg("seconds"))
      // A device communicator's stream (a cudaStream_t as an integer; 0: none, or the legacy
      // default stream) and whether it is being captured into a CUDA graph.
      .def_property_readonly("stream",
                             [](const Communicator& c) {
                               return reinterpret_cast<uintptr_t>(c.stream());
                             })
      .def_property_readonly("capturing", [](const Communicator& c) {
        auto* d = dynamic_cast<const detail::DeviceCommunicator*>(&c);
        return d != nullptr && d->capturing();
      });
  m.def("single_communicator",
        [] { return std::shared_ptr<Communicator>(make_single_communicator()); });
  m.def("mpi_communicator", &mpi_communicator, arg("fortran_handle"));
  m.def("callback_communicator", &callback_communicator, arg("rank"), arg("size"),
        arg("all_reduce"));
  m.def("has_nccl", &has_nccl);
  m.def("nccl_unique_id", &nccl_unique_id);
  m.def("nccl_communicator", &nccl_communicator, arg("unique_id"), arg("rank"), arg("size"),
        arg("device"), arg("stream"));
#ifdef TPNORM_WITH_CUDA
  m.def(
      "cuda_single_communicator",
      [](int device, uintptr_t stream) {
        return std::shared_ptr<Communicator>(
            make_cuda_single_communicator(reinterpret_cast<cudaStream_t>(stream), device));
      },
      arg("device"), arg("stream"));
  m.def(
      "cuda_check_errors",
      [](Communicator& c) {
        py::gil_scoped_release nogil;
        cuda_check_errors(c);
      },
      arg("comm"));
#else
  m.def("cuda_single_communicator", [](int, uintptr_t) -> std::shared_ptr<Communicator> {
    throw Error(ErrorCode::kInvalidArgument, "tpnorm: this build has no CUDA backend");
  });
  m.def("cuda_check_errors", [](Communicator&) {});
#endif
  m.def(
      "slice_offset",
      [](Communicator& c, int64_t count, int64_t total) {
        py::gil_scoped_release nogil;
        return slice_offset(c, count, total);
      },
      arg("comm"), arg("count"), arg("total"));
  // A failure found in Python before an op call: the next op call on this thread fails with it
  // on every rank (ops/caller_failure.h) instead of this rank raising alone.
  m.def(
      "set_caller_failure", [](const std::string& message) { set_pending_failure(message); },
      arg("message"));
}

void bind_options(py::module_& m) {
  py::enum_<Stats>(m, "Stats")
      .value("ROBUST", Stats::kRobust)
      .value("NAIVE", Stats::kNaive)
      .value("EXACT", Stats::kExact);
  py::enum_<Layout>(m, "Layout")
      .value("NCHW", Layout::kNCHW)
      .value("CHANNELS_LAST", Layout::kChannelsLast);
  py::class_<NormOptions>(m, "NormOptions")
      .def(py::init([](double eps, Stats stats, bool check_agreement, int num_threads,
                       int64_t hidden_size) {
             return NormOptions{eps, stats, check_agreement, num_threads, hidden_size};
           }),
           arg("eps") = 1e-5, arg("stats") = Stats::kRobust, arg("check_agreement") = true,
           arg("num_threads") = 0, arg("hidden_size") = 0)
      .def_readwrite("hidden_size", &NormOptions::hidden_size)
      .def_readwrite("eps", &NormOptions::eps)
      .def_readwrite("stats", &NormOptions::stats)
      .def_readwrite("check_agreement", &NormOptions::check_agreement)
      .def_readwrite("num_threads", &NormOptions::num_threads);
  py::class_<BatchNormOptions>(m, "BatchNormOptions")
      .def(py::init([](double eps, double momentum, bool training, Layout layout, Stats stats,
                       bool check_agreement, int num_threads) {
             BatchNormOptions o;
             o.eps = eps;
             o.momentum = momentum;
             o.training = training;
             o.layout = layout;
             o.stats = stats;
             o.check_agreement = check_agreement;
             o.num_threads = num_threads;
             return o;
           }),
           arg("eps") = 1e-5, arg("momentum") = 0.1, arg("training") = true,
           arg("layout") = Layout::kNCHW, arg("stats") = Stats::kRobust,
           arg("check_agreement") = true, arg("num_threads") = 0)
      .def_readwrite("eps", &BatchNormOptions::eps)
      .def_readwrite("momentum", &BatchNormOptions::momentum)
      .def_readwrite("training", &BatchNormOptions::training);
  py::class_<ChannelGroups>(m, "ChannelGroups")
      .def(py::init([](int64_t groups, int64_t channels, int64_t offset) {
             return ChannelGroups{groups, channels, offset};
           }),
           arg("groups") = 1, arg("channels") = -1, arg("channel_offset") = 0)
      .def_readwrite("groups", &ChannelGroups::groups)
      .def_readwrite("channels", &ChannelGroups::channels)
      .def_readwrite("channel_offset", &ChannelGroups::channel_offset);
  py::class_<GatedGroups>(m, "GatedGroups")
      .def(py::init([](int64_t group_size, int64_t hidden, int64_t offset, bool norm_before_gate) {
             return GatedGroups{group_size, hidden, offset, norm_before_gate};
           }),
           arg("group_size") = -1, arg("hidden") = -1, arg("offset") = 0,
           arg("norm_before_gate") = false)
      .def_readwrite("group_size", &GatedGroups::group_size)
      .def_readwrite("hidden", &GatedGroups::hidden)
      .def_readwrite("offset", &GatedGroups::offset)
      .def_readwrite("norm_before_gate", &GatedGroups::norm_before_gate);
}

void bind_row_norms(py::module_& m) {
  m.def("layer_norm_forward", [](Communicator& c, Obj x, Obj gamma, Obj beta, Obj y, Obj mean,
                                 Obj rstd, const NormOptions& o) {
    TensorArgs a;
    auto X = a.add(x, "x"), G = a.add(gamma, "gamma"), B = a.add(beta, "beta");
    auto Y = a.add(y, "y"), M = a.add(mean, "mean"), R = a.add(rstd, "rstd");
    a.run([&] { layer_norm_forward(c, X, G, B, Y, M, R, o); });
  });
  m.def("layer_norm_backward", [](Communicator& c, Obj dy, Obj x, Obj gamma, Obj mean, Obj rstd,
                                  Obj dx, Obj dgamma, Obj dbeta, const NormOptions& o) {
    TensorArgs a;
    auto DY = a.add(dy, "dy"), X = a.add(x, "x"), G = a.add(gamma, "gamma");
    auto M = a.add(mean, "mean"), R = a.add(rstd, "rstd"), DX = a.add(dx, "dx");
    auto DG = a.add(dgamma, "dgamma"), DB = a.add(dbeta, "dbeta");
    a.run([&] { layer_norm_backward(c, DY, X, G, M, R, DX, DG, DB, o); });
  });
  m.def("rms_norm_forward",
        [](Communicator& c, Obj x, Obj gamma, Obj y, Obj rstd, const NormOptions& o) {
          TensorArgs a;
          auto X = a.add(x, "x"), G = a.add(gamma, "gamma"), Y = a.add(y, "y");
          auto R = a.add(rstd, "rstd");
          a.run([&] { rms_norm_forward(c, X, G, Y, R, o); });
        });
  m.def("rms_norm_backward", [](Communicator& c, Obj dy, Obj x, Obj gamma, Obj rstd, Obj dx,
                                Obj dgamma, const NormOptions& o) {
    TensorArgs a;
    auto DY = a.add(dy, "dy"), X = a.add(x, "x"), G = a.add(gamma, "gamma");
    auto R = a.add(rstd, "rstd"), DX = a.add(dx, "dx"), DG = a.add(dgamma, "dgamma");
    a.run([&] { rms_norm_backward(c, DY, X, G, R, DX, DG, o); });
  });
}

// Several row norms in one collective (tpnorm/batched.h). An item is a tuple
// (centered, x, gamma, beta, y, mean, rstd, hidden_size) forward, (centered, dy, x, gamma, mean,
// rstd, dx, dgamma, dbeta, hidden_size) backward; None for an absent tensor, as in the single
// calls; hidden_size 0: not checked.
void bind_batched(py::module_& m) {
  m.def("batched_norm_forward", [](Communicator& c, py::list items, const NormOptions& o) {
    TensorArgs a;
    std::vector<RowNormItem> v;
    for (py::handle h : items) {
      auto t = h.cast<py::tuple>();
      RowNormItem it;
      it.centered = t[0].cast<bool>();
      it.x = a.add(t[1], "x");
      it.gamma = a.add(t[2], "gamma");
      it.beta = a.add(t[3], "beta");
      it.y = a.add(t[4], "y");
      it.mean = a.add(t[5], "mean");
      it.rstd = a.add(t[6], "rstd");
      it.hidden_size = t[7].cast<int64_t>();
      v.push_back(it);
    }
    a.run([&] { batched_norm_forward(c, v.data(), v.size(), o); });
  });
  m.def("batched_norm_backward", [](Communicator& c, py::list items, const NormOptions& o) {
    TensorArgs a;
    std::vector<RowNormGradItem> v;
    for (py::handle h : items) {
      auto t = h.cast<py::tuple>();
      RowNormGradItem it;
      it.centered = t[0].cast<bool>();
      it.dy = a.add(t[1], "dy");
      it.x = a.add(t[2], "x");
      it.gamma = a.add(t[3], "gamma");
      it.mean = a.add(t[4], "mean");
      it.rstd = a.add(t[5], "rstd");
      it.dx = a.add(t[6], "dx");
      it.dgamma = a.add(t[7], "dgamma");
      it.dbeta = a.add(t[8], "dbeta");
      it.hidden_size = t[9].cast<int64_t>();
      v.push_back(it);
    }
    a.run([&] { batched_norm_backward(c, v.data(), v.size(), o); });
  });
}

void bind_fused(py::module_& m) {
  py::enum_<DeepNormStack>(m, "DeepNormStack")
      .value("ENCODER_ONLY", DeepNormStack::kEncoderOnly)
      .value("DECODER_ONLY", DeepNormStack::kDecoderOnly)
      .value("ENCODER_OF_ENCODER_DECODER", DeepNormStack::kEncoderOfEncoderDecoder)
      .value("DECODER_OF_ENCODER_DECODER", DeepNormStack::kDecoderOfEncoderDecoder);
  m.def("deepnorm_alpha", &deepnorm_alpha, arg("stack"), arg("encoder_layers"),
        arg("decoder_layers"));
  m.def("deepnorm_beta", &deepnorm_beta, arg("stack"), arg("encoder_layers"),
        arg("decoder_layers"));
  m.def("fused_add_layer_norm_forward",
        [](Communicator& c, Obj x, Obj f, double alpha, Obj gamma, Obj beta, Obj h, Obj y, Obj mean,
           Obj rstd, const NormOptions& o) {
          TensorArgs a;
          auto X = a.add(x, "x"), F = a.add(f, "f"), G = a.add(gamma, "gamma");
          auto B = a.add(beta, "beta"), H = a.add(h, "h"), Y = a.add(y, "y");
          auto M = a.add(mean, "mean"), R = a.add(rstd, "rstd");
          a.run([&] { fused_add_layer_norm_forward(c, X, F, alpha, G, B, H, Y, M, R, o); });
        });
  m.def("fused_add_layer_norm_backward", [](Communicator& c, Obj dy, Obj dh_extra, Obj h, Obj gamma,
                                            Obj mean, Obj rstd, double alpha, Obj dx, Obj df,
                                            Obj dgamma, Obj dbeta, const NormOptions& o) {
    TensorArgs a;
    auto DY = a.add(dy, "dy"), DE = a.add(dh_extra, "dh_extra"), H = a.add(h, "h");
    auto G = a.add(gamma, "gamma"), M = a.add(mean, "mean"), R = a.add(rstd, "rstd");
    auto DX = a.add(dx, "dx"), DF = a.add(df, "df"), DG = a.add(dgamma, "dgamma");
    auto DB = a.add(dbeta, "dbeta");
    a.run([&] { fused_add_layer_norm_backward(c, DY, DE, H, G, M, R, alpha, DX, DF, DG, DB, o); });
  });
  m.def("fused_add_rms_norm_forward", [](Communicator& c, Obj x, Obj f, double alpha, Obj gamma,
                                         Obj h, Obj y, Obj rstd, const NormOptions& o) {
    TensorArgs a;
    auto X = a.add(x, "x"), F = a.add(f, "f"), G = a.add(gamma, "gamma");
    auto H = a.add(h, "h"), Y = a.add(y, "y"), R = a.add(rstd, "rstd");
    a.run([&] { fused_add_rms_norm_forward(c, X, F, alpha, G, H, Y, R, o); });
  });
  m.def("fused_add_rms_norm_backward",
        [](Communicator& c, Obj dy, Obj dh_extra, Obj h, Obj gamma, Obj rstd, double alpha, Obj dx,
           Obj df, Obj dgamma, const NormOptions& o) {
          TensorArgs a;
          auto DY = a.add(dy, "dy"), DE = a.add(dh_extra, "dh_extra"), H = a.add(h, "h");
          auto G = a.add(gamma, "gamma"), R = a.add(rstd, "rstd");
          auto DX = a.add(dx, "dx"), DF = a.add(df, "df"), DG = a.add(dgamma, "dgamma");
          a.run([&] { fused_add_rms_norm_backward(c, DY, DE, H, G, R, alpha, DX, DF, DG, o); });
        });
}

void bind_channel_norms(py::module_& m) {
  // GroupNorm and InstanceNorm share one signature; `instance` picks the call.
  m.def(
      "group_norm_forward",
      [](Communicator& c, Obj x, const ChannelGroups& cg, Obj gamma, Obj beta, Obj y, Obj mean,
         Obj rstd, const NormOptions& o, bool instance) {
        TensorArgs a;
        auto X = a.add(x, "x"), G = a.add(gamma, "gamma"), B = a.add(beta, "beta");
        auto Y = a.add(y, "y"), M = a.add(mean, "mean"), R = a.add(rstd, "rstd");
        a.run([&] {
          (instance ? instance_norm_forward : group_norm_forward)(c, X, cg, G, B, Y, M, R, o);
        });
      },
      arg("comm"), arg("x"), arg("cg"), arg("gamma"), arg("beta"), arg("y"), arg("mean"),
      arg("rstd"), arg("opt"), arg("instance") = false);
  m.def(
      "group_norm_backward",
      [](Communicator& c, Obj dy, Obj x, const ChannelGroups& cg, Obj gamma, Obj mean, Obj rstd,
         Obj dx, Obj dgamma, Obj dbeta, const NormOptions& o, bool instance) {
        TensorArgs a;
        auto DY = a.add(dy, "dy"), X = a.add(x, "x"), G = a.add(gamma, "gamma");
        auto M = a.add(mean, "mean"), R = a.add(rstd, "rstd"), DX = a.add(dx, "dx");
        auto DG = a.add(dgamma, "dgamma"), DB = a.add(dbeta, "dbeta");
        a.run([&] {
          (instance ? instance_norm_backward : group_norm_backward)(c, DY, X, cg, G, M, R, DX, DG,
                                                                    DB, o);
        });
      },
      arg("comm"), arg("dy"), arg("x"), arg("cg"), arg("gamma"), arg("mean"), arg("rstd"),
      arg("dx"), arg("dgamma"), arg("dbeta"), arg("opt"), arg("instance") = false);

  // The gated RMSNorm (Mamba-2's RMSNormGated): z and dz None for no gate.
  m.def(
      "rms_norm_gated_forward",
      [](Communicator& c, Obj x, Obj z, const GatedGroups& gg, Obj weight, Obj y, Obj rstd,
         const NormOptions& o) {
        TensorArgs a;
        auto X = a.add(x, "x"), Z = a.add(z, "z"), W = a.add(weight, "weight");
        auto Y = a.add(y, "y"), R = a.add(rstd, "rstd");
        a.run([&] { rms_norm_gated_forward(c, X, Z, gg, W, Y, R, o); });
      },
      arg("comm"), arg("x"), arg("z"), arg("gg"), arg("weight"), arg("y"), arg("rstd"), arg("opt"));
  m.def(
      "rms_norm_gated_backward",
      [](Communicator& c, Obj dy, Obj x, Obj z, const GatedGroups& gg, Obj weight, Obj rstd, Obj dx,
         Obj dz, Obj dweight, const NormOptions& o) {
        TensorArgs a;
        auto DY = a.add(dy, "dy"), X = a.add(x, "x"), Z = a.add(z, "z");
        auto W = a.add(weight, "weight"), R = a.add(rstd, "rstd"), DX = a.add(dx, "dx");
        auto DZ = a.add(dz, "dz"), DW = a.add(dweight, "dweight");
        a.run([&] { rms_norm_gated_backward(c, DY, X, Z, gg, W, R, DX, DZ, DW, o); });
      },
      arg("comm"), arg("dy"), arg("x"), arg("z"), arg("gg"), arg("weight"), arg("rstd"), arg("dx"),
      arg("dz"), arg("dweight"), arg("opt"));

  // num_batches_tracked stays with the caller (torch keeps it as a buffer); a cumulative
  // momentum arrives here already as 1/num_batches_tracked.
  m.def("sync_batch_norm_forward",
        [](Communicator& c, Obj x, Obj gamma, Obj beta, Obj running_mean, Obj running_var, Obj y,
           Obj save_mean, Obj save_invstd, const BatchNormOptions& o) {
          TensorArgs a;
          auto X = a.add(x, "x"), G = a.add(gamma, "gamma"), B = a.add(beta, "beta");
          auto RM = a.add(running_mean, "running_mean"), RV = a.add(running_var, "running_var");
          auto Y = a.add(y, "y"), SM = a.add(save_mean, "save_mean");
          auto SI = a.add(save_invstd, "save_invstd");
          a.run([&] { sync_batch_norm_forward(c, X, G, B, RM, RV, nullptr, Y, SM, SI, o); });
        });
  m.def("sync_batch_norm_backward",
        [](Communicator& c, Obj dy, Obj x, Obj gamma, Obj save_mean, Obj save_invstd, Obj dx,
           Obj dgamma, Obj dbeta, const BatchNormOptions& o) {
          TensorArgs a;
          auto DY = a.add(dy, "dy"), X = a.add(x, "x"), G = a.add(gamma, "gamma");
          auto SM = a.add(save_mean, "save_mean"), SI = a.add(save_invstd, "save_invstd");
          auto DX = a.add(dx, "dx"), DG = a.add(dgamma, "dgamma"), DB = a.add(dbeta, "dbeta");
          a.run([&] { sync_batch_norm_backward(c, DY, X, G, SM, SI, DX, DG, DB, o); });
        });
}

// For examples/python/overhead.py: the same LayerNorm call made `iters` times from C++ on the
// same tensors, so that the Python layer's cost per call is the difference. Returns the
// median of 5 blocks, seconds per call (forward, or forward + backward).
void bind_benchmark(py::module_& m) {
  m.def("bench_layer_norm_loop",
        [](Communicator& c, Obj x, Obj gamma, Obj beta, Obj y, Obj mean, Obj rstd, Obj dy, Obj dx,
           Obj dgamma, Obj dbeta, const NormOptions& o, int iters, bool backward) {
          TensorArgs a;
          auto X = a.add(x, "x"), G = a.add(gamma, "gamma"), B = a.add(beta, "beta");
          auto Y = a.add(y, "y"), M = a.add(mean, "mean"), R = a.add(rstd, "rstd");
          auto DY = a.add(dy, "dy"), DX = a.add(dx, "dx"), DG = a.add(dgamma, "dgamma");
          auto DB = a.add(dbeta, "dbeta");
          std::vector<double> blocks;
          a.run([&] {
            for (int b = 0; b < 5; ++b) {
              const auto t0 = std::chrono::steady_clock::now();
              for (int i = 0; i < iters; ++i) {
                layer_norm_forward(c, X, G, B, Y, M, R, o);
                if (backward) layer_norm_backward(c, DY, X, G, M, R, DX, DG, DB, o);
              }
              const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t0;
              blocks.push_back(d.count() / iters);
            }
          });
          std::sort(blocks.begin(), blocks.end());
          return blocks[blocks.size() / 2];
        });
}

}  // namespace

void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    set_error(e);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "tpnorm: unknown C++ exception");
  }
}

}  // namespace tpnorm::python

PYBIND11_MODULE(_tpnorm, m) {
  m.doc() = "tpnorm's C++ calls over DLPack tensors (use the tpnorm package, not this module)";
  tpnorm::python::bind_errors(m);
  tpnorm::python::bind_communicators(m);
  tpnorm::python::bind_options(m);
  tpnorm::python::bind_row_norms(m);
  tpnorm::python::bind_fused(m);
  tpnorm::python::bind_batched(m);
  tpnorm::python::bind_channel_norms(m);
  tpnorm::python::bind_benchmark(m);
  tpnorm::python::bind_eager_api(m);
  tpnorm::python::bind_runtime_info(m);
}
