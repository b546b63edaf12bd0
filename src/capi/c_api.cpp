// c_api.cpp — the C interface (tpnorm/c_api.h) over the C++ calls: flat pointers and shapes
// become TensorViews, exceptions become status codes plus a per-thread message.
#include "tpnorm/c_api.h"

#include <mpi.h>

#include <cstddef>
#include <limits>
#include <new>
#include <string>

#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"

struct tpnorm_comm_s {
  std::unique_ptr<tpnorm::Communicator> impl;
};

namespace {

using tpnorm::DType;
using tpnorm::Shape;
using tpnorm::TensorView;

thread_local std::string last_error;

tpnorm_status_t fail(tpnorm_status_t s, const std::string& what) {
  last_error = what;
  return s;
}

// Runs fn, turning whatever it throws into a status; nothing escapes into C.
template <class Fn>
tpnorm_status_t guarded(Fn&& fn) {
  try {
    fn();
    return TPNORM_SUCCESS;
  } catch (const tpnorm::Error& e) {
    return fail(static_cast<tpnorm_status_t>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(TPNORM_INTERNAL, "tpnorm: out of memory");
  } catch (const std::exception& e) {
    return fail(TPNORM_INTERNAL, e.what());
  }
}

// Reads the fields the caller's struct has (its `size`), defaults for the rest. A struct that
// was never initialised becomes eps = NaN: the call still reaches its collective and fails on
// every rank together, instead of returning early on this rank alone.
tpnorm::NormOptions options(const tpnorm_norm_options_t* o) {
  tpnorm::NormOptions r;
  if (!o) return r;
  if (o->size < offsetof(tpnorm_norm_options_t, eps) || o->version == 0) {
    r.eps = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
  auto has = [&](size_t off, size_t n) { return o->size >= off + n; };
  if (has(offsetof(tpnorm_norm_options_t, eps), sizeof o->eps)) r.eps = o->eps;
  if (has(offsetof(tpnorm_norm_options_t, stats), sizeof o->stats))
    r.stats = static_cast<tpnorm::Stats>(o->stats);
  if (has(offsetof(tpnorm_norm_options_t, check_agreement), sizeof o->check_agreement))
    r.check_agreement = o->check_agreement != 0;
  if (has(offsetof(tpnorm_norm_options_t, num_threads), sizeof o->num_threads))
    r.num_threads = o->num_threads;
  return r;
}

// A required argument is always a present view (the validators reject NULL data only when it
// has elements, so an empty shard may pass NULL); an optional one is absent when NULL.
TensorView req(const void* p, tpnorm_dtype_t t, Shape s) {
  return TensorView(p, static_cast<DType>(t), s);
}
TensorView maybe(const void* p, tpnorm_dtype_t t, Shape s) {
  return p ? req(p, t, s) : TensorView();
}

tpnorm::Communicator* get(tpnorm_comm_t c) {
  if (!c || !c->impl)
    throw tpnorm::Error(tpnorm::ErrorCode::kInvalidArgument, "tpnorm: null communicator");
  return c->impl.get();
}

tpnorm_status_t create(tpnorm_comm_t* out, std::unique_ptr<tpnorm::Communicator> (*make)(int),
                       int arg) {
  if (!out) return fail(TPNORM_INVALID_ARGUMENT, "tpnorm: 'out' is null");
  return guarded([&] { *out = new tpnorm_comm_s{make(arg)}; });
}

}  // namespace

extern "C" {

const char* tpnorm_last_error(void) { return last_error.c_str(); }

const char* tpnorm_status_string(tpnorm_status_t s) {
  switch (s) {
    case TPNORM_SUCCESS:
      return "success";
    case TPNORM_INVALID_ARGUMENT:
      return "invalid argument";
    case TPNORM_MISMATCH:
      return "ranks disagree on the call";
    case TPNORM_COMMUNICATION:
      return "communication error";
    case TPNORM_INTERNAL:
      return "internal error";
  }
  return "unknown status";
}

tpnorm_status_t tpnorm_comm_create_mpi_fortran(int fortran_comm, tpnorm_comm_t* out) {
  return create(
      out, [](int f) { return tpnorm::make_mpi_communicator(MPI_Comm_f2c(f)); }, fortran_comm);
}

tpnorm_status_t tpnorm_comm_create_single(tpnorm_comm_t* out) {
  return create(
      out, [](int) { return tpnorm::make_single_communicator(); }, 0);
}

tpnorm_status_t tpnorm_comm_destroy(tpnorm_comm_t comm) {
  return guarded([&] { delete comm; });
}

tpnorm_status_t tpnorm_comm_rank(tpnorm_comm_t comm, int* rank) {
  return guarded([&] { *rank = get(comm)->rank(); });
}

tpnorm_status_t tpnorm_comm_size(tpnorm_comm_t comm, int* size) {
  return guarded([&] { *size = get(comm)->size(); });
}

tpnorm_status_t tpnorm_layer_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                          int64_t h, const void* x, const void* gamma,
                                          const void* beta, void* y, tpnorm_dtype_t sd, void* mean,
                                          void* rstd, const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    tpnorm::layer_norm_forward(*get(comm), req(x, dtype, {rows, h}), maybe(gamma, dtype, {h}),
                               maybe(beta, dtype, {h}), req(y, dtype, {rows, h}),
                               maybe(mean, sd, {rows}), maybe(rstd, sd, {rows}), options(opt));
  });
}

tpnorm_status_t tpnorm_layer_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                           int64_t h, const void* dy, const void* x,
                                           const void* gamma, tpnorm_dtype_t sd, const void* mean,
                                           const void* rstd, void* dx, void* dgamma, void* dbeta,
                                           const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    tpnorm::layer_norm_backward(*get(comm), req(dy, dtype, {rows, h}), req(x, dtype, {rows, h}),
                                maybe(gamma, dtype, {h}), maybe(mean, sd, {rows}),
                                maybe(rstd, sd, {rows}), req(dx, dtype, {rows, h}),
                                maybe(dgamma, dtype, {h}), maybe(dbeta, dtype, {h}), options(opt));
  });
}

tpnorm_status_t tpnorm_rms_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                        int64_t h, const void* x, const void* gamma, void* y,
                                        tpnorm_dtype_t sd, void* rstd,
                                        const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    tpnorm::rms_norm_forward(*get(comm), req(x, dtype, {rows, h}), maybe(gamma, dtype, {h}),
                             req(y, dtype, {rows, h}), maybe(rstd, sd, {rows}), options(opt));
  });
}

tpnorm_status_t tpnorm_rms_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                         int64_t h, const void* dy, const void* x,
                                         const void* gamma, tpnorm_dtype_t sd, const void* rstd,
                                         void* dx, void* dgamma, const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    tpnorm::rms_norm_backward(*get(comm), req(dy, dtype, {rows, h}), req(x, dtype, {rows, h}),
                              maybe(gamma, dtype, {h}), maybe(rstd, sd, {rows}),
                              req(dx, dtype, {rows, h}), maybe(dgamma, dtype, {h}), options(opt));
  });
}

}  // extern "C"
