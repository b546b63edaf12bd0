// autograd.cpp — tpnorm._autograd: every op of tpnorm as a C++ autograd function (LayerNorm /
// RMSNorm, the fused residual forms, K batched row norms, GroupNorm / InstanceNorm, the gated
// RMSNorm, SyncBatchNorm), the eager path of tpnorm's ops on plain torch tensors. Built against the torch that will import
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
#include <memory>
#include <string>
#include <vector>

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
  eager::Tensor slot[16];
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

// A table call from a backward node: the autograd engine runs it without the GIL; take it for
// the call (released again while the op runs) and hand a failure to Python unchanged.
template <class F>
void from_backward(F&& call) {
  pybind11::gil_scoped_acquire gil;
  if (!call()) {
    python_error e;
    e.persist();
    throw e;
  }
}

// The same from a forward (the GIL is held: a pybind11 call).
template <class F>
void from_forward(F&& call) {
  if (!call()) throw pybind11::error_already_set();
}

at::Tensor like(const at::Tensor& t) { return at::empty_like(t, at::MemoryFormat::Contiguous); }
at::Tensor like_or_none(const at::Tensor& t) { return t.defined() ? like(t) : at::Tensor(); }
at::Tensor grad_or_zeros(const at::Tensor& g, const at::Tensor& like_this) {
  return g.defined() ? g.contiguous() : at::zeros_like(like_this, at::MemoryFormat::Contiguous);
}
// A [n] gradient of `dtype` (a bias's: float32 next to a half x in mixed precision), or none.
at::Tensor vector_of(const at::Tensor& x, int64_t n, int64_t dtype) {
  return dtype >= 0 ? at::empty({n}, x.options().dtype(static_cast<at::ScalarType>(dtype)))
                    : at::Tensor();
}
int64_t dtype_of(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.scalar_type()) : int64_t{-1};
}

// h = alpha * x + f and y = Norm(h), both returned; h's own gradient joins y's in backward.
struct FusedAddNorm : public torch::autograd::Function<FusedAddNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& f,
                               const c10::optional<at::Tensor>& weight_opt,
                               const c10::optional<at::Tensor>& bias_opt, double alpha,
                               int64_t comm, int64_t opt, bool centered) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t rows = rows_of(x);
    at::Tensor h = like(x), y = like(x), rstd = row_stats(x, rows);
    at::Tensor mean = centered ? row_stats(x, rows) : at::Tensor();
    Args d;
    auto *X = d(x), *F = d(f), *W = d(weight), *B = d(bias), *H = d(h), *Y = d(y), *M = d(mean),
         *R = d(rstd);
    from_forward([&] {
      return api->fused_forward(comm_of(comm), comm_of(opt), centered, alpha, X, F, W, B, H, Y, M,
                                R);
    });
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({h, weight, mean, rstd});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["opt"] = opt;
    ctx->saved_data["centered"] = centered;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["bias_dtype"] = dtype_of(bias);
    return {h, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const bool centered = ctx->saved_data["centered"].toBool();
    at::Tensor dh = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    at::Tensor dy = grad_or_zeros(grads[1], h);
    at::Tensor dx = like(h), df = like(h), dw = like_or_none(weight);
    at::Tensor db = vector_of(h, h.size(-1), ctx->saved_data["bias_dtype"].toInt());
    Args d;
    auto *DY = d(dy), *DH = d(dh), *H = d(h), *W = d(weight), *M = d(mean), *R = d(rstd),
         *DX = d(dx), *DF = d(df), *DW = d(dw), *DB = d(db);
    from_backward([&] {
      return api->fused_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                 comm_of(ctx->saved_data["opt"].toInt()), centered,
                                 ctx->saved_data["alpha"].toDouble(), DY, DH, H, W, M, R, DX, DF,
                                 DW, DB);
    });
    return {dx, df, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// GroupNorm / InstanceNorm on [N, C_local, *spatial]: mean and rstd [N, G] of every group.
struct GroupNorm : public torch::autograd::Function<GroupNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt, int64_t groups,
                            int64_t channels, int64_t offset, int64_t comm, int64_t opt,
                            bool instance) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t n = x.dim() > 0 ? x.size(0) : 0;
    const int64_t g = instance ? (channels >= 0 ? channels : (x.dim() > 1 ? x.size(1) : 1))
                               : groups;
    const auto sopt = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    at::Tensor y = like(x), mean = at::empty({n, g}, sopt), rstd = at::empty({n, g}, sopt);
    Args d;
    auto *X = d(x), *W = d(weight), *B = d(bias), *Y = d(y), *M = d(mean), *R = d(rstd);
    from_forward([&] {
      return api->group_forward(comm_of(comm), comm_of(opt), groups, channels, offset, instance,
                                X, W, B, Y, M, R);
    });
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["opt"] = opt;
    ctx->saved_data["cg"] = std::vector<int64_t>{groups, channels, offset};
    ctx->saved_data["instance"] = instance;
    ctx->saved_data["bias"] = bias.defined();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const auto cg = ctx->saved_data["cg"].toIntVector();
    at::Tensor dy = grad_or_zeros(grads[0], x);
    at::Tensor dx = like(x), dw = like_or_none(weight);
    at::Tensor db = ctx->saved_data["bias"].toBool() ? vector_of(x, x.size(1), dtype_of(x))
                                                     : at::Tensor();
    Args d;
    auto *DY = d(dy), *X = d(x), *W = d(weight), *M = d(mean), *R = d(rstd), *DX = d(dx),
         *DW = d(dw), *DB = d(db);
    from_backward([&] {
      return api->group_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                 comm_of(ctx->saved_data["opt"].toInt()), cg[0], cg[1], cg[2],
                                 ctx->saved_data["instance"].toBool(), DY, X, W, M, R, DX, DW, DB);
    });
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Mamba-2's gated RMSNorm on [..., c_local] (x and z contiguous): rstd [rows, groups].
struct GatedNorm : public torch::autograd::Function<GatedNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& z_opt,
                            const c10::optional<at::Tensor>& weight_opt, int64_t group_size,
                            int64_t hidden, int64_t offset, bool norm_before_gate, int64_t comm,
                            int64_t opt) {
    const at::Tensor z = z_opt.value_or(at::Tensor());
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    // Every group of the whole row (0 for a grouping the op refuses, on every rank).
    const int64_t h = hidden < 0 ? (x.dim() > 0 ? x.size(-1) : 0) : hidden;
    const int64_t size = group_size < 0 ? h : group_size;
    const int64_t groups = size > 0 && h % size == 0 ? h / size : 0;
    at::Tensor y = like(x);
    at::Tensor rstd = at::empty({rows_of(x), groups}, x.options().dtype(
                                    x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    Args d;
    auto *X = d(x), *Z = d(z), *W = d(weight), *Y = d(y), *R = d(rstd);
    from_forward([&] {
      return api->gated_forward(comm_of(comm), comm_of(opt), group_size, hidden, offset,
                                norm_before_gate, X, Z, W, Y, R);
    });
    ctx->save_for_backward({x, z, weight, rstd});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["opt"] = opt;
    ctx->saved_data["gg"] = std::vector<int64_t>{group_size, hidden, offset, norm_before_gate};
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &z = saved[1], &weight = saved[2], &rstd = saved[3];
    const auto gg = ctx->saved_data["gg"].toIntVector();
    at::Tensor dy = grad_or_zeros(grads[0], x);
    at::Tensor dx = like(x), dz = like_or_none(z), dw = like_or_none(weight);
    Args d;
    auto *DY = d(dy), *X = d(x), *Z = d(z), *W = d(weight), *R = d(rstd), *DX = d(dx),
         *DZ = d(dz), *DW = d(dw);
    from_backward([&] {
      return api->gated_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                 comm_of(ctx->saved_data["opt"].toInt()), gg[0], gg[1], gg[2],
                                 gg[3] != 0, DY, X, Z, W, R, DX, DZ, DW);
    });
    return {dx, dz, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The [N, *spatial, C] view of a channels-last [N, C, *spatial] tensor (row-major).
at::Tensor to_last(const at::Tensor& t) {
  std::vector<int64_t> dims{0};
  for (int64_t i = 2; i < t.dim(); ++i) dims.push_back(i);
  dims.push_back(1);
  return t.permute(dims);
}

// SyncBatchNorm: statistics over every rank's batch; running statistics (float32/float64) updated
// in place in training. x channels-last (4-D/5-D, stride 1 on C) runs on its [N, *spatial, C]
// view; y and dx keep x's layout.
struct BatchNorm : public torch::autograd::Function<BatchNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt,
                            const c10::optional<at::Tensor>& running_mean_opt,
                            const c10::optional<at::Tensor>& running_var_opt, int64_t comm,
                            double eps, double momentum, bool training, bool channels_last,
                            int64_t stats) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const at::Tensor rm = running_mean_opt.value_or(at::Tensor());
    const at::Tensor rv = running_var_opt.value_or(at::Tensor());
    const int64_t c = x.dim() > 1 ? x.size(1) : 0;
    at::Tensor y = channels_last ? at::empty_like(x) : like(x);
    const auto sopt = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    at::Tensor save_mean = at::empty({c}, sopt), save_invstd = at::empty({c}, sopt);
    const at::Tensor xv = channels_last ? to_last(x) : x, yv = channels_last ? to_last(y) : y;
    Args d;
    auto *X = d(xv), *W = d(weight), *B = d(bias), *RM = d(rm), *RV = d(rv), *Y = d(yv),
         *SM = d(save_mean), *SI = d(save_invstd);
    from_forward([&] {
      return api->batch_norm_forward(comm_of(comm), eps, momentum, training, channels_last,
                                     static_cast<int>(stats), X, W, B, RM, RV, Y, SM, SI);
    });
    ctx->save_for_backward({x, weight, save_mean, save_invstd});
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["training"] = training;
    ctx->saved_data["channels_last"] = channels_last;
    ctx->saved_data["stats"] = stats;
    ctx->saved_data["bias_dtype"] = dtype_of(bias);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &save_mean = saved[2],
                     &save_invstd = saved[3];
    const bool last = ctx->saved_data["channels_last"].toBool();
    const int64_t c = x.dim() > 1 ? x.size(1) : 0;
    at::Tensor dx = last ? at::empty_like(x) : like(x), dw = like_or_none(weight);
    at::Tensor db = vector_of(x, c, ctx->saved_data["bias_dtype"].toInt());
    const at::Tensor xv = last ? to_last(x) : x, dxv = last ? to_last(dx) : dx;
    const at::Tensor dy = grads[0].defined() ? (last ? to_last(grads[0]) : grads[0]).contiguous()
                                             : at::zeros_like(xv, at::MemoryFormat::Contiguous);
    Args d;
    auto *DY = d(dy), *X = d(xv), *W = d(weight), *SM = d(save_mean), *SI = d(save_invstd),
         *DX = d(dxv), *DW = d(dw), *DB = d(db);
    from_backward([&] {
      return api->batch_norm_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                      ctx->saved_data["eps"].toDouble(),
                                      ctx->saved_data["training"].toBool(), last,
                                      static_cast<int>(ctx->saved_data["stats"].toInt()), DY, X,
                                      W, SM, SI, DX, DW, DB);
    });
    variable_list out(11);
    out[0] = dx;
    out[1] = dw;
    out[2] = db;
    return out;
  }
};

// K row norms in one collective. The parameters travel as one list of the present ones (the
// weights of the items with has_weight, in item order, then the biases of those with
// has_bias), as in the torch.library op: autograd takes a list of tensors only.
struct BatchedNorm : public torch::autograd::Function<BatchedNorm> {
  static variable_list forward(AutogradContext* ctx, at::TensorList xs_in, at::TensorList params,
                               std::vector<bool> has_weight, std::vector<bool> has_bias,
                               std::vector<bool> centered, std::vector<int64_t> hidden,
                               int64_t comm, int64_t opt) {
    variable_list xs = xs_in.vec();
    const size_t k = xs.size();
    std::vector<at::Tensor> ws(k), bs(k), ys(k), means(k), rstds(k);
    size_t next = 0;
    for (size_t i = 0; i < k; ++i)
      if (has_weight[i]) ws[i] = params[next++];
    for (size_t i = 0; i < k; ++i)
      if (has_bias[i]) bs[i] = params[next++];
    std::vector<eager::Tensor> slot(6 * k);
    std::vector<const eager::Tensor*> t(6 * k, nullptr);
    for (size_t i = 0; i < k; ++i) {
      xs[i] = xs[i].contiguous();
      ys[i] = like(xs[i]);
      rstds[i] = row_stats(xs[i], rows_of(xs[i]));
      if (centered[i]) means[i] = row_stats(xs[i], rows_of(xs[i]));
      const at::Tensor* a[6] = {&xs[i], &ws[i], &bs[i], &ys[i], &means[i], &rstds[i]};
      for (int j = 0; j < 6; ++j)
        if (a[j]->defined()) {
          slot[6 * i + j] = describe(*a[j]);
          t[6 * i + j] = &slot[6 * i + j];
        }
    }
    std::unique_ptr<bool[]> cen(new bool[k]);
    for (size_t i = 0; i < k; ++i) cen[i] = centered[i];
    from_forward([&] {
      return api->batched_forward(comm_of(comm), comm_of(opt), static_cast<int64_t>(k),
                                  cen.get(), hidden.data(), t.data());
    });
    variable_list keep;
    for (size_t i = 0; i < k; ++i) keep.push_back(xs[i]);
    for (size_t i = 0; i < k; ++i) keep.push_back(ws[i]);
    for (size_t i = 0; i < k; ++i) keep.push_back(means[i]);
    for (size_t i = 0; i < k; ++i) keep.push_back(rstds[i]);
    ctx->save_for_backward(keep);
    std::vector<int64_t> bias_dtypes(k);
    for (size_t i = 0; i < k; ++i) bias_dtypes[i] = dtype_of(bs[i]);
    ctx->saved_data["bias_dtypes"] = bias_dtypes;
    ctx->saved_data["centered"] = std::vector<int64_t>(centered.begin(), centered.end());
    ctx->saved_data["hidden"] = hidden;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["opt"] = opt;
    return ys;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto bias_dtypes = ctx->saved_data["bias_dtypes"].toIntVector();
    const auto cen_v = ctx->saved_data["centered"].toIntVector();
    auto hidden = ctx->saved_data["hidden"].toIntVector();
    const size_t k = bias_dtypes.size();
    std::vector<at::Tensor> dys(k), dxs(k), dws(k), dbs(k);
    std::vector<eager::Tensor> slot(8 * k);
    std::vector<const eager::Tensor*> t(8 * k, nullptr);
    std::unique_ptr<bool[]> cen(new bool[k]);
    for (size_t i = 0; i < k; ++i) {
      const at::Tensor &x = saved[i], &w = saved[k + i], &mean = saved[2 * k + i],
                       &rstd = saved[3 * k + i];
      cen[i] = cen_v[i] != 0;
      dys[i] = grad_or_zeros(grads[i], x);
      dxs[i] = like(x);
      dws[i] = like_or_none(w);
      dbs[i] = vector_of(x, x.size(-1), bias_dtypes[i]);
      const at::Tensor* a[8] = {&dys[i], &x, &w, &mean, &rstd, &dxs[i], &dws[i], &dbs[i]};
      for (int j = 0; j < 8; ++j)
        if (a[j]->defined()) {
          slot[8 * i + j] = describe(*a[j]);
          t[8 * i + j] = &slot[8 * i + j];
        }
    }
    from_backward([&] {
      return api->batched_backward(comm_of(ctx->saved_data["comm"].toInt()),
                                   comm_of(ctx->saved_data["opt"].toInt()),
                                   static_cast<int64_t>(k), cen.get(), hidden.data(), t.data());
    });
    variable_list params;
    for (size_t i = 0; i < k; ++i)
      if (dws[i].defined()) params.push_back(dws[i]);
    for (size_t i = 0; i < k; ++i)
      if (bias_dtypes[i] >= 0) params.push_back(dbs[i]);
    variable_list out = dxs;
    out.insert(out.end(), params.begin(), params.end());
    out.resize(out.size() + 6);  // has_weight, has_bias, centered, hidden, comm, opt
    return out;
  }
};

at::Tensor row_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                    const c10::optional<at::Tensor>& bias, int64_t comm, int64_t opt,
                    bool centered) {
  return RowNorm::apply(x, weight, bias, comm, opt, centered);
}

}  // namespace

variable_list fused_add_norm(const at::Tensor& x, const at::Tensor& f,
                             const c10::optional<at::Tensor>& weight,
                             const c10::optional<at::Tensor>& bias, double alpha, int64_t comm,
                             int64_t opt, bool centered) {
  return FusedAddNorm::apply(x, f, weight, bias, alpha, comm, opt, centered);
}

at::Tensor group_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                      const c10::optional<at::Tensor>& bias, int64_t groups, int64_t channels,
                      int64_t offset, int64_t comm, int64_t opt, bool instance) {
  return GroupNorm::apply(x, weight, bias, groups, channels, offset, comm, opt, instance);
}

at::Tensor rms_norm_gated(const at::Tensor& x, const c10::optional<at::Tensor>& z,
                          const c10::optional<at::Tensor>& weight, int64_t group_size,
                          int64_t hidden, int64_t offset, bool norm_before_gate, int64_t comm,
                          int64_t opt) {
  return GatedNorm::apply(x, z, weight, group_size, hidden, offset, norm_before_gate, comm, opt);
}

at::Tensor sync_batch_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& running_mean,
                           const c10::optional<at::Tensor>& running_var, int64_t comm, double eps,
                           double momentum, bool training, bool channels_last, int64_t stats) {
  return BatchNorm::apply(x, weight, bias, running_mean, running_var, comm, eps, momentum,
                          training, channels_last, stats);
}

variable_list batched_row_norm(const variable_list& xs, const variable_list& params,
                               const std::vector<bool>& has_weight,
                               const std::vector<bool>& has_bias,
                               const std::vector<bool>& centered,
                               const std::vector<int64_t>& hidden, int64_t comm, int64_t opt) {
  // As TensorLists, autograd takes the tensors as the node's inputs.
  return BatchedNorm::apply(at::TensorList(xs), at::TensorList(params), has_weight, has_bias,
                            centered, hidden, comm, opt);
}

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
  using pybind11::arg;
  m.def("fused_add_norm", &fused_add_norm, arg("x"), arg("f"), arg("weight"), arg("bias"),
        arg("alpha"), arg("comm"), arg("opt"), arg("centered"),
        "(h, y) of the fused residual add + LayerNorm (centered) / RMSNorm");
  m.def("group_norm", &group_norm, arg("x"), arg("weight"), arg("bias"), arg("groups"),
        arg("channels"), arg("offset"), arg("comm"), arg("opt"), arg("instance"),
        "y of GroupNorm (InstanceNorm with instance) over channel-sharded x");
  m.def("rms_norm_gated", &rms_norm_gated, arg("x"), arg("z"), arg("weight"), arg("group_size"),
        arg("hidden"), arg("offset"), arg("norm_before_gate"), arg("comm"), arg("opt"),
        "y of the gated RMSNorm over channel-sharded x (x and z contiguous)");
  m.def("sync_batch_norm", &sync_batch_norm, arg("x"), arg("weight"), arg("bias"),
        arg("running_mean"), arg("running_var"), arg("comm"), arg("eps"), arg("momentum"),
        arg("training"), arg("channels_last"), arg("stats"),
        "y of SyncBatchNorm (running statistics updated in place in training)");
  m.def("batched_row_norm", &batched_row_norm, arg("xs"), arg("params"), arg("has_weight"),
        arg("has_bias"), arg("centered"), arg("hidden"), arg("comm"), arg("opt"),
        "the K outputs of K row norms in one collective");
}
