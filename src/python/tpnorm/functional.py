"""Autograd functions and functional forms of tpnorm's ops.

Each function takes ``comm`` (anything ``tpnorm.as_communicator`` accepts; a module keeps one)
and makes exactly the collectives of the C++ call: ONE all_reduce_sum per forward and per
backward (SyncBatchNorm in eval: none). Tensors cross into C++ through DLPack without a copy;
inputs must be contiguous (row-major), outputs are allocated here. Saved statistics are
float32. Every rank must make the same calls in the same order, backward included.
"""
import math

import torch

from . import _tpnorm as _C
from .comm import as_communicator

_STATS = {"robust": _C.Stats.ROBUST, "naive": _C.Stats.NAIVE, "exact": _C.Stats.EXACT}
_opts_cache = {}


def norm_options(eps=1e-5, stats="robust", check_agreement=True, num_threads=0):
    """A cached _C.NormOptions (building one per call would cost more than the lookup)."""
    key = (float(eps), stats, bool(check_agreement), int(num_threads))
    opt = _opts_cache.get(key)
    if opt is None:
        opt = _C.NormOptions(eps=key[0], stats=_STATS[stats], check_agreement=key[2],
                             num_threads=key[3])
        _opts_cache[key] = opt
    return opt


def _d(t):
    """The tensor DLPack may export: detached (torch refuses to export one requiring grad)."""
    return None if t is None else t.detach()


def _empty(shape, like, dtype=None):
    # Never empty_like: it would copy a non-contiguous input's strides.
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _rows(x):
    return math.prod(x.shape[:-1]) if x.dim() > 0 else 0


def _grad(dy, like):
    """An incoming gradient as a dense tensor (autograd hands out expanded views, or None)."""
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device) if dy is None \
        else dy.contiguous()


def _grads(like, weight, channels, has_bias, bias_dtype=None):
    """The backward outputs every autograd function here allocates the same way: dx shaped and
    typed like ``like``, dweight like ``weight`` (None without one), and dbias of ``channels``
    in ``bias_dtype`` (default ``like``'s; mixed precision keeps bias float32) or None."""
    dx = _empty(like.shape, like)
    dw = None if weight is None else _empty(weight.shape, weight)
    db = _empty((channels,), like, bias_dtype) if has_bias else None
    return dx, dw, db


class _RowNorm(torch.autograd.Function):
    """LayerNorm (centered) or RMSNorm over the hidden dimension sharded across comm."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, opt, centered):
        rows = _rows(x)
        y = _empty(x.shape, x)
        rstd = _empty((rows,), x, torch.float32)
        mean = _empty((rows,), x, torch.float32) if centered else None
        if centered:
            _C.layer_norm_forward(comm, _d(x), _d(weight), _d(bias), y, mean, rstd, opt)
        else:
            _C.rms_norm_forward(comm, _d(x), _d(weight), y, rstd, opt)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.comm, ctx.opt, ctx.centered, ctx.has_bias = comm, opt, centered, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _grads(x, weight, x.shape[-1], ctx.has_bias, ctx.bias_dtype)
        if ctx.centered:
            _C.layer_norm_backward(ctx.comm, _grad(dy, x), _d(x), _d(weight), mean, rstd, dx,
                                   dw, db, ctx.opt)
        else:
            _C.rms_norm_backward(ctx.comm, _grad(dy, x), _d(x), _d(weight), rstd, dx, dw,
                                 ctx.opt)
        return dx, dw, db, None, None, None


def layer_norm(x, weight=None, bias=None, eps=1e-5, comm=None, stats="robust"):
    """LayerNorm of rows whose last dimension is sharded over ``comm`` (x: [..., hidden_local];
    weight/bias: this rank's [hidden_local] slice). As F.layer_norm on the gathered rows."""
    return _RowNorm.apply(x, weight, bias, as_communicator(comm), norm_options(eps, stats), True)


def rms_norm(x, weight=None, eps=1e-5, comm=None, stats="robust"):
    """RMSNorm (y = x / sqrt(mean(x^2) + eps) * weight) of hidden-sharded rows."""
    return _RowNorm.apply(x, weight, None, as_communicator(comm), norm_options(eps, stats), False)


class _FusedAddNorm(torch.autograd.Function):
    """h = alpha * x + f; y = Norm(h); returns (h, y). h's own gradient joins as dh_extra."""

    @staticmethod
    def forward(ctx, x, f, weight, bias, alpha, comm, opt, centered):
        rows = _rows(x)
        h, y = _empty(x.shape, x), _empty(x.shape, x)
        rstd = _empty((rows,), x, torch.float32)
        mean = _empty((rows,), x, torch.float32) if centered else None
        if centered:
            _C.fused_add_layer_norm_forward(comm, _d(x), _d(f), alpha, _d(weight), _d(bias), h,
                                            y, mean, rstd, opt)
        else:
            _C.fused_add_rms_norm_forward(comm, _d(x), _d(f), alpha, _d(weight), h, y, rstd, opt)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.alpha, ctx.comm, ctx.opt, ctx.centered = alpha, comm, opt, centered
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _grads(h, weight, h.shape[-1], ctx.has_bias, ctx.bias_dtype)
        df = _empty(h.shape, h)
        dh = None if dh is None else dh.contiguous()
        if ctx.centered:
            _C.fused_add_layer_norm_backward(ctx.comm, _grad(dy, h), dh, _d(h), _d(weight), mean,
                                             rstd, ctx.alpha, dx, df, dw, db, ctx.opt)
        else:
            _C.fused_add_rms_norm_backward(ctx.comm, _grad(dy, h), dh, _d(h), _d(weight), rstd,
                                           ctx.alpha, dx, df, dw, ctx.opt)
        return dx, df, dw, db, None, None, None, None


def fused_add_layer_norm(x, f, weight=None, bias=None, alpha=1.0, eps=1e-5, comm=None,
                         stats="robust"):
    """(h, y) with h = alpha*x + f (the new residual stream) and y = LayerNorm(h), in one pass
    and one collective. alpha = 1: Pre-LN / Post-LN; DeepNorm: deepnorm_alpha(stack, N, M)."""
    return _FusedAddNorm.apply(x, f, weight, bias, float(alpha), as_communicator(comm),
                               norm_options(eps, stats), True)


def fused_add_rms_norm(x, f, weight=None, alpha=1.0, eps=1e-5, comm=None, stats="robust"):
    """(h, y) with h = alpha*x + f and y = RMSNorm(h)."""
    return _FusedAddNorm.apply(x, f, weight, None, float(alpha), as_communicator(comm),
                               norm_options(eps, stats), False)


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


class _GroupNorm(torch.autograd.Function):
    """GroupNorm / InstanceNorm on [N, C_local, *spatial], channels sharded over comm."""

    @staticmethod
    def forward(ctx, x, weight, bias, cg, comm, opt, instance):
        groups = cg.channels if instance else cg.groups
        y = _empty(x.shape, x)
        mean = _empty((x.shape[0], groups), x, torch.float32)
        rstd = _empty((x.shape[0], groups), x, torch.float32)
        _C.group_norm_forward(comm, _d(x), cg, _d(weight), _d(bias), y, mean, rstd, opt,
                              instance)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.cg, ctx.comm, ctx.opt, ctx.instance = cg, comm, opt, instance
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _grads(x, weight, x.shape[1], ctx.has_bias)
        _C.group_norm_backward(ctx.comm, _grad(dy, x), _d(x), ctx.cg, _d(weight), mean, rstd,
                               dx, dw, db, ctx.opt, ctx.instance)
        return dx, dw, db, None, None, None, None


def shard_range(total, rank, size):
    """[start, stop) of this rank's part of ``total`` split over ``size`` ranks as evenly as
    possible (the first ranks may get one less; some may get none when total < size)."""
    return total * rank // size, total * (rank + 1) // size


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, comm=None, num_channels=None,
               channel_offset=None, stats="robust"):
    """F.group_norm over channels sharded across ``comm``: x is [N, C_local, *spatial] holding
    channels [channel_offset, channel_offset + C_local) of ``num_channels``. Without
    num_channels / channel_offset the split is shard_range(num_channels, rank, size) or, with
    neither given, the unsharded C_local."""
    comm = as_communicator(comm)
    cg = _channel_groups(x, num_groups, comm, num_channels, channel_offset)
    return _GroupNorm.apply(x, weight, bias, cg, comm, norm_options(eps, stats), False)


def instance_norm(x, weight=None, bias=None, eps=1e-5, comm=None, num_channels=None,
                  channel_offset=None, stats="robust"):
    """F.instance_norm (batch statistics, no running statistics) with channels sharded as in
    group_norm. One channel per group, so a group never spans ranks."""
    comm = as_communicator(comm)
    cg = _channel_groups(x, 1, comm, num_channels, channel_offset)
    return _GroupNorm.apply(x, weight, bias, cg, comm, norm_options(eps, stats), True)


def _channel_groups(x, groups, comm, channels, offset):
    if channels is None:
        channels = x.shape[1] if offset is None else -1
    if offset is None:
        offset = shard_range(channels, comm.rank, comm.size)[0] if channels >= 0 else 0
    if channels >= 0 and comm.size == 1:
        offset = 0
    return _C.ChannelGroups(groups=groups, channels=channels, channel_offset=offset)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch statistics over the global batch (ranks may hold different N, including 0)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, comm, opt, channels_last):
        C = x.shape[1]
        xv = x.permute(0, *range(2, x.dim()), 1) if channels_last else x
        y = torch.empty(xv.shape, dtype=x.dtype, device=x.device)
        save_mean, save_invstd = _empty((C,), x, torch.float32), _empty((C,), x, torch.float32)
        _C.sync_batch_norm_forward(comm, _d(xv), _d(weight), _d(bias), running_mean, running_var,
                                   y, save_mean, save_invstd, opt)
        ctx.save_for_backward(x, weight, save_mean, save_invstd)
        ctx.comm, ctx.opt, ctx.channels_last = comm, opt, channels_last
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype  # fp32 next to fp16/bf16 x too
        if channels_last:
            y = y.permute(0, x.dim() - 1, *range(1, x.dim() - 1))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, save_mean, save_invstd = ctx.saved_tensors
        if ctx.channels_last:
            to_last = (0, *range(2, x.dim()), 1)
            x = x.permute(to_last)
            dy = None if dy is None else dy.permute(to_last)
        dx, dw, db = _grads(x, weight, x.shape[-1 if ctx.channels_last else 1], ctx.has_bias,
                            ctx.bias_dtype)
        _C.sync_batch_norm_backward(ctx.comm, _grad(dy, x), _d(x), _d(weight), save_mean,
                                    save_invstd, dx, dw, db, ctx.opt)
        if ctx.channels_last:
            dx = dx.permute(0, x.dim() - 1, *range(1, x.dim() - 1))
        return dx, dw, db, None, None, None, None, None


_LAYOUT = {False: _C.Layout.NCHW, True: _C.Layout.CHANNELS_LAST}


def sync_batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
                    momentum=0.1, eps=1e-5, comm=None, stats="robust"):
    """F.batch_norm with statistics over the batch of every rank of ``comm``.

    running_mean / running_var: float32 [C] buffers updated in place in training (or None).
    weight / bias: x's dtype, or float32 next to a float16/bfloat16 x (mixed precision, CPU).
    momentum: a float (None is the caller's cumulative average: pass 1/num_batches_tracked).
    Training with running statistics absent, or eval without them, uses batch statistics.
    A 4-D/5-D x in torch.channels_last(_3d) memory format (stride 1 on C) runs channels-last.
    """
    comm = as_communicator(comm)
    # Channels-last by the strides (stride 1 on C), not by is_contiguous(): an empty batch is
    # "contiguous" in every format, and every rank must choose the same layout.
    channels_last = False
    if x.dim() in (4, 5) and x.stride(1) == 1 and x.shape[1] > 1:
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        channels_last = x.is_contiguous(memory_format=fmt)
    bn_training = training or running_mean is None
    opt = _C.BatchNormOptions(eps=eps, momentum=math.nan if momentum is None else momentum,
                              training=bn_training, layout=_LAYOUT[channels_last],
                              stats=_STATS[stats])
    return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, comm, opt,
                                channels_last)
