"""Autograd functions and functional forms of tpnorm's ops.

The functional forms take torch.nn.functional's arguments in its order, then keyword-only
``process_group`` (anything ``tpnorm.as_communicator`` accepts; None: the default
torch.distributed group when one is initialised, else one process) and ``stats``. Each makes
exactly the collectives of the C++ call: ONE all_reduce_sum per forward and per backward
(SyncBatchNorm in eval: none). Tensors cross into C++ through DLPack without a copy; inputs
must be contiguous (row-major), outputs are allocated here. Saved statistics are float32 (float64 next to a float64 input).
Every rank must make the same calls in the same order, backward included.
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
from .comm import address_of, as_communicator

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


def _row_norm_forward(comm, x, weight, bias, opt, centered):
    """(y, mean, rstd) of LayerNorm (centered) or RMSNorm (mean: None) of hidden-sharded rows."""
    rows, sdt = _rows(x), _stats_dtype(x)
    y = torch.empty_like(x, memory_format=_CONTIGUOUS)
    rstd = x.new_empty((rows,), dtype=sdt)
    if centered:
        mean = x.new_empty((rows,), dtype=sdt)
        _C.layer_norm_forward(comm, _to_dlpack(x), _d(weight), _d(bias), _to_dlpack(y),
                              _to_dlpack(mean), _to_dlpack(rstd), opt)
        return y, mean, rstd
    _C.rms_norm_forward(comm, _to_dlpack(x), _d(weight), _to_dlpack(y), _to_dlpack(rstd), opt)
    return y, None, rstd


def _row_norm_backward(comm, dy, x, weight, mean, rstd, opt, centered, has_bias, bias_dtype):
    """(dx, dweight, dbias) of _row_norm_forward (None for an absent parameter)."""
    dx, dw, db = _grads(x, weight, x.shape[-1], has_bias, bias_dtype)
    dy = _grad(dy, x)
    if centered:
        _C.layer_norm_backward(comm, _to_dlpack(dy), _to_dlpack(x), _d(weight),
                               _to_dlpack(mean), _to_dlpack(rstd), _to_dlpack(dx), _d(dw),
                               _d(db), opt)
        return dx, dw, db
    _C.rms_norm_backward(comm, _to_dlpack(dy), _to_dlpack(x), _d(weight), _to_dlpack(rstd),
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
    """Says once per process, on rank 0 (or where no launcher names a rank), that the row norms
    run through the Python Functions and how to get the C++ path: a silent fallback would cost
    every training step its overhead. Not said when the user chose it (TPNORM_PYTHON_AUTOGRAD)."""
    if reason is None or os.environ.get("TPNORM_PYTHON_AUTOGRAD", "0") not in ("", "0"):
        return
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "0") != "0":
            return
    fix = ("install torch's C++ headers (Debian: libtorch-dev), then rebuild"
           if "C++ headers" in reason else "rebuild against this torch")
    print(f"tpnorm: the row norms use the slower Python autograd path ({reason}). To get the "
          f"C++ path, {fix}: {REBUILD}. `python -m tpnorm` shows the build.", file=sys.stderr)


# The row norms' eager autograd: C++ (tpnorm._autograd) where it was built for this torch, else
# the Python Function _RowNorm below; CPP_AUTOGRAD says which, CPP_AUTOGRAD_REASON why not.
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


class _RowNorm(torch.autograd.Function):
    """LayerNorm (centered) or RMSNorm over the hidden dimension sharded across comm; ``call``
    is (comm, opt, centered), one argument so that apply and ctx carry one object."""

    @staticmethod
    def forward(ctx, x, weight, bias, call):
        y, mean, rstd = _row_norm_forward(call[0], x, weight, bias, call[1], call[2])
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.call, ctx.bias_dtype = call, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        comm, opt, centered = ctx.call
        bias_dtype = ctx.bias_dtype
        dx, dw, db = _row_norm_backward(comm, dy, x, weight, mean, rstd, opt, centered,
                                        bias_dtype is not None, bias_dtype)
        return dx, dw, db, None


def _row_shape(x, normalized_shape, eps):
    """(hidden size, x and the parameters' flattening, eps) of a row norm over the trailing
    dims normalized_shape (the last one sharded): rows are x's leading dims."""
    k = len(normalized_shape)
    hidden = normalized_shape[0] if k == 1 else math.prod(normalized_shape)
    if eps is None:  # torch.nn.RMSNorm's default: the epsilon of its compute type
        eps = _EPS64 if x.dtype is _F64 else _EPS32
    return k, hidden, eps


def _flat(t, k):
    return t if t is None or k == 1 else t.flatten(-k)


def _row_norm(x, normalized_shape, weight, bias, comm, eps, stats, centered, handle=None):
    """The row norm through the torch.library op while torch.compile traces, else through
    tpnorm._autograd (plain tensors) or the autograd Function (``handle``: the module's,
    looked up when None)."""
    k, hidden, eps = _row_shape(x, normalized_shape, eps)
    shape, x = x.shape, _flat(x, k)
    weight, bias = _flat(weight, k), _flat(bias, k)
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        y = _lib.row_norm(x, weight, bias, h, float(eps), stats, centered, hidden)[0]
    elif _autograd is not None and type(x) is _Tensor:
        y = _autograd.row_norm(x, weight, bias, address_of(comm),
                               _opt_address(eps, stats, hidden), centered)
    else:
        y = _RowNorm.apply(x, weight, bias, (comm, norm_options(eps, stats, hidden), centered))
    return y if k == 1 else y.view(shape)


def _shape_arg(normalized_shape):
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, process_group=None,
               stats="robust"):
    """F.layer_norm with the last dimension of ``normalized_shape`` (the full, unsharded
    shape) sharded over ``process_group``: input is [..., *normalized_shape[:-1], local],
    weight / bias this rank's slices of that shape. Every rank checks that the slices tile
    normalized_shape[-1] (the same error on every rank otherwise)."""
    return _row_norm(input, _shape_arg(normalized_shape), weight, bias,
                     as_communicator(process_group), eps, stats, True)


def rms_norm(input, normalized_shape, weight=None, eps=None, *, process_group=None,
             stats="robust"):
    """F.rms_norm (y = x / sqrt(mean(x^2) + eps) * weight; eps None as torch's: the epsilon of
    float32, the compute type of float32/float16/bfloat16) with normalized_shape's last
    dimension sharded, as layer_norm."""
    return _row_norm(input, _shape_arg(normalized_shape), weight, None,
                     as_communicator(process_group), eps, stats, False)


def _fused_add_norm_forward(comm, x, f, weight, bias, alpha, opt, centered):
    """(h, y, mean, rstd): h = alpha*x + f and y = Norm(h) (mean: None for RMSNorm)."""
    rows = _rows(x)
    h, y = _like(x), _like(x)
    rstd = _empty((rows,), x, _stats_dtype(x))
    mean = _empty((rows,), x, _stats_dtype(x)) if centered else None
    if centered:
        _C.fused_add_layer_norm_forward(comm, _d(x), _d(f), alpha, _d(weight), _d(bias), _d(h),
                                        _d(y), _d(mean), _d(rstd), opt)
    else:
        _C.fused_add_rms_norm_forward(comm, _d(x), _d(f), alpha, _d(weight), _d(h), _d(y),
                                      _d(rstd), opt)
    return h, y, mean, rstd


def _fused_add_norm_backward(comm, dh, dy, h, weight, mean, rstd, alpha, opt, centered,
                             has_bias, bias_dtype):
    """(dx, df, dweight, dbias) of _fused_add_norm_forward; dh (h's own gradient) may be None."""
    dx, dw, db = _grads(h, weight, h.shape[-1], has_bias, bias_dtype)
    df = _like(h)
    dh = None if dh is None else dh.contiguous()
    if centered:
        _C.fused_add_layer_norm_backward(comm, _d(_grad(dy, h)), _d(dh), _d(h), _d(weight),
                                         _d(mean), _d(rstd), alpha, _d(dx), _d(df), _d(dw),
                                         _d(db), opt)
    else:
        _C.fused_add_rms_norm_backward(comm, _d(_grad(dy, h)), _d(dh), _d(h), _d(weight),
                                       _d(rstd), alpha, _d(dx), _d(df), _d(dw), opt)
    return dx, df, dw, db


class _FusedAddNorm(torch.autograd.Function):
    """h = alpha * x + f; y = Norm(h); returns (h, y). h's own gradient joins as dh_extra."""

    @staticmethod
    def forward(ctx, x, f, weight, bias, alpha, comm, opt, centered):
        h, y, mean, rstd = _fused_add_norm_forward(comm, x, f, weight, bias, alpha, opt,
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
        dx, df, dw, db = _fused_add_norm_backward(ctx.comm, dh, dy, h, weight, mean, rstd,
                                                  ctx.alpha, ctx.opt, ctx.centered,
                                                  ctx.has_bias, ctx.bias_dtype)
        return dx, df, dw, db, None, None, None, None


def _fused_add_norm(x, f, normalized_shape, weight, bias, alpha, comm, eps, stats, centered,
                    handle=None):
    """(h, y) as _row_norm dispatches."""
    k, hidden, eps = _row_shape(x, normalized_shape, eps)
    shape, x, f = x.shape, _flat(x, k), _flat(f, k)
    weight, bias = _flat(weight, k), _flat(bias, k)
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        out = _lib.fused_add_norm(x, f, weight, bias, float(alpha), h, float(eps), stats,
                                  centered, hidden)
        h, y = out[0], out[1]
    else:
        h, y = _FusedAddNorm.apply(x, f, weight, bias, float(alpha), comm,
                                   norm_options(eps, stats, hidden), centered)
    return (h, y) if k == 1 else (h.view(shape), y.view(shape))


def fused_add_layer_norm(x, f, normalized_shape, weight=None, bias=None, alpha=1.0, eps=1e-5, *,
                         process_group=None, stats="robust"):
    """(h, y) with h = alpha*x + f (the new residual stream) and y = layer_norm(h,
    normalized_shape, weight, bias, eps), in one pass and one collective. alpha = 1: Pre-LN /
    Post-LN; DeepNorm: deepnorm_alpha(stack, N, M)."""
    return _fused_add_norm(x, f, _shape_arg(normalized_shape), weight, bias, alpha,
                           as_communicator(process_group), eps, stats, True)


def fused_add_rms_norm(x, f, normalized_shape, weight=None, alpha=1.0, eps=None, *,
                       process_group=None, stats="robust"):
    """(h, y) with h = alpha*x + f and y = rms_norm(h, normalized_shape, weight, eps)."""
    return _fused_add_norm(x, f, _shape_arg(normalized_shape), weight, None, alpha,
                           as_communicator(process_group), eps, stats, False)


_STACKS = {"encoder_only": _C.DeepNormStack.ENCODER_ONLY,
           "decoder_only": _C.DeepNormStack.DECODER_ONLY,
           "encoder_of_encoder_decoder": _C.DeepNormStack.ENCODER_OF_ENCODER_DECODER,
           "decoder_of_encoder_decoder": _C.DeepNormStack.DECODER_OF_ENCODER_DECODER}


def deepnorm_alpha(stack, encoder_layers=0, decoder_layers=0):
    """DeepNorm's residual scale for one of DeepNet's presets (``stack`` in "encoder_only",
    "decoder_only", "encoder_of_encoder_decoder", "decoder_of_encoder_decoder"), e.g.
    deepnorm_alpha("encoder_only", N) = (2N)^(1/4)."""
    return _C.deepnorm_alpha(_STACKS[stack], encoder_layers, decoder_layers)


def deepnorm_beta(stack, encoder_layers=0, decoder_layers=0):
    """DeepNorm's initialisation gain for the same presets (scales the Xavier-initialised
    feed-forward, value and output projections)."""
    return _C.deepnorm_beta(_STACKS[stack], encoder_layers, decoder_layers)


def _group_norm_forward(comm, x, weight, bias, cg, opt, instance):
    """(y, mean, rstd) of GroupNorm / InstanceNorm on [N, C_local, *spatial]."""
    groups = cg.channels if instance else cg.groups
    y = _like(x)
    mean = _empty((x.shape[0], groups), x, _stats_dtype(x))
    rstd = _empty((x.shape[0], groups), x, _stats_dtype(x))
    _C.group_norm_forward(comm, _d(x), cg, _d(weight), _d(bias), _d(y), _d(mean), _d(rstd), opt,
                          instance)
    return y, mean, rstd


def _group_norm_backward(comm, dy, x, weight, mean, rstd, cg, opt, instance, has_bias):
    dx, dw, db = _grads(x, weight, x.shape[1], has_bias)
    _C.group_norm_backward(comm, _d(_grad(dy, x)), _d(x), cg, _d(weight), _d(mean), _d(rstd),
                           _d(dx), _d(dw), _d(db), opt, instance)
    return dx, dw, db


class _GroupNorm(torch.autograd.Function):
    """GroupNorm / InstanceNorm on [N, C_local, *spatial], channels sharded over comm."""

    @staticmethod
    def forward(ctx, x, weight, bias, cg, comm, opt, instance):
        y, mean, rstd = _group_norm_forward(comm, x, weight, bias, cg, opt, instance)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.cg, ctx.comm, ctx.opt, ctx.instance = cg, comm, opt, instance
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _group_norm_backward(ctx.comm, dy, x, weight, mean, rstd, ctx.cg, ctx.opt,
                                          ctx.instance, ctx.has_bias)
        return dx, dw, db, None, None, None, None


def shard_range(total, rank, size):
    """[start, stop) of this rank's part of ``total`` split over ``size`` ranks as evenly as
    possible (the first ranks may get one less; some may get none when total < size)."""
    return total * rank // size, total * (rank + 1) // size


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *, process_group=None,
               num_channels=None, channel_offset=None, stats="robust"):
    """F.group_norm over channels sharded across ``process_group``: input is
    [N, C_local, *spatial] holding channels [channel_offset, channel_offset + C_local) of
    ``num_channels``. Without channel_offset the split is shard_range(num_channels, rank,
    size); without num_channels the channels are not sharded (C_local is all of them)."""
    comm = as_communicator(process_group)
    cg = _channel_groups(input, num_groups, comm, num_channels, channel_offset)
    return _group_norm(input, weight, bias, cg, comm, eps, stats, False)


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5, *, process_group=None,
                  num_channels=None, channel_offset=None, stats="robust"):
    """F.instance_norm with channels sharded as in group_norm. Batch statistics only: running
    statistics (or use_input_stats=False) are an error. One channel per group, so a group
    never spans ranks."""
    if running_mean is not None or running_var is not None or not use_input_stats:
        raise ValueError("tpnorm.instance_norm keeps no running statistics: pass "
                         "running_mean=None, running_var=None, use_input_stats=True")
    comm = as_communicator(process_group)
    cg = _channel_groups(input, 1, comm, num_channels, channel_offset)
    return _group_norm(input, weight, bias, cg, comm, eps, stats, True)


def _group_norm(x, weight, bias, cg, comm, eps, stats, instance, handle=None):
    """GroupNorm / InstanceNorm as _row_norm dispatches; cg: (groups, channels, offset)."""
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        return _lib.group_norm(x, weight, bias, *cg, h, float(eps), stats, instance)[0]
    cg = _C.ChannelGroups(groups=cg[0], channels=cg[1], channel_offset=cg[2])
    return _GroupNorm.apply(x, weight, bias, cg, comm, norm_options(eps, stats), instance)


def _channel_groups(x, groups, comm, channels, offset):
    if channels is None:
        channels = x.shape[1] if offset is None else -1
    if offset is None:
        offset = shard_range(channels, comm.rank, comm.size)[0] if channels >= 0 else 0
    if channels >= 0 and comm.size == 1:
        offset = 0
    return groups, channels, offset


def _rms_norm_gated_forward(comm, x, z, weight, gg, opt):
    """(y, rstd) of the gated RMSNorm on [rows..., c_local]; rstd is [rows, groups]."""
    y = _like(x)
    rstd = _empty((_rows(x), _gated_groups_count(x, gg)), x, _stats_dtype(x))
    _C.rms_norm_gated_forward(comm, _d(x), _d(z), gg, _d(weight), _d(y), _d(rstd), opt)
    return y, rstd


def _rms_norm_gated_backward(comm, dy, x, z, weight, rstd, gg, opt):
    """(dx, dz, dweight) of _rms_norm_gated_forward (None for an absent gate or weight)."""
    dx, dw, _ = _grads(x, weight, 0, False)
    dz = None if z is None else _like(z)
    _C.rms_norm_gated_backward(comm, _d(_grad(dy, x)), _d(x), _d(z), gg, _d(weight), _d(rstd),
                               _d(dx), _d(dz), _d(dw), opt)
    return dx, dz, dw


def _gated_groups_count(x, gg):
    """Groups of the whole row (every rank's rstd holds all of them); 0 for a grouping the
    op refuses, which it then reports on every rank."""
    hidden = x.shape[-1] if gg.hidden < 0 else gg.hidden
    size = hidden if gg.group_size < 0 else gg.group_size
    return hidden // size if size > 0 and hidden % size == 0 else 0


class _RMSNormGated(torch.autograd.Function):
    """Gated RMSNorm over channels sharded across comm: y from x, the gate z (or None) and
    weight; ``call`` is (comm, gated groups, opt)."""

    @staticmethod
    def forward(ctx, x, z, weight, call):
        comm, gg, opt = call
        y, rstd = _rms_norm_gated_forward(comm, x, z, weight, gg, opt)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        comm, gg, opt = ctx.call
        dx, dz, dw = _rms_norm_gated_backward(comm, dy, x, z, weight, rstd, gg, opt)
        return dx, dz, dw, None


def rms_norm_gated(input, weight=None, gate=None, eps=1e-5, *, group_size=None,
                   norm_before_gate=False, hidden_size=None, offset=None, process_group=None,
                   stats="robust"):
    """Mamba-2's gated RMSNorm over the last dimension, sharded across ``process_group``:

        norm_before_gate=False (Mamba-2, transformers' MambaRMSNormGated):
            y = rmsnorm(x * silu(gate)) * weight
        norm_before_gate=True:   y = rmsnorm(x) * weight * silu(gate)

    with statistics per group of ``group_size`` channels of the full last dimension (None: one
    group, the whole row; groups may span ranks). input and gate are [..., local]: this rank's
    channels [offset, offset + local) of ``hidden_size``; without offset the split is
    shard_range(hidden_size, rank, size); without hidden_size the channels are not sharded.
    gate None: no gate (a grouped RMSNorm). weight: this rank's [local] slice, the input's dtype
    or float32 next to float16/bfloat16. One collective per forward and per backward."""
    comm = as_communicator(process_group)
    hidden, offset = _gated_shard(input, comm, hidden_size, offset)
    return _rms_norm_gated(input, gate, weight, -1 if group_size is None else int(group_size),
                           hidden, offset, bool(norm_before_gate), comm, eps, stats)


def _gated_shard(x, comm, hidden, offset):
    """(hidden, offset) as group_norm's _channel_groups: -1 hidden is this rank's channels."""
    if hidden is None:
        hidden = x.shape[-1] if offset is None else -1
    if offset is None:
        offset = shard_range(hidden, comm.rank, comm.size)[0] if hidden >= 0 else 0
    if hidden >= 0 and comm.size == 1:
        offset = 0
    return int(hidden), int(offset)


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


def _rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, comm, eps, stats,
                    handle=None):
    """The gated RMSNorm as _row_norm dispatches: the torch.library op while torch.compile
    traces, else the autograd Function; x and z of different dtypes as gated_inputs says."""
    x, z, weight, out = gated_inputs(x, z, weight)
    if out is not None:
        return _rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, comm,
                               eps, stats, handle).to(out)
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        return _lib.rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, h,
                                   float(eps), stats)[0]
    gg = _C.GatedGroups(group_size=group_size, hidden=hidden, offset=offset,
                        norm_before_gate=norm_before_gate)
    if z is not None:
        z = z.contiguous()
    return _RMSNormGated.apply(x.contiguous(), z, weight, (comm, gg, norm_options(eps, stats)))


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


def _sync_batch_norm_forward(comm, x, weight, bias, running_mean, running_var, opt,
                             channels_last):
    """(y, save_mean, save_invstd); running statistics updated in place in training."""
    C = x.shape[1]
    y = _like_input(x, channels_last)
    xv, yv = (_to_last(x), _to_last(y)) if channels_last else (x, y)
    save_mean, save_invstd = _empty((C,), x, _stats_dtype(x)), _empty((C,), x, _stats_dtype(x))
    _C.sync_batch_norm_forward(comm, _d(xv), _d(weight), _d(bias), _d(running_mean),
                               _d(running_var), _d(yv), _d(save_mean), _d(save_invstd), opt)
    return y, save_mean, save_invstd


def _sync_batch_norm_backward(comm, dy, x, weight, save_mean, save_invstd, opt, channels_last,
                              has_bias, bias_dtype):
    dx, dw, db = _grads(x, weight, x.shape[1], has_bias, bias_dtype, channels_last)
    dxv = dx
    if channels_last:
        x, dy, dxv = _to_last(x), None if dy is None else _to_last(dy), _to_last(dx)
    _C.sync_batch_norm_backward(comm, _d(_grad(dy, x)), _d(x), _d(weight), _d(save_mean),
                                _d(save_invstd), _d(dxv), _d(dw), _d(db), opt)
    return dx, dw, db


class _SyncBatchNorm(torch.autograd.Function):
    """Batch statistics over the global batch (ranks may hold different N, including 0)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, comm, opt, channels_last):
        y, save_mean, save_invstd = _sync_batch_norm_forward(
            comm, x, weight, bias, running_mean, running_var, opt, channels_last)
        ctx.save_for_backward(x, weight, save_mean, save_invstd)
        ctx.comm, ctx.opt, ctx.channels_last = comm, opt, channels_last
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype  # fp32 next to fp16/bf16 x too
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, save_mean, save_invstd = ctx.saved_tensors
        dx, dw, db = _sync_batch_norm_backward(ctx.comm, dy, x, weight, save_mean, save_invstd,
                                               ctx.opt, ctx.channels_last, ctx.has_bias,
                                               ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


_LAYOUT = {False: _C.Layout.NCHW, True: _C.Layout.CHANNELS_LAST}


def sync_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                    momentum=0.1, eps=1e-5, *, process_group=None, stats="robust", handle=None):
    """F.batch_norm with statistics over the batch of every rank of ``process_group``.

    running_mean / running_var: [C] buffers updated in place in training (or None), float32 or
    float64 (float16/bfloat16 buffers, as a .half() module has, go through float32 copies).
    weight / bias: x's dtype, or float32 next to a float16/bfloat16 x (mixed precision, CPU).
    momentum: a float (None is the caller's cumulative average: pass 1/num_batches_tracked).
    Training with running statistics absent, or eval without them, uses batch statistics.
    A 4-D/5-D x in torch.channels_last(_3d) memory format (stride 1 on C) runs channels-last.
    An empty x of another dtype than the parameters is taken as theirs (torch allows the mix
    for an empty input); the empty output keeps x's dtype.
    """
    x = input
    param = weight if weight is not None else bias
    if x.numel() == 0 and param is not None and x.dtype != param.dtype and \
            not (param.dtype is _F32 and x.dtype in _HALVES):
        y = sync_batch_norm(x.to(param.dtype), running_mean, running_var, weight, bias,
                            training, momentum, eps, process_group=process_group, stats=stats,
                            handle=handle)
        return y.to(x.dtype)
    if running_mean is not None and running_mean.dtype in _HALVES:
        rm, rv = running_mean.float(), running_var.float()
        y = sync_batch_norm(x, rm, rv, weight, bias, training, momentum, eps,
                            process_group=process_group, stats=stats, handle=handle)
        if training:  # after an accepted call only: a failed one raised above
            running_mean.copy_(rm)
            running_var.copy_(rv)
        return y
    comm = as_communicator(process_group)
    bn_training = training or running_mean is None
    momentum = math.nan if momentum is None else float(momentum)
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        y, _, _, rm, rv = _lib.sync_batch_norm(x, weight, bias, running_mean, running_var, h,
                                               bn_training, momentum, float(eps), stats)
        if training and running_mean is not None:
            running_mean.copy_(rm)
            running_var.copy_(rv)
        return y
    channels_last = _channels_last(x)
    opt = _C.BatchNormOptions(eps=eps, momentum=momentum,
                              training=bn_training, layout=_LAYOUT[channels_last],
                              stats=_STATS[stats])
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, comm, opt,
                                channels_last)


from . import library as _lib  # noqa: E402 (the ops call back into this module)
