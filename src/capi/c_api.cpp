// c_api.cpp — the C interface (tpnorm/c_api.h) over the C++ calls: flat pointers and shapes
// become TensorViews, exceptions become status codes plus a per-thread message.
#include "tpnorm/c_api.h"

#include <mpi.h>

#include <cstddef>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#include "capi/c_api_common.h"
#include "tpnorm/batch_norm.h"
#include "tpnorm/error.h"
#include "tpnorm/mpi.h"
#include "tpnorm/norm.h"
#include "tpnorm/rms_norm_gated.h"

namespace {
thread_local std::string last_error;
}  // namespace

tpnorm_status_t tpnorm::capi::fail(tpnorm_status_t s, const std::string& what) {
  last_error = what;
  return s;
}

namespace {

using tpnorm::DType;
using tpnorm::Shape;
using tpnorm::TensorView;
using tpnorm::capi::fail;
using tpnorm::capi::get;
using tpnorm::capi::guarded;

// Options structs: the fields the caller's struct has (its `size`) are read, the rest keep
// their defaults. A struct that was never initialised becomes eps = NaN: the call still reaches
// its collective and fails on every rank together, instead of returning early on one rank.
#define TPNORM_READ_FIELD(o, field, dst)                                         \
  do {                                                                           \
    using S_ = std::remove_cv_t<std::remove_pointer_t<decltype(o)>>;             \
    if ((o)->size >= offsetof(S_, field) + sizeof((o)->field)) dst = (o)->field; \
  } while (0)

template <class C, class R>
bool initialised(const C* o, R& r) {
  if (o->size >= offsetof(C, eps) && o->version != 0) return true;
  r.eps = std::numeric_limits<double>::quiet_NaN();
  return false;
}

tpnorm::NormOptions options(const tpnorm_norm_options_t* o) {
  tpnorm::NormOptions r;
  if (!o || !initialised(o, r)) return r;
  int stats = static_cast<int>(r.stats), check = r.check_agreement;
  TPNORM_READ_FIELD(o, eps, r.eps);
  TPNORM_READ_FIELD(o, stats, stats);
  TPNORM_READ_FIELD(o, check_agreement, check);
  TPNORM_READ_FIELD(o, num_threads, r.num_threads);
  r.stats = static_cast<tpnorm::Stats>(stats);
  r.check_agreement = check != 0;
  return r;
}

tpnorm::BatchNormOptions options(const tpnorm_batch_norm_options_t* o) {
  tpnorm::BatchNormOptions r;
  if (!o || !initialised(o, r)) return r;
  int training = r.training, layout = static_cast<int>(r.layout), stats = static_cast<int>(r.stats),
      check = r.check_agreement;
  TPNORM_READ_FIELD(o, eps, r.eps);
  TPNORM_READ_FIELD(o, momentum, r.momentum);
  TPNORM_READ_FIELD(o, training, training);
  TPNORM_READ_FIELD(o, layout, layout);
  TPNORM_READ_FIELD(o, stats, stats);
  TPNORM_READ_FIELD(o, check_agreement, check);
  TPNORM_READ_FIELD(o, num_threads, r.num_threads);
  r.training = training != 0;
  r.layout = static_cast<tpnorm::Layout>(layout);
  r.stats = static_cast<tpnorm::Stats>(stats);
  r.check_agreement = check != 0;
  return r;
}

// x's shape from (ndim, dims). A shape that cannot be represented becomes [0]: the op's
// validator rejects it on this rank inside the call's collective (ranks fail together).
Shape shape_of(int ndim, const int64_t* dims) {
  Shape s{0};
  if (!dims || ndim < 1 || ndim > Shape::kMaxDims) return s;
  s.ndim = ndim;
  for (int i = 0; i < ndim; ++i) s.dims[i] = dims[i];
  return s;
}

// Channels of x under the layout (0 for a shape the op will reject anyway).
int64_t channels(const Shape& s, const tpnorm::BatchNormOptions& o) {
  if (s.ndim < 2) return 0;
  return o.layout == tpnorm::Layout::kChannelsLast ? s.dims[s.ndim - 1] : s.dims[1];
}

// A required argument is always a present view (the validators reject NULL data only when it
// has elements, so an empty shard may pass NULL); an optional one is absent when NULL.
// The pointers are in the communicator's memory: host memory for host communicators, the
// GPU's for device ones (tpnorm/c_api_cuda.h). Each entry point that builds views names its
// communicator first (ViewsOn), so that req() / maybe() know where the pointers live.
thread_local tpnorm::Device t_view_device = tpnorm::Device::cpu();
struct ViewsOn {
  explicit ViewsOn(tpnorm_comm_t c) : prev(t_view_device) { t_view_device = get(c)->device(); }
  ~ViewsOn() { t_view_device = prev; }
  tpnorm::Device prev;
};

TensorView req(const void* p, tpnorm_dtype_t t, Shape s) {
  return TensorView(p, static_cast<DType>(t), s, t_view_device);
}
TensorView maybe(const void* p, tpnorm_dtype_t t, Shape s) {
  return p ? req(p, t, s) : TensorView();
}

// A SyncBatchNorm entry point's arguments read once: the options, x's shape, and the channel
// count C that every per-channel tensor (gamma, beta, running and saved statistics, their
// gradients) has, so forward and backward build their views the same way.
struct BatchNormShape {
  BatchNormShape(int ndim, const int64_t* dims, const tpnorm_batch_norm_options_t* opt)
      : o(options(opt)), s(shape_of(ndim, dims)), C(channels(s, o)) {}
  /// An optional per-channel view [C].
  TensorView channel(const void* p, tpnorm_dtype_t t) const { return maybe(p, t, {C}); }

  const tpnorm::BatchNormOptions o;
  const Shape s;
  const int64_t C;
};

// The gated RMSNorm's grouping, and the shape of its rstd: [rows, groups] (groups 0 for a
// grouping the op rejects anyway, inside its collective).
tpnorm::GatedGroups gated_groups(int64_t hidden, int64_t offset, int64_t group_size, int nbg) {
  return {group_size, hidden, offset, nbg != 0};
}
Shape gated_rstd_shape(int64_t rows, int64_t c_local, const tpnorm::GatedGroups& gg) {
  const int64_t hidden = gg.hidden < 0 ? c_local : gg.hidden;
  const int64_t gs = gg.group_size < 0 ? hidden : gg.group_size;
  return {rows, gs > 0 && hidden % gs == 0 ? hidden / gs : 0};
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
  return tpnorm::capi::create(
      out, [&] { return tpnorm::make_mpi_communicator(MPI_Comm_f2c(fortran_comm)); });
}

tpnorm_status_t tpnorm_comm_create_single(tpnorm_comm_t* out) {
  return tpnorm::capi::create(out, [] { return tpnorm::make_single_communicator(); });
}

tpnorm_status_t tpnorm_comm_destroy(tpnorm_comm_t comm) {
  return guarded([&] { delete comm; });
}

tpnorm_status_t tpnorm_comm_rank(tpnorm_comm_t comm, int* rank) {
  if (!rank) return fail(TPNORM_INVALID_ARGUMENT, "tpnorm: 'rank' is null");
  return guarded([&] { *rank = get(comm)->rank(); });
}

tpnorm_status_t tpnorm_comm_size(tpnorm_comm_t comm, int* size) {
  if (!size) return fail(TPNORM_INVALID_ARGUMENT, "tpnorm: 'size' is null");
  return guarded([&] { *size = get(comm)->size(); });
}

tpnorm_status_t tpnorm_layer_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                          int64_t h, const void* x, const void* gamma,
                                          const void* beta, void* y, tpnorm_dtype_t sd, void* mean,
                                          void* rstd, const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
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
    const ViewsOn on(comm);
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
    const ViewsOn on(comm);
    tpnorm::rms_norm_forward(*get(comm), req(x, dtype, {rows, h}), maybe(gamma, dtype, {h}),
                             req(y, dtype, {rows, h}), maybe(rstd, sd, {rows}), options(opt));
  });
}

tpnorm_status_t tpnorm_rms_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows,
                                         int64_t h, const void* dy, const void* x,
                                         const void* gamma, tpnorm_dtype_t sd, const void* rstd,
                                         void* dx, void* dgamma, const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
    tpnorm::rms_norm_backward(*get(comm), req(dy, dtype, {rows, h}), req(x, dtype, {rows, h}),
                              maybe(gamma, dtype, {h}), maybe(rstd, sd, {rows}),
                              req(dx, dtype, {rows, h}), maybe(dgamma, dtype, {h}), options(opt));
  });
}

tpnorm_status_t tpnorm_rms_norm_gated_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype,
                                              int64_t rows, int64_t h, int64_t hidden,
                                              int64_t offset, int64_t group_size,
                                              int norm_before_gate, const void* x, const void* z,
                                              tpnorm_dtype_t pd, const void* weight, void* y,
                                              tpnorm_dtype_t sd, void* rstd,
                                              const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
    const tpnorm::GatedGroups gg = gated_groups(hidden, offset, group_size, norm_before_gate);
    tpnorm::rms_norm_gated_forward(*get(comm), req(x, dtype, {rows, h}), maybe(z, dtype, {rows, h}),
                                   gg, maybe(weight, pd, {h}), req(y, dtype, {rows, h}),
                                   maybe(rstd, sd, gated_rstd_shape(rows, h, gg)), options(opt));
  });
}

tpnorm_status_t tpnorm_rms_norm_gated_backward(
    tpnorm_comm_t comm, tpnorm_dtype_t dtype, int64_t rows, int64_t h, int64_t hidden,
    int64_t offset, int64_t group_size, int norm_before_gate, const void* dy, const void* x,
    const void* z, tpnorm_dtype_t pd, const void* weight, tpnorm_dtype_t sd, const void* rstd,
    void* dx, void* dz, void* dweight, const tpnorm_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
    const tpnorm::GatedGroups gg = gated_groups(hidden, offset, group_size, norm_before_gate);
    tpnorm::rms_norm_gated_backward(*get(comm), req(dy, dtype, {rows, h}), req(x, dtype, {rows, h}),
                                    maybe(z, dtype, {rows, h}), gg, maybe(weight, pd, {h}),
                                    req(rstd, sd, gated_rstd_shape(rows, h, gg)),
                                    req(dx, dtype, {rows, h}), maybe(dz, dtype, {rows, h}),
                                    maybe(dweight, pd, {h}), options(opt));
  });
}

tpnorm_status_t tpnorm_sync_batch_norm_forward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int ndim,
                                               const int64_t* shape, const void* x,
                                               const void* gamma, const void* beta,
                                               tpnorm_dtype_t sd, void* running_mean,
                                               void* running_var, int64_t* num_batches_tracked,
                                               void* y, void* save_mean, void* save_invstd,
                                               const tpnorm_batch_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
    const BatchNormShape b(ndim, shape, opt);
    tpnorm::sync_batch_norm_forward(
        *get(comm), req(x, dtype, b.s), b.channel(gamma, dtype), b.channel(beta, dtype),
        b.channel(running_mean, sd), b.channel(running_var, sd), num_batches_tracked,
        req(y, dtype, b.s), b.channel(save_mean, sd), b.channel(save_invstd, sd), b.o);
  });
}

tpnorm_status_t tpnorm_sync_batch_norm_backward(tpnorm_comm_t comm, tpnorm_dtype_t dtype, int ndim,
                                                const int64_t* shape, const void* dy, const void* x,
                                                const void* gamma, tpnorm_dtype_t sd,
                                                const void* save_mean, const void* save_invstd,
                                                void* dx, void* dgamma, void* dbeta,
                                                const tpnorm_batch_norm_options_t* opt) {
  return guarded([&] {
    const ViewsOn on(comm);
    const BatchNormShape b(ndim, shape, opt);
    tpnorm::sync_batch_norm_backward(*get(comm), req(dy, dtype, b.s), req(x, dtype, b.s),
                                     b.channel(gamma, dtype), b.channel(save_mean, sd),
                                     b.channel(save_invstd, sd), req(dx, dtype, b.s),
                                     b.channel(dgamma, dtype), b.channel(dbeta, dtype), b.o);
  });
}

}  // extern "C"
