"""tpnorm's functional forms: the public functions and their dispatch.

The functional forms take torch.nn.functional's arguments in its order, then keyword-only
``process_group`` (anything ``tpnorm.as_communicator`` accepts; None: the default
torch.distributed group when one is initialised, else one process) and ``stats``. Each makes
exactly the collectives of the C++ call: ONE all_reduce_sum per forward and per backward
(SyncBatchNorm in eval: none). Every rank must make the same calls in the same order, backward
included. Each op dispatches to the torch.library op while torch.compile traces, else to the
eager autograd path; the calls that allocate outputs and reach C++ are tpnorm._eager's.
"""
import math

import torch

from . import _eager as E
from . import _tpnorm as _C
from . import library as _lib
from .comm import address_of, as_communicator

# The eager path's facts, as the package reports them (python -m tpnorm, the tests).
CPP_AUTOGRAD, CPP_AUTOGRAD_REASON = E.CPP_AUTOGRAD, E.CPP_AUTOGRAD_REASON
norm_options = E.norm_options
gated_inputs = E.gated_inputs


def _cpp(*tensors):
    """Whether the eager call takes tpnorm._autograd's C++ autograd: where it was built for this
    torch, on plain CPU tensors (not DTensors or other subclasses; None: absent). CUDA tensors
    take the Python Functions, whose calls follow torch's current stream (_eager._device_call)."""
    return E._autograd is not None and all(
        t is None or (type(t) is E._Tensor and not t.is_cuda) for t in tensors)


def _row_shape(x, normalized_shape, eps):
    """(hidden size, x and the parameters' flattening, eps) of a row norm over the trailing
    dims normalized_shape (the last one sharded): rows are x's leading dims."""
    k = len(normalized_shape)
    hidden = normalized_shape[0] if k == 1 else math.prod(normalized_shape)
    if eps is None:  # torch.nn.RMSNorm's default: the epsilon of its compute type
        eps = E._EPS64 if x.dtype is E._F64 else E._EPS32
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
    elif _cpp(x):
        y = E._autograd.row_norm(x, weight, bias, address_of(comm),
                               E._opt_address(eps, stats, hidden), centered)
    else:
        y = E._RowNorm.apply(x, weight, bias, (comm, E.norm_options(eps, stats, hidden), centered))
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
    elif _cpp(x, f):
        h, y = E._autograd.fused_add_norm(x, f, weight, bias, float(alpha), address_of(comm),
                                          E._opt_address(eps, stats, hidden), centered)
    else:
        h, y = E._FusedAddNorm.apply(x, f, weight, bias, float(alpha), comm,
                                   E.norm_options(eps, stats, hidden), centered)
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
    if _cpp(x):
        return E._autograd.group_norm(x, weight, bias, *cg, address_of(comm),
                                      E._opt_address(eps, stats, 0), instance)
    cg = _C.ChannelGroups(groups=cg[0], channels=cg[1], channel_offset=cg[2])
    return E._GroupNorm.apply(x, weight, bias, cg, comm, E.norm_options(eps, stats), instance)


def _channel_groups(x, groups, comm, channels, offset):
    if channels is None:
        channels = x.shape[1] if offset is None else -1
    if offset is None:
        offset = shard_range(channels, comm.rank, comm.size)[0] if channels >= 0 else 0
    if channels >= 0 and comm.size == 1:
        offset = 0
    return groups, channels, offset


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


def _rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, comm, eps, stats,
                    handle=None):
    """The gated RMSNorm as _row_norm dispatches: the torch.library op while torch.compile
    traces, else the autograd Function; x and z of different dtypes as gated_inputs says."""
    x, z, weight, out = E.gated_inputs(x, z, weight)
    if out is not None:
        return _rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, comm,
                               eps, stats, handle).to(out)
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        return _lib.rms_norm_gated(x, z, weight, group_size, hidden, offset, norm_before_gate, h,
                                   float(eps), stats)[0]
    x, z = x.contiguous(), None if z is None else z.contiguous()
    if _cpp(x, z):
        return E._autograd.rms_norm_gated(x, z, weight, group_size, hidden, offset,
                                          norm_before_gate, address_of(comm),
                                          E._opt_address(eps, stats, 0))
    gg = _C.GatedGroups(group_size=group_size, hidden=hidden, offset=offset,
                        norm_before_gate=norm_before_gate)
    return E._RMSNormGated.apply(x, z, weight, (comm, gg, E.norm_options(eps, stats)))


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
            not (param.dtype is E._F32 and x.dtype in E._HALVES):
        y = sync_batch_norm(x.to(param.dtype), running_mean, running_var, weight, bias,
                            training, momentum, eps, process_group=process_group, stats=stats,
                            handle=handle)
        return y.to(x.dtype)
    if running_mean is not None and running_mean.dtype in E._HALVES:
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
    channels_last = E._channels_last(x)
    if _cpp(x):
        return E._autograd.sync_batch_norm(x, weight, bias, running_mean, running_var,
                                           address_of(comm), float(eps), momentum, bn_training,
                                           channels_last, int(E._STATS[stats]))
    opt = _C.BatchNormOptions(eps=eps, momentum=momentum,
                              training=bn_training, layout=E._LAYOUT[channels_last],
                              stats=E._STATS[stats])
    return E._SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, comm, opt,
                                channels_last)
