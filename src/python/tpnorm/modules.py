"""torch.nn modules over tpnorm's ops (parameters are nn.Parameter, statistics are buffers).

Signatures are torch.nn's (ShardedLayerNorm as nn.LayerNorm, ShardedRMSNorm as nn.RMSNorm,
ShardedGroupNorm as nn.GroupNorm, ShardedInstanceNorm as nn.InstanceNorm2d, SyncBatchNorm as
nn.SyncBatchNorm, ShardedRMSNormGated as mamba_ssm's RMSNormGated and transformers'
MambaRMSNormGated), with keyword-only additions: ``process_group`` (anything
tpnorm.as_communicator accepts; None is the default torch.distributed group when one is
initialised, else one process) and the shard's size.

Sharded modules hold THIS rank's slice of the parameters: of hidden size H over P ranks, rank r
holds columns shard_range(H, r, P) unless ``local_size`` says otherwise (any split works as
long as the slices tile H in rank order; the op checks that on every rank). SyncBatchNorm is
the data-parallel one: full [C] parameters on every rank, statistics over every rank's batch.
"""
import copy

import torch
from torch import nn

from . import _tpnorm as _C
from . import functional as F
from . import library
from .comm import Communicator, as_communicator, local


class _CommHolder:
    """A module keeping a tpnorm communicator. A deep copy (an EMA model, say) shares the group
    and the communicator: they are handles on the job's processes, not data to copy, and the
    copy normalises over the same ranks; sharing them costs no collective, so a copy made or
    first run on one rank alone never waits for the others. Pickling drops the communicator
    (made again on first use from the stored group)."""

    _handle = None  # the communicator's torch.library handle (library.comm_handle)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_comm"], state["_handle"] = None, None
        return state

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = self.__dict__.copy()
        shared = {k: state.pop(k) for k in ("process_group", "_comm", "_handle") if k in state}
        new.__dict__.update(copy.deepcopy(state, memo))
        new.__dict__.update(shared)
        return new

    @property
    def comm(self):
        """The module's communicator: one per group (tpnorm.as_communicator), made on first
        use (collective over the group for mpi4py and NCCL groups)."""
        if self._comm is None:
            self._comm = as_communicator(self.process_group)
            if library.AVAILABLE:
                self._handle = library.comm_handle(self._comm)
        return self._comm


def _shape(normalized_shape):
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(d) for d in normalized_shape)


class _ShardedRowNorm(_CommHolder, nn.Module):
    """normalized_shape as nn.LayerNorm's (int or tuple), its last dimension sharded: this
    rank holds local_size of its normalized_shape[-1] columns, by default
    shard_range(normalized_shape[-1], rank, size) (then ``shard`` is (start, stop); with an
    explicit local_size it is None). The op checks on every rank that the slices tile it."""

    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype,
                 process_group, local_size):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        if not self.normalized_shape:
            raise ValueError("normalized_shape must have at least one dimension")
        self.process_group, self._comm = process_group, None
        H = self.normalized_shape[-1]
        if local_size is None:
            self.shard = F.shard_range(H, self.comm.rank, self.comm.size)
            local_size = self.shard[1] - self.shard[0]
        else:
            self.shard = None
            self.comm  # noqa: B018 - the communicator (and its handle) from construction on
        self.local_size = int(local_size)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        shape = self.normalized_shape[:-1] + (self.local_size,)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(shape, **kw)) if elementwise_affine and bias \
            else None
        self.reset_parameters()

    @property
    def hidden_size(self):
        """The full (unsharded) size of the sharded dimension."""
        return self.normalized_shape[-1]

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, local_size={self.local_size}, "
                f"shard={self.shard}")


class ShardedLayerNorm(_ShardedRowNorm):
    """nn.LayerNorm(normalized_shape) with the last dimension of normalized_shape sharded
    across ``process_group``: forward takes x [..., *normalized_shape[:-1], local_size] (this
    rank's columns) and returns this rank's columns of LayerNorm of the gathered rows, with one
    collective per forward and per backward. weight and bias are this rank's slices."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, process_group=None, local_size=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         process_group, local_size)

    def forward(self, x):
        return F._row_norm(x, self.normalized_shape, self.weight, self.bias, self.comm,
                           self.eps, "robust", True, self._handle)


class ShardedRMSNorm(_ShardedRowNorm):
    """nn.RMSNorm (x / sqrt(mean(x^2) + eps) * weight, no bias; eps None is torch's default,
    torch.finfo(torch.float32).eps for float32/float16/bfloat16) sharded as ShardedLayerNorm."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, process_group=None, local_size=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype,
                         process_group, local_size)

    def forward(self, x):
        return F._row_norm(x, self.normalized_shape, self.weight, None, self.comm, self.eps,
                           "robust", False, self._handle)


class FusedAddLayerNorm(_ShardedRowNorm):
    """forward(x, f) -> (h, y): h = alpha*x + f (the residual stream, returned for the next
    add) and y = ShardedLayerNorm(h), fused: one pass over the row, one collective.

    Pre-LN: x = residual, f = the sublayer output, y feeds the next sublayer (alpha 1).
    Post-LN: y is the block output (alpha 1). DeepNorm: alpha = deepnorm_alpha(stack, N, M).
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, alpha=1.0, process_group=None, local_size=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         process_group, local_size)
        self.alpha = float(alpha)

    def forward(self, x, f):
        return F._fused_add_norm(x, f, self.normalized_shape, self.weight, self.bias,
                                 self.alpha, self.comm, self.eps, "robust", True, self._handle)

    def extra_repr(self):
        return super().extra_repr() + f", alpha={self.alpha}"


class FusedAddRMSNorm(_ShardedRowNorm):
    """FusedAddLayerNorm with RMSNorm: forward(x, f) -> (h, RMSNorm(h))."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, alpha=1.0, process_group=None, local_size=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype,
                         process_group, local_size)
        self.alpha = float(alpha)

    def forward(self, x, f):
        return F._fused_add_norm(x, f, self.normalized_shape, self.weight, None, self.alpha,
                                 self.comm, self.eps, "robust", False, self._handle)

    def extra_repr(self):
        return super().extra_repr() + f", alpha={self.alpha}"


def _slice(comm, total, local, offset):
    """[start, stop) of this rank's slice of ``total`` channels: shard_range's without a local
    size; with one, from ``offset``, or (offset None) consecutive in rank order, each rank's
    offset the sum of the lower ranks' sizes (one collective over comm, here at construction).
    Explicit offsets are checked in every call: slices that overlap or leave a gap fail there
    on every rank."""
    if local is None:
        if offset is not None:
            raise ValueError("an offset needs the local size it starts (local_channels / "
                             "local_size)")
        return F.shard_range(total, comm.rank, comm.size)
    local = int(local)
    if offset is None:
        offset = _C.slice_offset(comm, local, int(total))
    return int(offset), int(offset) + local


class _ShardedChannelNorm(_CommHolder, nn.Module):
    def __init__(self, num_groups, num_channels, eps, affine, device, dtype, process_group,
                 local_channels, channel_offset, instance):
        super().__init__()
        self.process_group, self._comm = process_group, None
        start, stop = _slice(self.comm, num_channels, local_channels, channel_offset)
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.affine = affine
        self.shard, self.instance = (start, stop), instance
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(stop - start, **kw)) if affine else None
        self.bias = nn.Parameter(torch.empty(stop - start, **kw)) if affine else None
        self.reset_parameters()

    def reset_parameters(self):
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x):
        cg = (self.num_groups, self.num_channels, self.shard[0])
        return F._group_norm(x, self.weight, self.bias, cg, self.comm, self.eps, "robust",
                             self.instance, self._handle)

    def extra_repr(self):
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, shard={self.shard}")


class ShardedGroupNorm(_ShardedChannelNorm):
    """nn.GroupNorm(num_groups, num_channels) with the channels sharded across
    ``process_group``: forward takes [N, C_local, *spatial] (this rank's channels: by default
    shard_range(num_channels, rank, size); with local_channels, that many from channel_offset,
    or, without channel_offset, the slices consecutive in rank order); a group may span
    ranks."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None,
                 dtype=None, *, process_group=None, local_channels=None, channel_offset=None):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, process_group,
                         local_channels, channel_offset, False)


class ShardedInstanceNorm(_ShardedChannelNorm):
    """nn.InstanceNorm{1,2,3}d(num_features) on channel-sharded input, as ShardedGroupNorm.
    Batch statistics only: track_running_stats=True is an error (momentum is accepted for the
    signature and unused, as torch's without running statistics)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False,
                 track_running_stats=False, device=None, dtype=None, *, process_group=None,
                 local_channels=None, channel_offset=None):
        if track_running_stats:
            raise ValueError("tpnorm.ShardedInstanceNorm keeps no running statistics: "
                             "track_running_stats must be False")
        super().__init__(num_features, num_features, eps, affine, device, dtype, process_group,
                         local_channels, channel_offset, True)
        self.momentum, self.track_running_stats = momentum, False


class ShardedRMSNormGated(_CommHolder, nn.Module):
    """Mamba-2's gated RMSNorm (mamba_ssm's RMSNormGated, transformers' MambaRMSNormGated)
    with the channels sharded across ``process_group``: forward(hidden_states, gate=None) takes
    [..., local_size] (this rank's channels: by default shard_range(hidden_size, rank, size);
    with local_size, that many from ``offset``, or, without offset, the slices consecutive in
    rank order) and returns this rank's channels of

        norm_before_gate=False:  rmsnorm(x * silu(gate)) * weight   (Mamba-2's layers)
        norm_before_gate=True:   rmsnorm(x) * weight * silu(gate)

    with statistics per group of ``group_size`` channels (None: the whole row, n_groups = 1);
    a group may span ranks. One collective per forward and per backward. weight is this rank's
    slice, initialised to ones."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=False,
                 device=None, dtype=None, *, process_group=None, local_size=None, offset=None):
        super().__init__()
        self.process_group, self._comm = process_group, None
        start, stop = _slice(self.comm, hidden_size, local_size, offset)
        self.hidden_size, self.eps = int(hidden_size), eps
        self.group_size = self.hidden_size if group_size is None else int(group_size)
        self.norm_before_gate, self.shard = bool(norm_before_gate), (start, stop)
        self.weight = nn.Parameter(torch.ones(stop - start, device=device, dtype=dtype))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, hidden_states, gate=None):
        return F._rms_norm_gated(hidden_states, gate, self.weight, self.group_size,
                                 self.hidden_size, self.shard[0], self.norm_before_gate,
                                 self.comm, self.eps, "robust", self._handle)

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, shard={self.shard}")


class SyncBatchNorm(_CommHolder, nn.modules.batchnorm._BatchNorm):
    """torch.nn.SyncBatchNorm on tpnorm: statistics over the batch of every rank of
    ``process_group`` (a torch.distributed group, an mpi4py communicator, a tpnorm
    Communicator, or None for the default group), one collective per training forward and
    backward, ranks may hold different batch sizes including 0. Parameters and the buffers
    running_mean / running_var / num_batches_tracked are those of nn.BatchNorm2d, so
    state_dict() loads into either, in any floating dtype (``.half()``, ``.bfloat16()``).
    Gradients of weight/bias are this rank's sums (all-reduce them with the rest of the model,
    as with torch's SyncBatchNorm).

    As torch's: eval never synchronises (running statistics, or without them each rank's own
    batch statistics); a rank outside a torch.distributed sub-group normalises its own batch;
    ``process_group`` is what was passed. The communicator is made at the first training call
    (collective over the group for an mpi4py communicator)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group, self._comm = process_group, None

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def _sync_comm(self, x):
        """The communicator of a training call: the group's, or this process's own where this
        rank is outside the torch.distributed group (torch normalises locally there too)."""
        if _outside(self.process_group):
            return local(x.device)
        return self.comm

    def forward(self, x):
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        sync = bn_training and self.training  # eval never synchronises, as torch's
        comm = self._sync_comm(x) if sync else local(x.device)
        problem = _input_problem(x, self.num_features)
        if problem:
            if comm.size == 1:
                raise ValueError(problem)
            # The other ranks are in this call's collective: the same error on every rank.
            _C.set_caller_failure(problem)
            x = x.new_empty((0, self.num_features))
        tracking = self.training and self.track_running_stats
        momentum = self.momentum
        if tracking and self.momentum is None:  # cumulative average, as torch
            momentum = 1.0 / float(self.num_batches_tracked.item() + 1)
        running = not self.training or self.track_running_stats
        try:
            y = F.sync_batch_norm(
                x, self.running_mean if running else None,
                self.running_var if running else None, self.weight, self.bias,
                training=bn_training, momentum=0.0 if momentum is None else momentum,
                eps=self.eps, process_group=comm,
                handle=self._handle if comm is self._comm else None)
        finally:
            if problem:
                _C.set_caller_failure("")  # taken by the call, or dropped if none was made
        if tracking:
            self.num_batches_tracked.add_(1)  # after the call: a failed call changes nothing
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module, process_group=None):
        """A copy-free conversion as torch.nn.SyncBatchNorm.convert_sync_batchnorm: every
        BatchNorm*d in ``module`` (torch.nn.SyncBatchNorm too) becomes a tpnorm.SyncBatchNorm
        over ``process_group``, keeping its parameters, buffers and train/eval mode. timm's
        BatchNormAct2d (BatchNorm, then its ``drop`` and ``act`` modules) becomes a
        SyncBatchNormAct, which keeps them. Any other subclass with a forward of its own is
        refused with a TypeError rather than converted without what its forward adds. Every
        converted layer keeps ``process_group`` as given; they share one tpnorm communicator
        (one per group), made at the first training call."""
        return cls._convert(module, process_group)

    @classmethod
    def _convert(cls, module, process_group):
        out = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and \
                not isinstance(module, SyncBatchNorm):
            kind = cls if type(module).forward in _PLAIN_BATCH_NORM else _norm_act_class(module)
            out = kind(module.num_features, module.eps, module.momentum, module.affine,
                       module.track_running_stats, process_group)
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
            out.add_module(name, cls._convert(child, process_group))
        del module
        return out


def _outside(group):
    """Whether this rank is outside ``group``, a torch.distributed group (torch.distributed
    .new_group hands such a rank a placeholder, not a group)."""
    if group is None or isinstance(group, Communicator) or hasattr(group, "py2f"):
        return False
    import torch.distributed as dist

    not_in = getattr(dist.distributed_c10d, "_rank_not_in_group", None)
    return bool(not_in(group)) if not_in else group is dist.GroupMember.NON_GROUP_MEMBER


def _input_problem(x, channels):
    """torch.nn.SyncBatchNorm's checks of its input, as a message ("" when it passes)."""
    if x.dim() < 2:
        return f"expected at least 2D input (got {x.dim()}D input)"
    if x.shape[1] == 0:
        return "SyncBatchNorm number of input channels should be non-zero"
    return ""


# The forwards that are BatchNorm and nothing else (BatchNorm1d/2d/3d and the lazy ones inherit
# _BatchNorm's).
_PLAIN_BATCH_NORM = (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward)


class SyncBatchNormAct(SyncBatchNorm):
    """tpnorm.SyncBatchNorm followed by the ``drop`` and ``act`` modules of the timm
    BatchNormAct2d it was converted from (convert_sync_batchnorm moves them over as children,
    so state_dict keys stay timm's)."""

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def _norm_act_class(module):
    """SyncBatchNormAct for a module shaped as timm's BatchNormAct2d (a BatchNorm with drop
    and act children, applied in that order after it); a TypeError for any other BatchNorm
    subclass whose forward is its own."""
    children = dict(module.named_children())
    if type(module).__name__ in ("BatchNormAct2d", "SyncBatchNormAct") and {"drop", "act"} <= set(children):
        return SyncBatchNormAct
    raise TypeError(
        f"tpnorm.SyncBatchNorm.convert_sync_batchnorm: {type(module).__qualname__} is a "
        f"BatchNorm with a forward of its own, which a SyncBatchNorm would not run; convert it "
        f"by hand (a subclass of tpnorm.SyncBatchNorm whose forward adds what it adds)")
