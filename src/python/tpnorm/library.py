"""tpnorm's ops as torch.library custom ops, for torch.compile (torch >= 2.4; with an older
torch, e.g. 1.13, nothing is registered and AVAILABLE is False).

Ops (namespace ``tpnorm``), each with a fake implementation (shapes only) and, for the
forward ones, registered autograd whose backward is the matching ``*_backward`` op:

  tpnorm::row_norm(x, weight?, bias?, handle, eps, stats, centered, hidden_size)
      -> (y, mean, rstd)
  tpnorm::fused_add_norm(x, f, weight?, bias?, alpha, handle, eps, stats, centered,
      hidden_size) -> (h, y, mean, rstd)
  tpnorm::group_norm(x, weight?, bias?, groups, channels, channel_offset, handle, eps, stats,
      instance) -> (y, mean, rstd)
  tpnorm::sync_batch_norm(x, weight?, bias?, running_mean?, running_var?, handle, training,
      momentum, eps, stats) -> (y, save_mean, save_invstd, new running_mean, new running_var)
  tpnorm::rms_norm_gated(x, z?, weight?, group_size, hidden, offset, norm_before_gate, handle,
      eps, stats) -> (y, rstd)
  tpnorm::batched_row_norm(xs, params, has_weight, has_bias, centered, hidden, handle, eps,
                           stats)
      -> [y_0, mean_0, rstd_0, y_1, ...]   (K row norms in one collective)

and row_norm_backward, batched_row_norm_backward, fused_add_norm_backward, group_norm_backward,
sync_batch_norm_backward, rms_norm_gated_backward.
An op's statistic it does not compute (RMSNorm's mean) and an absent parameter's gradient are
empty tensors. A communicator crosses as an integer ``handle`` (comm_handle): custom ops take
tensors and scalars only. Each op is one descriptor (``Op``, in ``OPS``) from which its two
custom ops, their fake implementations and its autograd are registered; the batched op, whose
arguments are lists, is written out. The modules and functional forms of tpnorm call these ops
while torch.compile traces them, and the eager path otherwise (the same C++ calls,
tpnorm._eager's; the custom-op dispatch would only add per-call cost there).
"""
import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import _tpnorm as _C
from . import _eager as E

_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
AVAILABLE = _version >= (2, 4) and hasattr(torch.library, "custom_op")
REASON = None if AVAILABLE else f"torch {torch.__version__} < 2.4 has no torch.library.custom_op"

from .comm import _comms
from .comm import handle_of as comm_handle  # noqa: F401 - the ops' communicator argument


def compiling():
    """True while torch.compile traces the caller (then the custom ops must be called)."""
    return AVAILABLE and torch.compiler.is_compiling()


Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]


# --- one descriptor per op ---------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One op as torch.library registers it: ``tpnorm::<name>`` and ``tpnorm::<name>_backward``
    (schemas in torch.library's syntax), each with its fake implementation, and the forward's
    autograd, whose backward calls the backward op. ``forward`` / ``backward`` compute (through
    tpnorm._eager), ``forward_fake`` / ``backward_fake`` allocate the same outputs only; all
    return None for an output they do not compute (RMSNorm's mean, an absent parameter's
    gradient), which the op returns as an empty tensor. The backward op takes the gradients of
    the forward's outputs ``grads_of``, then what ``saved`` names (("in", i): forward argument
    i, ("out", j): forward output j), then the forward's arguments from ``args_from`` on (its
    non-tensor ones); its results are the gradients of the forward's arguments ``grads_for``
    (None where that argument was None)."""
    name: str
    schema: str
    backward_schema: str
    forward: Callable
    forward_fake: Callable
    backward: Callable
    backward_fake: Callable
    grads_of: Tuple[int, ...]
    saved: Tuple[Tuple[str, int], ...]
    args_from: int
    grads_for: Tuple[int, ...]


def _absent(like):
    """The empty tensor an op returns for an output it does not compute."""
    return like.new_empty((0,), dtype=torch.float32)


def _as_tensors(fn):
    """fn's outputs with None as _absent (custom ops return tensors only)."""
    def impl(*args):
        like = next(a for a in args if isinstance(a, torch.Tensor))
        return tuple(_absent(like) if t is None else t for t in fn(*args))
    return impl


def _register(op):
    """The two custom ops of ``op``, their fake implementations and the forward's autograd;
    returns the forward op."""
    fwd = torch.library.custom_op(f"tpnorm::{op.name}", _as_tensors(op.forward), mutates_args=(),
                                  schema=op.schema)
    fwd.register_fake(_as_tensors(op.forward_fake))
    bwd = torch.library.custom_op(f"tpnorm::{op.name}_backward", _as_tensors(op.backward),
                                  mutates_args=(), schema=op.backward_schema)
    bwd.register_fake(_as_tensors(op.backward_fake))
    n_args = len(inspect.signature(op.forward).parameters)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[inputs[i] if kind == "in" else output[i]
                                for kind, i in op.saved])
        ctx.args = inputs[op.args_from:]
        ctx.present = [inputs[i] is not None for i in op.grads_for]

    def backward(ctx, *grads):
        got = bwd(*[grads[j] for j in op.grads_of], *ctx.saved_tensors, *ctx.args)
        out = [None] * n_args
        for i, g, present in zip(op.grads_for, got, ctx.present):
            out[i] = g if present else None
        return tuple(out)

    fwd.register_autograd(backward, setup_context=setup_context)
    return fwd, bwd


def _stats_like(x, n, dtype=None):
    """n saved statistics of x's rows (float32, float64 next to a float64 x)."""
    return x.new_empty(n, dtype=E._stats_dtype(x) if dtype is None else dtype)


def _empty_like(t):
    return None if t is None else torch.empty_like(t)


def _bn_options(x, training, momentum, eps, stats):
    return _C.BatchNormOptions(eps=eps, momentum=momentum, training=training,
                               layout=E._LAYOUT[E._channels_last(x)], stats=E._STATS[stats])


def _gated_groups(group_size, hidden, offset, norm_before_gate):
    return _C.GatedGroups(group_size=group_size, hidden=hidden, offset=offset,
                          norm_before_gate=norm_before_gate)


def _bn_forward(x, weight, bias, running_mean, running_var, handle, training, momentum, eps,
                stats):
    # Functional (autograd needs it): the updated running statistics are returned, and the
    # caller copies them into its buffers; on failure nothing is returned to copy.
    rm = None if running_mean is None else running_mean.clone()
    rv = None if running_var is None else running_var.clone()
    y, save_mean, save_invstd = E.sync_batch_norm_forward(
        _comms[handle], x, weight, bias, rm, rv,
        _bn_options(x, training, momentum, eps, stats), E._channels_last(x))
    return y, save_mean, save_invstd, rm, rv


OPS = [
    # LayerNorm / RMSNorm of hidden-sharded rows.
    Op("row_norm",
       "(Tensor x, Tensor? weight, Tensor? bias, int handle, float eps, str stats, "
       "bool centered, int hidden_size) -> (Tensor, Tensor, Tensor)",
       "(Tensor? dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
       "int handle, float eps, str stats, bool centered, int hidden_size) "
       "-> (Tensor, Tensor, Tensor)",
       forward=lambda x, weight, bias, handle, eps, stats, centered, hidden_size:
           E.row_norm_forward(_comms[handle], x, weight, bias,
                              E.norm_options(eps, stats, hidden_size), centered),
       forward_fake=lambda x, weight, bias, handle, eps, stats, centered, hidden_size: (
           torch.empty_like(x), _stats_like(x, (E._rows(x),)) if centered else None,
           _stats_like(x, (E._rows(x),))),
       backward=lambda dy, x, weight, bias, mean, rstd, handle, eps, stats, centered, hidden:
           E.row_norm_backward(_comms[handle], dy, x, weight, mean if centered else None, rstd,
                               E.norm_options(eps, stats, hidden), centered, bias is not None,
                               None if bias is None else bias.dtype),
       backward_fake=lambda dy, x, weight, bias, *rest: (
           torch.empty_like(x), _empty_like(weight), _empty_like(bias)),
       grads_of=(0,), saved=(("in", 0), ("in", 1), ("in", 2), ("out", 1), ("out", 2)),
       args_from=3, grads_for=(0, 1, 2)),
    # h = alpha * x + f, then LayerNorm / RMSNorm of h.
    Op("fused_add_norm",
       "(Tensor x, Tensor f, Tensor? weight, Tensor? bias, float alpha, int handle, float eps, "
       "str stats, bool centered, int hidden_size) -> (Tensor, Tensor, Tensor, Tensor)",
       "(Tensor? dh, Tensor? dy, Tensor h, Tensor? weight, Tensor? bias, Tensor mean, "
       "Tensor rstd, float alpha, int handle, float eps, str stats, bool centered, "
       "int hidden_size) -> (Tensor, Tensor, Tensor, Tensor)",
       forward=lambda x, f, weight, bias, alpha, handle, eps, stats, centered, hidden_size:
           E.fused_add_norm_forward(_comms[handle], x, f, weight, bias, alpha,
                                    E.norm_options(eps, stats, hidden_size), centered),
       forward_fake=lambda x, f, weight, bias, alpha, handle, eps, stats, centered, hidden: (
           torch.empty_like(x), torch.empty_like(x),
           _stats_like(x, (E._rows(x),)) if centered else None, _stats_like(x, (E._rows(x),))),
       backward=lambda dh, dy, h, weight, bias, mean, rstd, alpha, handle, eps, stats,
       centered, hidden: E.fused_add_norm_backward(
           _comms[handle], dh, dy, h, weight, mean if centered else None, rstd, alpha,
           E.norm_options(eps, stats, hidden), centered, bias is not None,
           None if bias is None else bias.dtype),
       backward_fake=lambda dh, dy, h, weight, bias, *rest: (
           torch.empty_like(h), torch.empty_like(h), _empty_like(weight), _empty_like(bias)),
       grads_of=(0, 1), saved=(("out", 0), ("in", 2), ("in", 3), ("out", 2), ("out", 3)),
       args_from=4, grads_for=(0, 1, 2, 3)),
    # GroupNorm / InstanceNorm of channel-sharded [N, C_local, *spatial].
    Op("group_norm",
       "(Tensor x, Tensor? weight, Tensor? bias, int groups, int channels, int channel_offset, "
       "int handle, float eps, str stats, bool instance) -> (Tensor, Tensor, Tensor)",
       "(Tensor? dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
       "int groups, int channels, int channel_offset, int handle, float eps, str stats, "
       "bool instance) -> (Tensor, Tensor, Tensor)",
       forward=lambda x, weight, bias, groups, channels, offset, handle, eps, stats, instance:
           E.group_norm_forward(_comms[handle], x, weight, bias,
                                _C.ChannelGroups(groups=groups, channels=channels,
                                                 channel_offset=offset),
                                E.norm_options(eps, stats), instance),
       forward_fake=lambda x, weight, bias, groups, channels, offset, handle, eps, stats,
       instance: (torch.empty_like(x),
                  _stats_like(x, (x.shape[0], channels if instance else groups)),
                  _stats_like(x, (x.shape[0], channels if instance else groups))),
       backward=lambda dy, x, weight, bias, mean, rstd, groups, channels, offset, handle, eps,
       stats, instance: E.group_norm_backward(
           _comms[handle], dy, x, weight, mean, rstd,
           _C.ChannelGroups(groups=groups, channels=channels, channel_offset=offset),
           E.norm_options(eps, stats), instance, bias is not None),
       backward_fake=lambda dy, x, weight, bias, *rest: (
           torch.empty_like(x), _empty_like(weight),
           None if bias is None else x.new_empty((x.shape[1],))),
       grads_of=(0,), saved=(("in", 0), ("in", 1), ("in", 2), ("out", 1), ("out", 2)),
       args_from=3, grads_for=(0, 1, 2)),
    # SyncBatchNorm; the new running statistics are outputs (not differentiable).
    Op("sync_batch_norm",
       "(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean, Tensor? running_var, "
       "int handle, bool training, float momentum, float eps, str stats) "
       "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
       "(Tensor? dy, Tensor x, Tensor? weight, Tensor? bias, Tensor save_mean, "
       "Tensor save_invstd, int handle, bool training, float momentum, float eps, str stats) "
       "-> (Tensor, Tensor, Tensor)",
       forward=_bn_forward,
       forward_fake=lambda x, weight, bias, running_mean, running_var, *rest: (
           torch.empty_like(x), _stats_like(x, (x.shape[1],)), _stats_like(x, (x.shape[1],)),
           _empty_like(running_mean), _empty_like(running_var)),
       backward=lambda dy, x, weight, bias, save_mean, save_invstd, handle, training, momentum,
       eps, stats: E.sync_batch_norm_backward(
           _comms[handle], dy, x, weight, save_mean, save_invstd,
           _bn_options(x, training, momentum, eps, stats), E._channels_last(x),
           bias is not None, None if bias is None else bias.dtype),
       backward_fake=lambda dy, x, weight, bias, *rest: (
           torch.empty_like(x), _empty_like(weight), _empty_like(bias)),
       grads_of=(0,), saved=(("in", 0), ("in", 1), ("in", 2), ("out", 1), ("out", 2)),
       args_from=5, grads_for=(0, 1, 2)),
    # Mamba-2's gated RMSNorm of channel-sharded rows, the gate z optional.
    Op("rms_norm_gated",
       "(Tensor x, Tensor? z, Tensor? weight, int group_size, int hidden, int offset, "
       "bool norm_before_gate, int handle, float eps, str stats) -> (Tensor, Tensor)",
       "(Tensor? dy, Tensor x, Tensor? z, Tensor? weight, Tensor rstd, int group_size, "
       "int hidden, int offset, bool norm_before_gate, int handle, float eps, str stats) "
       "-> (Tensor, Tensor, Tensor)",
       forward=lambda x, z, weight, group_size, hidden, offset, nbg, handle, eps, stats:
           E.rms_norm_gated_forward(_comms[handle], x, z, weight,
                                    _gated_groups(group_size, hidden, offset, nbg),
                                    E.norm_options(eps, stats)),
       forward_fake=lambda x, z, weight, group_size, hidden, offset, nbg, handle, eps, stats: (
           torch.empty_like(x), _stats_like(x, (E._rows(x), E._gated_groups_count(
               x, _gated_groups(group_size, hidden, offset, nbg))))),
       backward=lambda dy, x, z, weight, rstd, group_size, hidden, offset, nbg, handle, eps,
       stats: E.rms_norm_gated_backward(_comms[handle], dy, x, z, weight, rstd,
                                        _gated_groups(group_size, hidden, offset, nbg),
                                        E.norm_options(eps, stats)),
       backward_fake=lambda dy, x, z, weight, *rest: (
           torch.empty_like(x), _empty_like(z), _empty_like(weight)),
       grads_of=(0,), saved=(("in", 0), ("in", 1), ("in", 2), ("out", 1)),
       args_from=3, grads_for=(0, 1, 2)),
]

if AVAILABLE:
    for _op in OPS:
        globals()[_op.name], globals()[_op.name + "_backward"] = _register(_op)

    # --- several row norms in one collective (tpnorm.batched) -------------------------------
    # The parameters travel as one list of the present ones (``params``: the weights of the
    # items with has_weight, in item order, then the biases of those with has_bias), not as
    # lists with None:
    # torch.library's autograd gives gradients to a list argument only when it holds tensors
    # alone, and q_norm without a bias next to a LayerNorm with one would not.
    def _split_params(params, has_weight, has_bias):
        it = iter(params)
        ws = [next(it) if h else None for h in has_weight]
        bs = [next(it) if h else None for h in has_bias]
        return ws, bs

    @torch.library.custom_op("tpnorm::batched_row_norm", mutates_args=())
    def batched_row_norm(xs: List[Tensor], params: List[Tensor], has_weight: List[bool],
                         has_bias: List[bool], centered: List[bool], hidden: List[int],
                         handle: int, eps: float, stats: str) -> List[Tensor]:
        ws, bs = _split_params(params, has_weight, has_bias)
        ys, means, rstds = E.batched_forward(_comms[handle], [x.contiguous() for x in xs], ws, bs,
                                    centered, hidden, E.norm_options(eps, stats, 0))
        return [t for y, m, r, x in zip(ys, means, rstds, xs)
                for t in (y, _absent(x) if m is None else m, r)]

    @batched_row_norm.register_fake
    def _(xs, params, has_weight, has_bias, centered, hidden, handle, eps, stats):
        out = []
        for x, c in zip(xs, centered):
            rows, sdt = E._rows(x), E._stats_dtype(x)
            out += [torch.empty_like(x, memory_format=torch.contiguous_format),
                    x.new_empty((rows,), dtype=sdt) if c else _absent(x),
                    x.new_empty((rows,), dtype=sdt)]
        return out

    @torch.library.custom_op("tpnorm::batched_row_norm_backward", mutates_args=())
    def batched_row_norm_backward(dys: List[Tensor], xs: List[Tensor], params: List[Tensor],
                                  means: List[Tensor], rstds: List[Tensor],
                                  has_weight: List[bool], has_bias: List[bool],
                                  centered: List[bool], hidden: List[int], handle: int,
                                  eps: float, stats: str) -> List[Tensor]:
        """[dx_0, ..., dx_{K-1}] then the present parameters' gradients, in params' order."""
        ws, bs = _split_params(params, has_weight, has_bias)
        dxs, dws, dbs = E.batched_backward(
            _comms[handle], dys, [x.contiguous() for x in xs], ws,
            [None if b is None else b.dtype for b in bs],
            [m if c else None for m, c in zip(means, centered)], rstds, centered, hidden,
            E.norm_options(eps, stats, 0))
        return list(dxs) + [t for t in dws if t is not None] + [t for t in dbs if t is not None]

    @batched_row_norm_backward.register_fake
    def _(dys, xs, params, means, rstds, has_weight, has_bias, centered, hidden, handle, eps,
          stats):
        return ([torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs] +
                [torch.empty_like(p) for p in params])

    def _batched_setup(ctx, inputs, output):
        xs, params = inputs[:2]
        ctx.k, ctx.np, ctx.args = len(xs), len(params), inputs[2:]
        ctx.save_for_backward(*xs, *params, *output[1::3], *output[2::3])

    def _batched_backward(ctx, dys):
        k, n, t = ctx.k, ctx.np, ctx.saved_tensors
        xs, params = list(t[:k]), list(t[k:k + n])
        means, rstds = list(t[k + n:2 * k + n]), list(t[2 * k + n:])
        dy = [g if g is not None else torch.zeros_like(x) for g, x in zip(dys[0::3], xs)]
        g = batched_row_norm_backward(dy, xs, params, means, rstds, *ctx.args)
        return list(g[:k]), list(g[k:]), None, None, None, None, None, None, None

    batched_row_norm.register_autograd(_batched_backward, setup_context=_batched_setup)
