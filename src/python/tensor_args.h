// tensor_args.h — the tensors of one binding call, taken through DLPack without a copy.
//
// Each argument is any object with __dlpack__ (a torch tensor, detached) or None (absent).
// The view points at the producer's memory; the producer keeps it alive until the TensorArgs
// is destroyed (the DLPack deleter runs then), which is after the op returns.
//
// Checks (dtype, device kind, at most 8 dims, row-major contiguity) do not throw: the first
// failure is recorded with the argument's name and handed to the op's agreement (see
// ops/caller_failure.h), so a bad tensor on ONE rank is the same tpnorm.Error on every rank and
// the others are not left waiting in the collective. The bad argument's view keeps its shape
// (so every rank's collective has the same size) with a null data pointer (so nothing reads it).
#pragma once

#include <pybind11/pybind11.h>

#include <deque>
#include <exception>
#include <functional>
#include <string>

#include "dlpack.h"
#include "tpnorm/tensor.h"

namespace tpnorm::python {

/// "TypeName: message" of a Python exception, without the traceback pybind11 appends.
std::string error_text(const pybind11::error_already_set& e);

/// Sets the Python error for exception `p` as the module's translator does (a tpnorm::Error
/// becomes tpnorm.Error with its .code). module.cpp; for callers outside pybind11's dispatch.
void set_python_error(std::exception_ptr p);

/// Publishes eager_api.h's table (eager_api.cpp).
void bind_eager_api(pybind11::module_& m);
/// mpi_info, cuda_info, nccl_info: the libraries the process loaded (runtime_info.cpp).
void bind_runtime_info(pybind11::module_& m);

/// A failure found in Python before an op call (tpnorm._tpnorm.set_caller_failure): the next
/// TensorArgs::run on this thread hands it to its op (ahead of any of its own), so that it is
/// the same tpnorm.Error on every rank instead of this rank raising alone.
void set_pending_failure(const std::string& message);

class TensorArgs {
 public:
  TensorArgs() = default;
  TensorArgs(const TensorArgs&) = delete;
  TensorArgs& operator=(const TensorArgs&) = delete;
  ~TensorArgs();

  /// The view of `obj` (None: the absent view). `name` is a string literal naming the argument.
  TensorView add(pybind11::handle obj, const char* name);

  /// The view of a tensor described by `t` (its producer keeps the memory alive for the
  /// call), with the same checks: the C++ autograd path (eager_api.h) describes torch
  /// tensors this way, without a capsule.
  TensorView add(const DLTensor& t, const char* name);

  /// Runs the op without the GIL (its CPU threads and a process group's callback need it
  /// free), first handing any recorded failure to the op's agreement.
  void run(const std::function<void()>& op);

  const std::string& failure() const { return failure_; }

 private:
  DLManagedTensor* import(pybind11::handle obj, const char* name);
  void fail(const char* name, const std::string& what);

  std::deque<DLManagedTensor*> owned_;
  std::string failure_;
};

}  // namespace tpnorm::python
