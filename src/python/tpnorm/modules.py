"""torch.nn modules over tpnorm's ops (parameters are nn.Parameter, statistics are buffers).

Sharded modules (ShardedLayerNorm, ShardedRMSNorm, FusedAddLayerNorm, FusedAddRMSNorm,
ShardedGroupNorm, ShardedInstanceNorm) hold THIS rank's slice of the parameters: of hidden
size H over P ranks, rank r holds columns shard_range(H, r, P) unless ``local_size`` says
otherwise (any split works as long as the slices tile H in rank order). SyncBatchNorm is the
data-parallel one: full [C] parameters on every rank, statistics over every rank's batch.
"""
import torch
from torch import nn

from . import functional as F
from .comm import as_communicator


class _CommHolder:
    """A module keeping a tpnorm communicator: not copied by deepcopy/pickle (made again on
    first use from the stored group, which every copy shares)."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_comm"] = None
        return state

    @property
    def comm(self):
        if self._comm is None:
            self._comm = as_communicator(self.process_group)
        return self._comm


class _ShardedRowNorm(_CommHolder, nn.Module):
    def __init__(self, hidden_size, group, eps, affine, bias, local_size, device, dtype):
        super().__init__()
        self.process_group, self._comm = group, None
        rank, size = self.comm.rank, self.comm.size
        if local_size is None:
            self.shard = F.shard_range(hidden_size, rank, size)
        else:
            self.shard = (None, None)
        self.hidden_size = hidden_size
        self.local_size = local_size if local_size is not None else self.shard[1] - self.shard[0]
        self.eps = eps
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.local_size, **kw)) if affine else None
        self.bias = nn.Parameter(torch.zeros(self.local_size, **kw)) if affine and bias else None

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, local_size={self.local_size}, "
                f"shard={self.shard}, eps={self.eps}")


class ShardedLayerNorm(_ShardedRowNorm):
    """nn.LayerNorm(hidden_size) over the last dimension, sharded across ``group``: forward
    takes x [..., local_size] (this rank's columns) and returns this rank's columns of
    LayerNorm of the gathered rows, with one collective per forward and per backward."""

    def __init__(self, hidden_size, group=None, eps=1e-5, elementwise_affine=True, bias=True,
                 local_size=None, device=None, dtype=None):
        super().__init__(hidden_size, group, eps, elementwise_affine, bias, local_size, device,
                         dtype)

    def forward(self, x):
        return F._RowNorm.apply(x, self.weight, self.bias, self.comm, F.norm_options(self.eps),
                                True)


class ShardedRMSNorm(_ShardedRowNorm):
    """RMSNorm (x / sqrt(mean(x^2) + eps) * weight, no bias) sharded as ShardedLayerNorm."""

    def __init__(self, hidden_size, group=None, eps=1e-5, elementwise_affine=True,
                 local_size=None, device=None, dtype=None):
        super().__init__(hidden_size, group, eps, elementwise_affine, False, local_size, device,
                         dtype)

    def forward(self, x):
        return F._RowNorm.apply(x, self.weight, None, self.comm, F.norm_options(self.eps), False)


class FusedAddLayerNorm(_ShardedRowNorm):
    """forward(x, f) -> (h, y): h = alpha*x + f (the residual stream, returned for the next
    add) and y = ShardedLayerNorm(h), fused: one pass over the row, one collective.

    Pre-LN: x = residual, f = the sublayer output, y feeds the next sublayer (alpha 1).
    Post-LN: y is the block output (alpha 1). DeepNorm: alpha = deepnorm_alpha(stack, N, M).
    """

    def __init__(self, hidden_size, group=None, alpha=1.0, eps=1e-5, elementwise_affine=True,
                 bias=True, local_size=None, device=None, dtype=None):
        super().__init__(hidden_size, group, eps, elementwise_affine, bias, local_size, device,
                         dtype)
        self.alpha = float(alpha)

    def forward(self, x, f):
        return F._FusedAddNorm.apply(x, f, self.weight, self.bias, self.alpha, self.comm,
                                     F.norm_options(self.eps), True)


class FusedAddRMSNorm(_ShardedRowNorm):
    """FusedAddLayerNorm with RMSNorm: forward(x, f) -> (h, RMSNorm(h))."""

    def __init__(self, hidden_size, group=None, alpha=1.0, eps=1e-5, elementwise_affine=True,
                 local_size=None, device=None, dtype=None):
        super().__init__(hidden_size, group, eps, elementwise_affine, False, local_size, device,
                         dtype)
        self.alpha = float(alpha)

    def forward(self, x, f):
        return F._FusedAddNorm.apply(x, f, self.weight, None, self.alpha, self.comm,
                                     F.norm_options(self.eps), False)


class _ShardedChannelNorm(_CommHolder, nn.Module):
    def __init__(self, num_groups, num_channels, group, eps, affine, local_channels,
                 channel_offset, device, dtype, instance):
        super().__init__()
        self.process_group, self._comm = group, None
        start, stop = F.shard_range(num_channels, self.comm.rank, self.comm.size)
        if local_channels is not None:
            start, stop = channel_offset, channel_offset + local_channels
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.shard, self.instance = (start, stop), instance
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(stop - start, **kw)) if affine else None
        self.bias = nn.Parameter(torch.zeros(stop - start, **kw)) if affine else None

    def forward(self, x):
        cg = F._C.ChannelGroups(groups=self.num_groups, channels=self.num_channels,
                                channel_offset=self.shard[0])
        return F._GroupNorm.apply(x, self.weight, self.bias, cg, self.comm,
                                  F.norm_options(self.eps), self.instance)

    def extra_repr(self):
        return (f"num_groups={self.num_groups}, num_channels={self.num_channels}, "
                f"shard={self.shard}, eps={self.eps}")


class ShardedGroupNorm(_ShardedChannelNorm):
    """nn.GroupNorm(num_groups, num_channels) with the channels sharded across ``group``:
    forward takes [N, C_local, *spatial] (this rank's channels); a group may span ranks."""

    def __init__(self, num_groups, num_channels, group=None, eps=1e-5, affine=True,
                 local_channels=None, channel_offset=0, device=None, dtype=None):
        super().__init__(num_groups, num_channels, group, eps, affine, local_channels,
                         channel_offset, device, dtype, False)


class ShardedInstanceNorm(_ShardedChannelNorm):
    """nn.InstanceNorm{1,2,3}d(num_features) (batch statistics only: no running statistics)
    on channel-sharded input, as ShardedGroupNorm."""

    def __init__(self, num_features, group=None, eps=1e-5, affine=False, local_channels=None,
                 channel_offset=0, device=None, dtype=None):
        super().__init__(num_features, num_features, group, eps, affine, local_channels,
                         channel_offset, device, dtype, True)


class SyncBatchNorm(_CommHolder, nn.modules.batchnorm._BatchNorm):
    """torch.nn.SyncBatchNorm on tpnorm: statistics over the batch of every rank of
    ``process_group`` (a torch.distributed group, an mpi4py communicator, a tpnorm
    Communicator, or None for the default group), one collective per training forward and
    backward, ranks may hold different batch sizes including 0. Parameters and the buffers
    running_mean / running_var / num_batches_tracked are those of nn.BatchNorm2d, so
    state_dict() loads into either. Gradients of weight/bias are this rank's sums (all-reduce
    them with the rest of the model, as with torch's SyncBatchNorm)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group, self._comm = process_group, None

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        momentum = self.momentum
        tracking = self.training and self.track_running_stats
        if tracking and self.momentum is None:  # cumulative average, as torch
            momentum = 1.0 / float(self.num_batches_tracked.item() + 1)
        use_running = not self.training and self.track_running_stats
        y = F.sync_batch_norm(
            x, self.running_mean if (tracking or use_running) else None,
            self.running_var if (tracking or use_running) else None, self.weight, self.bias,
            training=not use_running, momentum=0.0 if momentum is None else momentum,
            eps=self.eps, comm=self.comm)
        if tracking:
            self.num_batches_tracked.add_(1)  # after the call: a failed call changes nothing
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """A copy-free conversion as torch.nn.SyncBatchNorm.convert_sync_batchnorm: every
        BatchNorm*d in ``module`` becomes a tpnorm.SyncBatchNorm over ``process_group``,
        keeping its parameters, buffers and train/eval mode. All converted layers share one
        tpnorm communicator."""
        comm = process_group if process_group is None else as_communicator(process_group)
        return cls._convert(module, comm)

    @classmethod
    def _convert(cls, module, comm):
        out = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, comm)
            if module.affine:
                with torch.no_grad():
                    out.weight, out.bias = module.weight, module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls._convert(child, comm))
        del module
        return out
