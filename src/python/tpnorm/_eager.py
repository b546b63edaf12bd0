"""The private eager layer of tpnorm's Python package: for each op, the functions that allocate
its outputs and make its C++ call (through tpnorm._tpnorm, DLPack tensors), forward and
backward, shared by every path that runs the op (the C++ and Python autograd, the torch.library
ops and their fake implementations' shapes, the DTensor wrappers). It imports only the C++
module and the communicators; everything else in the package is above it.

Tensors cross into C++ through DLPack without a copy; inputs must be contiguous (row-major),
outputs are allocated here. Saved statistics are float32 (float64 next to a float64 input).
"""
import math
import os
import sys

import torch

from . import _tpnorm as _C
try:
    from . import _build  # written by the build: what it was made with
except ImportError:
    _build = None


_STATS = {"robust": _C.Stats.ROBUST, "naive": _C.Stats.NAIVE, "exact": _C.Stats.EXACT}


_opts_cache = {}


def norm_options(eps=1e-5, stats="robust", hidden_size=0, check_agreement=True, num_threads=0):
    """A cached _C.NormOptions (building one per call would cost more than the lookup);
    hidden_size > 0: the size the ranks' slices must tile (row norms)."""
    key = (eps, stats, hidden_size, check_agreement, num_threads)
    opt = _opts_cache.get(key)
    if opt is None:
        opt = _C.NormOptions(eps=float(eps), stats=_STATS[stats], check_agreement=check_agreement,
                             num_threads=num_threads, hidden_size=int(hidden_size))
        _opts_cache[key] = opt
    return opt


# A DLPack capsule straight from torch's C++ export: Tensor.__dlpack__ refuses a tensor that
# requires grad (so it would need a detach() first) and adds Python-level checks; together
# those cost about as much as the C++ call itself on a small tensor. The capsule views the same
# memory and records nothing for autograd. Without the private entry point: detach().
_to_dlpack = getattr(torch._C, "_to_dlpack", None) or (lambda t: t.detach())


_F32, _F64, _CONTIGUOUS = torch.float32, torch.float64, torch.contiguous_format


_HALVES = (torch.float16, torch.bfloat16)


_EPS32, _EPS64 = torch.finfo(_F32).eps, torch.finfo(_F64).eps


def _d(t):
    """The tensor as the binding takes it (None stays None). The row norms' hot path calls
    _to_dlpack directly on the tensors that cannot be None: at [4, 64] every Python call
    there is a few per cent of the op."""
    return None if t is None else _to_dlpack(t)


def _empty(shape, like, dtype=None):
    """A contiguous tensor on like's device, of like's dtype unless given."""
    return like.new_empty(shape) if dtype is None else like.new_empty(shape, dtype=dtype)


def _like(t):
    """A contiguous tensor of t's shape, dtype and device (never t's strides): empty_like with
    contiguous_format, the cheapest allocation torch has; torch.empty's keyword parsing costs
    about a microsecond more, a tenth of a small call."""
    return torch.empty_like(t, memory_format=_CONTIGUOUS)


def _stats_dtype(x):
    """The dtype of saved statistics: float64 for a float64 input (the float64 kernels round
    nothing to float32, as torch.autograd.gradcheck needs), else float32."""
    return _F64 if x.dtype is _F64 else _F32


def _rows(x):
    return math.prod(x.shape[:-1]) if x.dim() > 0 else 0


def _grad(dy, like):
    """An incoming gradient as a dense tensor (autograd hands out expanded views, or None)."""
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device) if dy is None \
        else dy.contiguous()


def _grads(like, weight, channels, has_bias, bias_dtype=None, channels_last=False):
    """The backward outputs every autograd function here allocates the same way: dx shaped and
    typed like ``like`` (in its channels-last layout with channels_last, else contiguous),
    dweight like ``weight`` (None without one), and dbias of ``channels`` in ``bias_dtype``
    (default ``like``'s; mixed precision keeps bias float32) or None."""
    dx = _like_input(like, channels_last)
    dw = None if weight is None else _like(weight)
    db = _empty((channels,), like, bias_dtype) if has_bias else None
    return dx, dw, db


def _call(fn, comm, *args):
    """fn(comm, *args): one op's C++ call. On a device communicator it follows PyTorch's rules
    for CUDA work (_device_call)."""
    if comm.device == "cpu":
        return fn(comm, *args)
    return _device_call(fn, comm, args)


# Whether a CUDA call checks the device's error word before it returns (TPNORM_DEVICE_ERRORS;
# "deferred": the caller checks with tpnorm.cuda_check_errors when it wants).
_CHECK_DEVICE_ERRORS = os.environ.get("TPNORM_DEVICE_ERRORS", "raise") != "deferred"


def _device_call(fn, comm, args):
    """A call on a device communicator, as torch's own CUDA ops and NCCL process groups behave:
    it runs after the work already on torch's current stream and before the work put there
    after it (the communicator's stream waits for the current one, then the current one for
    it: two events, none when they are the same stream), so the inputs are ready and the
    caching allocator may reuse nothing the call still touches (every tensor of the call was
    allocated on the current stream, which is ordered after the call's work). Then, unless the
    stream is being captured into a CUDA graph, the device's error word is checked, so that a
    call the device rejected (ranks that disagree after the strict calls, slices that do not
    tile) raises the same tpnorm.Error on every rank, its outputs unwritten; that waits for the
    call's stream (TPNORM_DEVICE_ERRORS=deferred leaves the check to the caller)."""
    index = int(comm.device.split(":")[1])
    current = torch.cuda.current_stream(index)
    mine = comm.stream
    if mine == current.cuda_stream:
        out = fn(comm, *args)
    else:
        side = torch.cuda.ExternalStream(mine, device=index) if mine else \
            torch.cuda.default_stream(index)
        side.wait_stream(current)
        out = fn(comm, *args)
        current.wait_stream(side)
    if _CHECK_DEVICE_ERRORS and not comm.capturing:
        _C.cuda_check_errors(comm)
    return out


def row_norm_forward(comm, x, weight, bias, opt, centered):
    """(y, mean, rstd) of LayerNorm (centered) or RMSNorm (mean: None) of hidden-sharded rows."""
    rows, sdt = _rows(x), _stats_dtype(x)
    y = torch.empty_like(x, memory_format=_CONTIGUOUS)
    rstd = x.new_empty((rows,), dtype=sdt)
    if centered:
        mean = x.new_empty((rows,), dtype=sdt)
        _call(_C.layer_norm_forward, comm, _to_dlpack(x), _d(weight), _d(bias), _to_dlpack(y),
                              _to_dlpack(mean), _to_dlpack(rstd), opt)
        return y, mean, rstd
    _call(_C.rms_norm_forward, comm, _to_dlpack(x), _d(weight), _to_dlpack(y), _to_dlpack(rstd), opt)
    return y, None, rstd


def row_norm_backward(comm, dy, x, weight, mean, rstd, opt, centered, has_bias, bias_dtype):
    """(dx, dweight, dbias) of row_norm_forward (None for an absent parameter)."""
    dx, dw, db = _grads(x, weight, x.shape[-1], has_bias, bias_dtype)
    dy = _grad(dy, x)
    if centered:
        _call(_C.layer_norm_backward, comm, _to_dlpack(dy), _to_dlpack(x), _d(weight),
                               _to_dlpack(mean), _to_dlpack(rstd), _to_dlpack(dx), _d(dw),
                               _d(db), opt)
        return dx, dw, db
    _call(_C.rms_norm_backward, comm, _to_dlpack(dy), _to_dlpack(x), _d(weight), _to_dlpack(rstd),
                         _to_dlpack(dx), _d(dw), opt)
    return dx, dw, None


def _load_autograd():
    """(tpnorm._autograd, None) when it was built for the torch running, else (None, why).
    The version is checked before the import: a module built against another torch would load
    that torch's libraries into this process."""
    if os.environ.get("TPNORM_PYTHON_AUTOGRAD", "0") not in ("", "0"):
        return None, "TPNORM_PYTHON_AUTOGRAD is set"
    stamp = os.path.join(os.path.dirname(__file__), "_autograd.torch-version")
    try:
        with open(stamp) as f:
            built = f.read().strip()
    except OSError:
        why = getattr(_build, "AUTOGRAD_NOT_BUILT", "") or "it needs torch's C++ headers"
        return None, f"tpnorm._autograd was not built: {why}"
    if built != torch.__version__:
        return None, f"tpnorm._autograd was built for torch {built}, not {torch.__version__}"
    from . import _autograd
    return _autograd, None


# The command that rebuilds the package against the torch running (docs/python.md, Install).
REBUILD = ("pip install scikit-build-core pybind11 && "
           "pip install -v --no-build-isolation --no-deps --force-reinstall <tpnorm source or sdist>")


def _say_slow_path(reason):
    """Says once per process, on rank 0 (or where no launcher names a rank), that tpnorm's ops
    run through the Python Functions and how to get the C++ path: a silent fallback would cost
    every training step its overhead. Not said when the user chose it (TPNORM_PYTHON_AUTOGRAD)."""
    if reason is None or os.environ.get("TPNORM_PYTHON_AUTOGRAD", "0") not in ("", "0"):
        return
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "0") != "0":
            return
    fix = ("install torch's C++ headers (Debian: libtorch-dev), then rebuild"
           if "C++ headers" in reason else "rebuild against this torch")
    print(f"tpnorm: the ops use the slower Python autograd path ({reason}). To get the "
          f"C++ path, {fix}: {REBUILD}. `python -m tpnorm` shows the build.", file=sys.stderr)


# Every op's eager autograd: C++ (tpnorm._autograd) where it was built for this torch, else
# the Python Functions of tpnorm.functional; CPP_AUTOGRAD says which, CPP_AUTOGRAD_REASON why not.
_autograd, CPP_AUTOGRAD_REASON = _load_autograd()


CPP_AUTOGRAD = _autograd is not None


_say_slow_path(CPP_AUTOGRAD_REASON)


_Tensor = torch.Tensor


_opt_addresses = {}


def _opt_address(eps, stats, hidden):
    """The address of the cached norm_options (alive as long as the process)."""
    key = (eps, stats, hidden)
    a = _opt_addresses.get(key)
    if a is None:
        a = _opt_addresses[key] = _C.address_of(norm_options(eps, stats, hidden))
    return a


def fused_add_norm_forward(comm, x, f, weight, bias, alpha, opt, centered):
    """(h, y, mean, rstd): h = alpha*x + f and y = Norm(h) (mean: None for RMSNorm)."""
    rows = _rows(x)
    h, y = _like(x), _like(x)
    rstd = _empty((rows,), x, _stats_dtype(x))
    mean = _empty((rows,), x, _stats_dtype(x)) if centered else None
    if centered:
        _call(_C.fused_add_layer_norm_forward, comm, _d(x), _d(f), alpha, _d(weight), _d(bias), _d(h),
                                        _d(y), _d(mean), _d(rstd), opt)
    else:
        _call(_C.fused_add_rms_norm_forward, comm, _d(x), _d(f), alpha, _d(weight), _d(h), _d(y),
                                      _d(rstd), opt)
    return h, y, mean, rstd


def fused_add_norm_backward(comm, dh, dy, h, weight, mean, rstd, alpha, opt, centered,
                             has_bias, bias_dtype):
    """(dx, df, dweight, dbias) of fused_add_norm_forward; dh (h's own gradient) may be None."""
    dx, dw, db = _grads(h, weight, h.shape[-1], has_bias, bias_dtype)
    df = _like(h)
    dh = None if dh is None else dh.contiguous()
    if centered:
        _call(_C.fused_add_layer_norm_backward, comm, _d(_grad(dy, h)), _d(dh), _d(h), _d(weight),
                                         _d(mean), _d(rstd), alpha, _d(dx), _d(df), _d(dw),
                                         _d(db), opt)
    else:
        _call(_C.fused_add_rms_norm_backward, comm, _d(_grad(dy, h)), _d(dh), _d(h), _d(weight),
                                       _d(rstd), alpha, _d(dx), _d(df), _d(dw), opt)
    return dx, df, dw, db


def group_norm_forward(comm, x, weight, bias, cg, opt, instance):
    """(y, mean, rstd) of GroupNorm / InstanceNorm on [N, C_local, *spatial]."""
    groups = cg.channels if instance else cg.groups
    y = _like(x)
    mean = _empty((x.shape[0], groups), x, _stats_dtype(x))
    rstd = _empty((x.shape[0], groups), x, _stats_dtype(x))
    _call(_C.group_norm_forward, comm, _d(x), cg, _d(weight), _d(bias), _d(y), _d(mean), _d(rstd), opt,
                          instance)
    return y, mean, rstd


def group_norm_backward(comm, dy, x, weight, mean, rstd, cg, opt, instance, has_bias):
    dx, dw, db = _grads(x, weight, x.shape[1], has_bias)
    _call(_C.group_norm_backward, comm, _d(_grad(dy, x)), _d(x), cg, _d(weight), _d(mean), _d(rstd),
                           _d(dx), _d(dw), _d(db), opt, instance)
    return dx, dw, db


def rms_norm_gated_forward(comm, x, z, weight, gg, opt):
    """(y, rstd) of the gated RMSNorm on [rows..., c_local]; rstd is [rows, groups]."""
    y = _like(x)
    rstd = _empty((_rows(x), _gated_groups_count(x, gg)), x, _stats_dtype(x))
    _call(_C.rms_norm_gated_forward, comm, _d(x), _d(z), gg, _d(weight), _d(y), _d(rstd), opt)
    return y, rstd


def rms_norm_gated_backward(comm, dy, x, z, weight, rstd, gg, opt):
    """(dx, dz, dweight) of rms_norm_gated_forward (None for an absent gate or weight)."""
    dx, dw, _ = _grads(x, weight, 0, False)
    dz = None if z is None else _like(z)
    _call(_C.rms_norm_gated_backward, comm, _d(_grad(dy, x)), _d(x), _d(z), gg, _d(weight), _d(rstd),
                               _d(dx), _d(dz), _d(dw), opt)
    return dx, dz, dw


def _gated_groups_count(x, gg):
    """Groups of the whole row (every rank's rstd holds all of them); 0 for a grouping the
    op refuses, which it then reports on every rank."""
    hidden = x.shape[-1] if gg.hidden < 0 else gg.hidden
    size = hidden if gg.group_size < 0 else gg.group_size
    return hidden // size if size > 0 and hidden % size == 0 else 0


def gated_inputs(x, z, weight):
    """(x, z, weight, out_dtype) as the gated kernels take them. transformers' and mamba_ssm's
    gated norms take x and the gate in different dtypes (in a bf16 Mamba-2, the scan's float32
    output next to in_proj's bf16 gate) and compute in float32; so does tpnorm: both go to the
    wider dtype (an exact cast), the weight too where the kernels would not take it next to
    that, and the output comes back in x's dtype (out_dtype; None when nothing was cast)."""
    if z is None or z.dtype == x.dtype:
        return x, z, weight, None
    wide = torch.promote_types(x.dtype, z.dtype)
    if weight is not None and weight.dtype != wide and \
            not (weight.dtype is _F32 and wide in _HALVES):
        weight = weight.to(wide)
    return x.to(wide), z.to(wide), weight, x.dtype


def _channels_last(x):
    """Whether x runs channels-last: by the strides (stride 1 on C), not by is_contiguous(),
    under which an empty batch is "contiguous" in every format. The ranks need not agree: each
    sends the same per-channel sums whichever layout its batch has."""
    if x.dim() in (4, 5) and x.stride(1) == 1 and x.shape[1] > 1:
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return x.is_contiguous(memory_format=fmt)
    return False


def _to_last(t):
    """The [N, *spatial, C] view of a channels-last [N, C, *spatial] tensor (contiguous)."""
    return t.permute(0, *range(2, t.dim()), 1)


def _like_input(x, channels_last):
    """An output shaped like x, in x's layout: a tensor of its own, never a view of another
    (autograd refuses in-place ops on a view made inside a Function, and a user's ReLU(inplace)
    or `out += identity` runs on it). Channels-last: x's own strides, whose _to_last view is the
    kernel's contiguous NHWC buffer (x is channels-last contiguous, hence dense)."""
    return torch.empty_like(x) if channels_last else _like(x)


def sync_batch_norm_forward(comm, x, weight, bias, running_mean, running_var, opt,
                             channels_last):
    """(y, save_mean, save_invstd); running statistics updated in place in training."""
    C = x.shape[1]
    y = _like_input(x, channels_last)
    xv, yv = (_to_last(x), _to_last(y)) if channels_last else (x, y)
    save_mean, save_invstd = _empty((C,), x, _stats_dtype(x)), _empty((C,), x, _stats_dtype(x))
    _call(_C.sync_batch_norm_forward, comm, _d(xv), _d(weight), _d(bias), _d(running_mean),
                               _d(running_var), _d(yv), _d(save_mean), _d(save_invstd), opt)
    return y, save_mean, save_invstd


def sync_batch_norm_backward(comm, dy, x, weight, save_mean, save_invstd, opt, channels_last,
                              has_bias, bias_dtype):
    dx, dw, db = _grads(x, weight, x.shape[1], has_bias, bias_dtype, channels_last)
    dxv = dx
    if channels_last:
        x, dy, dxv = _to_last(x), None if dy is None else _to_last(dy), _to_last(dx)
    _call(_C.sync_batch_norm_backward, comm, _d(_grad(dy, x)), _d(x), _d(weight), _d(save_mean),
                                _d(save_invstd), _d(dxv), _d(dw), _d(db), opt)
    return dx, dw, db


_LAYOUT = {False: _C.Layout.NCHW, True: _C.Layout.CHANNELS_LAST}


# --- K row norms in one collective (tpnorm.batched) ---------------------------------------
def batched_forward(comm, xs, ws, bs, centered, hidden, opt):
    """(ys, means, rstds) of the K items (plain contiguous tensors), one collective; hidden:
    each item's whole hidden size (0: not checked)."""
    items, ys, means, rstds = [], [], [], []
    for x, w, b, c, n in zip(xs, ws, bs, centered, hidden):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        sdt = _stats_dtype(x)
        rstd = x.new_empty((_rows(x),), dtype=sdt)
        mean = x.new_empty((_rows(x),), dtype=sdt) if c else None
        items.append((c, _to_dlpack(x), _d(w), _d(b), _to_dlpack(y), _d(mean),
                      _to_dlpack(rstd), int(n)))
        ys.append(y)
        means.append(mean)
        rstds.append(rstd)
    _call(_C.batched_norm_forward, comm, items, opt)
    return ys, means, rstds


def batched_backward(comm, dys, xs, ws, bias_dtypes, means, rstds, centered, hidden, opt):
    """(dxs, dws, dbs) of _forward's items (None for an absent parameter), one collective;
    bias_dtypes[i] is None when item i has no bias."""
    items, grads = [], ([], [], [])
    for dy, x, w, bdt, mean, rstd, c, n in zip(dys, xs, ws, bias_dtypes, means, rstds, centered,
                                               hidden):
        dx, dw, db = _grads(x, w, x.shape[-1], bdt is not None, bdt)
        dy = _grad(dy, x)
        items.append((c, _to_dlpack(dy), _to_dlpack(x), _d(w), _d(mean),
                      _to_dlpack(rstd), _to_dlpack(dx), _d(dw), _d(db), int(n)))
        for out, t in zip(grads, (dx, dw, db)):
            out.append(t)
    _call(_C.batched_norm_backward, comm, items, opt)
    return grads


# --- the Python autograd Functions: the eager path where tpnorm._autograd was not built ------
class _RowNorm(torch.autograd.Function):
    """LayerNorm (centered) or RMSNorm over the hidden dimension sharded across comm; ``call``
    is (comm, opt, centered), one argument so that apply and ctx carry one object."""

    @staticmethod
    def forward(ctx, x, weight, bias, call):
        y, mean, rstd = row_norm_forward(call[0], x, weight, bias, call[1], call[2])
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.call, ctx.bias_dtype = call, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        comm, opt, centered = ctx.call
        bias_dtype = ctx.bias_dtype
        dx, dw, db = row_norm_backward(comm, dy, x, weight, mean, rstd, opt, centered,
                                        bias_dtype is not None, bias_dtype)
        return dx, dw, db, None


class _FusedAddNorm(torch.autograd.Function):
    """h = alpha * x + f; y = Norm(h); returns (h, y). h's own gradient joins as dh_extra."""

    @staticmethod
    def forward(ctx, x, f, weight, bias, alpha, comm, opt, centered):
        h, y, mean, rstd = fused_add_norm_forward(comm, x, f, weight, bias, alpha, opt,
                                                   centered)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.alpha, ctx.comm, ctx.opt, ctx.centered = alpha, comm, opt, centered
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight, mean, rstd = ctx.saved_tensors
        dx, df, dw, db = fused_add_norm_backward(ctx.comm, dh, dy, h, weight, mean, rstd,
                                                  ctx.alpha, ctx.opt, ctx.centered,
                                                  ctx.has_bias, ctx.bias_dtype)
        return dx, df, dw, db, None, None, None, None


class _GroupNorm(torch.autograd.Function):
    """GroupNorm / InstanceNorm on [N, C_local, *spatial], channels sharded over comm."""

    @staticmethod
    def forward(ctx, x, weight, bias, cg, comm, opt, instance):
        y, mean, rstd = group_norm_forward(comm, x, weight, bias, cg, opt, instance)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.cg, ctx.comm, ctx.opt, ctx.instance = cg, comm, opt, instance
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = group_norm_backward(ctx.comm, dy, x, weight, mean, rstd, ctx.cg, ctx.opt,
                                          ctx.instance, ctx.has_bias)
        return dx, dw, db, None, None, None, None


class _RMSNormGated(torch.autograd.Function):
    """Gated RMSNorm over channels sharded across comm: y from x, the gate z (or None) and
    weight; ``call`` is (comm, gated groups, opt)."""

    @staticmethod
    def forward(ctx, x, z, weight, call):
        comm, gg, opt = call
        y, rstd = rms_norm_gated_forward(comm, x, z, weight, gg, opt)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        comm, gg, opt = ctx.call
        dx, dz, dw = rms_norm_gated_backward(comm, dy, x, z, weight, rstd, gg, opt)
        return dx, dz, dw, None


class _SyncBatchNorm(torch.autograd.Function):
    """Batch statistics over the global batch (ranks may hold different N, including 0)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, comm, opt, channels_last):
        y, save_mean, save_invstd = sync_batch_norm_forward(
            comm, x, weight, bias, running_mean, running_var, opt, channels_last)
        ctx.save_for_backward(x, weight, save_mean, save_invstd)
        ctx.comm, ctx.opt, ctx.channels_last = comm, opt, channels_last
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype  # fp32 next to fp16/bf16 x too
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, save_mean, save_invstd = ctx.saved_tensors
        dx, dw, db = sync_batch_norm_backward(ctx.comm, dy, x, weight, save_mean, save_invstd,
                                               ctx.opt, ctx.channels_last, ctx.has_bias,
                                               ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


class _BatchedRowNorm(torch.autograd.Function):
    """K row norms, one collective each way, in eager mode. ``call`` = (comm, opt, centered
    per item, hidden size per item, K); tensors = x_0, w_0, b_0, x_1, w_1, b_1, ... (plain
    local tensors)."""

    @staticmethod
    def forward(ctx, call, *tensors):
        comm, opt, centered, hidden, k = call
        xs = [tensors[3 * i].contiguous() for i in range(k)]
        ws = [tensors[3 * i + 1] for i in range(k)]
        bs = [tensors[3 * i + 2] for i in range(k)]
        ys, means, rstds = batched_forward(comm, xs, ws, bs, centered, hidden, opt)
        ctx.save_for_backward(*xs, *ws, *means, *rstds)
        ctx.call = call
        ctx.bias_dtypes = [None if b is None else b.dtype for b in bs]
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        comm, opt, centered, hidden, k = ctx.call
        t = ctx.saved_tensors
        dxs, dws, dbs = batched_backward(comm, dys, t[:k], t[k:2 * k], ctx.bias_dtypes,
                                  t[2 * k:3 * k], t[3 * k:], centered, hidden, opt)
        return (None,) + tuple(g for i in range(k) for g in (dxs[i], dws[i], dbs[i]))
