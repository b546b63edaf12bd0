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
tensors and scalars only. The modules and functional forms of tpnorm call these ops while
torch.compile traces them and the autograd Functions of tpnorm.functional in eager mode (the
same C++ calls, tpnorm._eager's; the custom-op dispatch would only add per-call cost there).
"""
from typing import List, Optional, Tuple

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


def _absent(like):
    """The empty tensor an op returns for an output it does not compute."""
    return like.new_empty((0,), dtype=torch.float32)


Tensor = torch.Tensor
OptTensor = Optional[torch.Tensor]

if AVAILABLE:
    # --- LayerNorm / RMSNorm -----------------------------------------------------------------
    @torch.library.custom_op("tpnorm::row_norm", mutates_args=())
    def row_norm(x: Tensor, weight: OptTensor, bias: OptTensor, handle: int, eps: float,
                 stats: str, centered: bool, hidden_size: int) -> Tuple[Tensor, Tensor, Tensor]:
        y, mean, rstd = E.row_norm_forward(_comms[handle], x, weight, bias,
                                            E.norm_options(eps, stats, hidden_size), centered)
        return y, (_absent(x) if mean is None else mean), rstd

    @row_norm.register_fake
    def _(x, weight, bias, handle, eps, stats, centered, hidden_size):
        rows = E._rows(x)
        mean = x.new_empty((rows,), dtype=E._stats_dtype(x)) if centered else _absent(x)
        return torch.empty_like(x), mean, x.new_empty((rows,), dtype=E._stats_dtype(x))

    @torch.library.custom_op("tpnorm::row_norm_backward", mutates_args=())
    def row_norm_backward(dy: Tensor, x: Tensor, weight: OptTensor, bias: OptTensor,
                          mean: Tensor, rstd: Tensor, handle: int, eps: float, stats: str,
                          centered: bool, hidden_size: int) -> Tuple[Tensor, Tensor, Tensor]:
        dx, dw, db = E.row_norm_backward(
            _comms[handle], dy, x, weight, mean if centered else None, rstd,
            E.norm_options(eps, stats, hidden_size), centered, bias is not None,
            None if bias is None else bias.dtype)
        return dx, (_absent(x) if dw is None else dw), (_absent(x) if db is None else db)

    @row_norm_backward.register_fake
    def _(dy, x, weight, bias, mean, rstd, handle, eps, stats, centered, hidden_size):
        return (torch.empty_like(x), _absent(x) if weight is None else torch.empty_like(weight),
                _absent(x) if bias is None else torch.empty_like(bias))

    def _row_setup(ctx, inputs, output):
        x, weight, bias = inputs[:3]
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.args = inputs[3:]

    def _row_backward(ctx, dy, dmean, drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = row_norm_backward(dy, x, weight, bias, mean, rstd, *ctx.args)
        return (dx, None if weight is None else dw, None if bias is None else db) + \
            (None,) * 5

    row_norm.register_autograd(_row_backward, setup_context=_row_setup)

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

    # --- fused residual add + LayerNorm / RMSNorm -------------------------------------------
    @torch.library.custom_op("tpnorm::fused_add_norm", mutates_args=())
    def fused_add_norm(x: Tensor, f: Tensor, weight: OptTensor, bias: OptTensor, alpha: float,
                       handle: int, eps: float, stats: str, centered: bool,
                       hidden_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        h, y, mean, rstd = E.fused_add_norm_forward(_comms[handle], x, f, weight, bias, alpha,
                                                     E.norm_options(eps, stats, hidden_size),
                                                     centered)
        return h, y, (_absent(x) if mean is None else mean), rstd

    @fused_add_norm.register_fake
    def _(x, f, weight, bias, alpha, handle, eps, stats, centered, hidden_size):
        rows = E._rows(x)
        mean = x.new_empty((rows,), dtype=E._stats_dtype(x)) if centered else _absent(x)
        return (torch.empty_like(x), torch.empty_like(x), mean,
                x.new_empty((rows,), dtype=E._stats_dtype(x)))

    @torch.library.custom_op("tpnorm::fused_add_norm_backward", mutates_args=())
    def fused_add_norm_backward(dh: OptTensor, dy: Tensor, h: Tensor, weight: OptTensor,
                                bias: OptTensor, mean: Tensor, rstd: Tensor, alpha: float,
                                handle: int, eps: float, stats: str, centered: bool,
                                hidden_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        dx, df, dw, db = E.fused_add_norm_backward(
            _comms[handle], dh, dy, h, weight, mean if centered else None, rstd, alpha,
            E.norm_options(eps, stats, hidden_size), centered, bias is not None,
            None if bias is None else bias.dtype)
        return dx, df, (_absent(h) if dw is None else dw), (_absent(h) if db is None else db)

    @fused_add_norm_backward.register_fake
    def _(dh, dy, h, weight, bias, mean, rstd, alpha, handle, eps, stats, centered,
          hidden_size):
        return (torch.empty_like(h), torch.empty_like(h),
                _absent(h) if weight is None else torch.empty_like(weight),
                _absent(h) if bias is None else torch.empty_like(bias))

    def _fused_setup(ctx, inputs, output):
        weight, bias = inputs[2:4]
        h, _, mean, rstd = output
        ctx.save_for_backward(h, weight, bias, mean, rstd)
        ctx.args = inputs[4:]

    def _fused_backward(ctx, dh, dy, dmean, drstd):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, df, dw, db = fused_add_norm_backward(dh, dy, h, weight, bias, mean, rstd, *ctx.args)
        return (dx, df, None if weight is None else dw, None if bias is None else db) + \
            (None,) * 6

    fused_add_norm.register_autograd(_fused_backward, setup_context=_fused_setup)

    # --- GroupNorm / InstanceNorm -----------------------------------------------------------
    @torch.library.custom_op("tpnorm::group_norm", mutates_args=())
    def group_norm(x: Tensor, weight: OptTensor, bias: OptTensor, groups: int, channels: int,
                   channel_offset: int, handle: int, eps: float, stats: str,
                   instance: bool) -> Tuple[Tensor, Tensor, Tensor]:
        cg = _C.ChannelGroups(groups=groups, channels=channels, channel_offset=channel_offset)
        return E.group_norm_forward(_comms[handle], x, weight, bias, cg,
                                     E.norm_options(eps, stats), instance)

    @group_norm.register_fake
    def _(x, weight, bias, groups, channels, channel_offset, handle, eps, stats, instance):
        g = channels if instance else groups
        return (torch.empty_like(x), x.new_empty((x.shape[0], g), dtype=E._stats_dtype(x)),
                x.new_empty((x.shape[0], g), dtype=E._stats_dtype(x)))

    @torch.library.custom_op("tpnorm::group_norm_backward", mutates_args=())
    def group_norm_backward(dy: Tensor, x: Tensor, weight: OptTensor, bias: OptTensor,
                            mean: Tensor, rstd: Tensor, groups: int, channels: int,
                            channel_offset: int, handle: int, eps: float, stats: str,
                            instance: bool) -> Tuple[Tensor, Tensor, Tensor]:
        cg = _C.ChannelGroups(groups=groups, channels=channels, channel_offset=channel_offset)
        dx, dw, db = E.group_norm_backward(_comms[handle], dy, x, weight, mean, rstd, cg,
                                            E.norm_options(eps, stats), instance,
                                            bias is not None)
        return dx, (_absent(x) if dw is None else dw), (_absent(x) if db is None else db)

    @group_norm_backward.register_fake
    def _(dy, x, weight, bias, mean, rstd, groups, channels, channel_offset, handle, eps, stats,
          instance):
        return (torch.empty_like(x), _absent(x) if weight is None else torch.empty_like(weight),
                _absent(x) if bias is None else x.new_empty((x.shape[1],)))

    def _group_setup(ctx, inputs, output):
        x, weight, bias = inputs[:3]
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.args = inputs[3:]

    def _group_backward(ctx, dy, dmean, drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = group_norm_backward(dy, x, weight, bias, mean, rstd, *ctx.args)
        return (dx, None if weight is None else dw, None if bias is None else db) + \
            (None,) * 7

    group_norm.register_autograd(_group_backward, setup_context=_group_setup)

    # --- SyncBatchNorm ----------------------------------------------------------------------
    def _bn_options(x, training, momentum, eps, stats):
        return _C.BatchNormOptions(eps=eps, momentum=momentum, training=training,
                                   layout=E._LAYOUT[E._channels_last(x)],
                                   stats=E._STATS[stats])

    # Functional (autograd needs it): the updated running statistics are returned, and the
    # caller copies them into its buffers; on failure nothing is returned to copy.
    @torch.library.custom_op("tpnorm::sync_batch_norm", mutates_args=())
    def sync_batch_norm(x: Tensor, weight: OptTensor, bias: OptTensor, running_mean: OptTensor,
                        running_var: OptTensor, handle: int, training: bool, momentum: float,
                        eps: float, stats: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        opt = _bn_options(x, training, momentum, eps, stats)
        rm = _absent(x) if running_mean is None else running_mean.clone()
        rv = _absent(x) if running_var is None else running_var.clone()
        y, save_mean, save_invstd = E.sync_batch_norm_forward(
            _comms[handle], x, weight, bias, None if running_mean is None else rm,
            None if running_var is None else rv, opt, E._channels_last(x))
        return y, save_mean, save_invstd, rm, rv

    @sync_batch_norm.register_fake
    def _(x, weight, bias, running_mean, running_var, handle, training, momentum, eps, stats):
        C = x.shape[1]
        return (torch.empty_like(x), x.new_empty((C,), dtype=E._stats_dtype(x)),
                x.new_empty((C,), dtype=E._stats_dtype(x)),
                _absent(x) if running_mean is None else torch.empty_like(running_mean),
                _absent(x) if running_var is None else torch.empty_like(running_var))

    @torch.library.custom_op("tpnorm::sync_batch_norm_backward", mutates_args=())
    def sync_batch_norm_backward(dy: Tensor, x: Tensor, weight: OptTensor, bias: OptTensor,
                                 save_mean: Tensor, save_invstd: Tensor, handle: int,
                                 training: bool, momentum: float, eps: float,
                                 stats: str) -> Tuple[Tensor, Tensor, Tensor]:
        opt = _bn_options(x, training, momentum, eps, stats)
        dx, dw, db = E.sync_batch_norm_backward(
            _comms[handle], dy, x, weight, save_mean, save_invstd, opt, E._channels_last(x),
            bias is not None, None if bias is None else bias.dtype)
        return dx, (_absent(x) if dw is None else dw), (_absent(x) if db is None else db)

    @sync_batch_norm_backward.register_fake
    def _(dy, x, weight, bias, save_mean, save_invstd, handle, training, momentum, eps, stats):
        return (torch.empty_like(x), _absent(x) if weight is None else torch.empty_like(weight),
                _absent(x) if bias is None else torch.empty_like(bias))

    def _bn_setup(ctx, inputs, output):
        x, weight, bias = inputs[:3]
        save_mean, save_invstd = output[1:3]
        ctx.save_for_backward(x, weight, bias, save_mean, save_invstd)
        ctx.args = inputs[5:]

    def _bn_backward(ctx, dy, dmean, dinvstd, drunning_mean, drunning_var):
        x, weight, bias, save_mean, save_invstd = ctx.saved_tensors
        dx, dw, db = sync_batch_norm_backward(dy, x, weight, bias, save_mean, save_invstd,
                                              *ctx.args)
        return (dx, None if weight is None else dw, None if bias is None else db) + \
            (None,) * 7

    sync_batch_norm.register_autograd(_bn_backward, setup_context=_bn_setup)

    # --- gated RMSNorm (Mamba-2) ------------------------------------------------------------
    def _gated_groups(group_size, hidden, offset, norm_before_gate):
        return _C.GatedGroups(group_size=group_size, hidden=hidden, offset=offset,
                              norm_before_gate=norm_before_gate)

    @torch.library.custom_op("tpnorm::rms_norm_gated", mutates_args=())
    def rms_norm_gated(x: Tensor, z: OptTensor, weight: OptTensor, group_size: int, hidden: int,
                       offset: int, norm_before_gate: bool, handle: int, eps: float,
                       stats: str) -> Tuple[Tensor, Tensor]:
        gg = _gated_groups(group_size, hidden, offset, norm_before_gate)
        return E.rms_norm_gated_forward(_comms[handle], x, z, weight, gg,
                                         E.norm_options(eps, stats))

    @rms_norm_gated.register_fake
    def _(x, z, weight, group_size, hidden, offset, norm_before_gate, handle, eps, stats):
        gg = _gated_groups(group_size, hidden, offset, norm_before_gate)
        return (torch.empty_like(x), x.new_empty((E._rows(x), E._gated_groups_count(x, gg)),
                                                 dtype=E._stats_dtype(x)))

    @torch.library.custom_op("tpnorm::rms_norm_gated_backward", mutates_args=())
    def rms_norm_gated_backward(dy: Tensor, x: Tensor, z: OptTensor, weight: OptTensor,
                                rstd: Tensor, group_size: int, hidden: int, offset: int,
                                norm_before_gate: bool, handle: int, eps: float,
                                stats: str) -> Tuple[Tensor, Tensor, Tensor]:
        gg = _gated_groups(group_size, hidden, offset, norm_before_gate)
        dx, dz, dw = E.rms_norm_gated_backward(_comms[handle], dy, x, z, weight, rstd, gg,
                                                E.norm_options(eps, stats))
        return dx, (_absent(x) if dz is None else dz), (_absent(x) if dw is None else dw)

    @rms_norm_gated_backward.register_fake
    def _(dy, x, z, weight, rstd, group_size, hidden, offset, norm_before_gate, handle, eps,
          stats):
        return (torch.empty_like(x), _absent(x) if z is None else torch.empty_like(z),
                _absent(x) if weight is None else torch.empty_like(weight))

    def _gated_setup(ctx, inputs, output):
        x, z, weight = inputs[:3]
        ctx.save_for_backward(x, z, weight, output[1])
        ctx.args = inputs[3:]

    def _gated_backward(ctx, dy, drstd):
        x, z, weight, rstd = ctx.saved_tensors
        dx, dz, dw = rms_norm_gated_backward(dy, x, z, weight, rstd, *ctx.args)
        return (dx, None if z is None else dz, None if weight is None else dw) + (None,) * 7

    rms_norm_gated.register_autograd(_gated_backward, setup_context=_gated_setup)
