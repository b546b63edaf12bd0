"""tpnorm's row norms on DTensors (torch.distributed.tensor, torch >= 2.5).

``layer_norm``, ``rms_norm``, ``fused_add_layer_norm``, ``fused_add_rms_norm`` and
``rms_norm_gated`` of this module are those of tpnorm.functional (the package exports these),
extended: an input that is
a DTensor whose last (normalized) dimension is Shard on one mesh dimension runs on the local
shards with ONE all-reduce of statistics over that mesh dimension's process group, and the
outputs are DTensors with the input's placements, shape and strides. Other mesh dimensions may
shard the leading (batch) dimensions or replicate; their ranks never communicate here.
weight / bias: DTensors Shard(0) on that mesh dimension (Replicate on the others), or this
rank's local slices as plain tensors. Shards may be uneven or empty, as DTensor makes them.

Backward gives DTensors: dx with x's placements; dweight / dbias with the weight's placements,
except Partial("sum") on mesh dimensions that shard the batch (each rank summed its own rows;
the reduction that finishes them is the data-parallel one, exactly as for any other
parameter, so it is left to the optimizer step's redistribute or to FSDP/DDP).

Why an autograd Function over to_local / from_local and not register_sharding on the
tpnorm::row_norm custom op: DTensor's sharding propagation runs an op on the local shards
without telling it the mesh, and the tpnorm op's one collective needs the normalized mesh
dimension's communicator. Through register_sharding, the strategy would also have to give the
per-row float32 statistics (shaped by the flattened rows) placements that match uneven batch
shards, and DTensor would silently insert redistributes (an all-gather of activations) for any
input placement the strategy does not list. Here the placements are checked, never changed:
the only collective in a forward or a backward is tpnorm's own all-reduce of statistics.
"""

import torch

from . import _eager as E
from . import functional as F
from .comm import as_communicator, local

try:  # torch >= 2.5: the public DTensor API
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    AVAILABLE = True
except ImportError:  # torch 1.13 (Debian) and other old ones: plain tensors only
    DTensor = None
    AVAILABLE = False

def is_dtensor(t):
    return AVAILABLE and isinstance(t, DTensor)


def _comm_of(group):
    """The group's communicator (one per group, made on first use: tpnorm.as_communicator)."""
    return as_communicator(group)


def _norm_mesh_dim(x):
    """The mesh dimension sharding x's last dimension (None when none does). The placements
    are the same on every rank, so a refusal here is the same error everywhere, before any
    collective."""
    last = x.ndim - 1
    dims = [i for i, p in enumerate(x.placements)
            if isinstance(p, Shard) and (p.dim % x.ndim if x.ndim else 0) == last]
    for i, p in enumerate(x.placements):
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"tpnorm: input placement {p} on mesh dimension {i}: only Shard "
                             "and Replicate are supported (a Partial input has no statistics)")
    if len(dims) > 1:
        raise ValueError(f"tpnorm: the normalized dimension is sharded on mesh dimensions "
                         f"{dims}; shard it on one")
    return dims[0] if dims else None


def _local_param(p, x, tp):
    """This rank's slice of a weight / bias (None stays None), checked against x's layout."""
    if p is None or not is_dtensor(p):
        return p
    if p.device_mesh != x.device_mesh:
        raise ValueError("tpnorm: weight/bias live on another device mesh than the input")
    for i, pl in enumerate(p.placements):
        want_shard = i == tp
        if want_shard and not (isinstance(pl, Shard) and pl.dim % max(p.ndim, 1) == p.ndim - 1):
            raise ValueError(f"tpnorm: weight/bias must be Shard({p.ndim - 1}) on mesh "
                             f"dimension {tp}, as the input's normalized dimension "
                             f"(got {pl})")
        if not want_shard and not isinstance(pl, Replicate):
            raise ValueError(f"tpnorm: weight/bias must be Replicate on mesh dimension {i} "
                             f"(got {pl})")
    return p.to_local()


def _grad_placements(p, x):
    """A parameter's gradient placements: the parameter's, Partial where x's batch is
    sharded (that rank's rows only)."""
    out = list(p.placements)
    for i, pl in enumerate(x.placements):
        if isinstance(pl, Shard) and pl.dim % x.ndim != x.ndim - 1:
            out[i] = Partial("sum")
    return out


def _local_grad(g, like):
    """The local part of an incoming gradient laid out as the output ``like`` (a DTensor)."""
    if g is None:
        return None
    if is_dtensor(g):
        if tuple(g.placements) != tuple(like.placements):
            g = g.redistribute(like.device_mesh, like.placements)
        g = g.to_local()
    return g.contiguous()


def _wrap(t, like):
    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


class _DRowNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm of a DTensor: local shards, one all-reduce on the TP group."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm, opt, centered):
        tp = _norm_mesh_dim(x)
        xl = x.to_local().contiguous()
        wl, bl = _local_param(weight, x, tp), _local_param(bias, x, tp)
        y, mean, rstd = E.row_norm_forward(comm, xl, wl, bl, opt, centered)
        ctx.save_for_backward(xl, wl, mean, rstd)
        ctx.comm, ctx.opt, ctx.centered = comm, opt, centered
        ctx.x, ctx.weight, ctx.bias = _Meta(x), _Meta(weight), _Meta(bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _wrap(y, x)

    @staticmethod
    def backward(ctx, dy):
        xl, wl, mean, rstd = ctx.saved_tensors
        x = ctx.x
        dx, dw, db = E.row_norm_backward(ctx.comm, _local_grad(dy, x), xl, wl, mean, rstd,
                                          ctx.opt, ctx.centered, ctx.bias.present,
                                          ctx.bias_dtype)
        return (_wrap(dx, x), _wrap_param_grad(dw, ctx.weight, x),
                _wrap_param_grad(db, ctx.bias, x), None, None, None)


class _DFusedAddNorm(torch.autograd.Function):
    """h = alpha*x + f and y = Norm(h) of DTensors laid out alike: returns (h, y)."""

    @staticmethod
    def forward(ctx, x, f, weight, bias, alpha, comm, opt, centered):
        tp = _norm_mesh_dim(x)
        if not is_dtensor(f) or tuple(f.placements) != tuple(x.placements) or \
                f.shape != x.shape:
            raise ValueError("tpnorm: fused add + norm needs x and f as DTensors of the same "
                             "shape and placements")
        xl, fl = x.to_local().contiguous(), f.to_local().contiguous()
        wl, bl = _local_param(weight, x, tp), _local_param(bias, x, tp)
        h, y, mean, rstd = E.fused_add_norm_forward(comm, xl, fl, wl, bl, alpha, opt,
                                                     centered)
        ctx.set_materialize_grads(False)
        h, y = _wrap(h, x), _wrap(y, x)
        # h saved as the output DTensor, not its local tensor: autograd's version check then
        # sees an in-place op on the returned h (the local tensor's own counter does not).
        ctx.save_for_backward(h, wl, mean, rstd)
        ctx.alpha, ctx.comm, ctx.opt, ctx.centered = alpha, comm, opt, centered
        ctx.x, ctx.weight, ctx.bias = _Meta(x), _Meta(weight), _Meta(bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return h, y

    @staticmethod
    def backward(ctx, dh, dy):
        h, wl, mean, rstd = ctx.saved_tensors
        h = h.to_local()
        x = ctx.x
        dx, df, dw, db = E.fused_add_norm_backward(
            ctx.comm, _local_grad(dh, x), _local_grad(dy, x), h, wl, mean, rstd, ctx.alpha,
            ctx.opt, ctx.centered, ctx.bias.present, ctx.bias_dtype)
        return (_wrap(dx, x), _wrap(df, x), _wrap_param_grad(dw, ctx.weight, x),
                _wrap_param_grad(db, ctx.bias, x), None, None, None, None)


class _DRMSNormGated(torch.autograd.Function):
    """The gated RMSNorm of a DTensor x (and gate laid out alike): local shards, one
    all-reduce on the group of the mesh dimension sharding the channels."""

    @staticmethod
    def forward(ctx, x, z, weight, comm, group_size, norm_before_gate, opt):
        tp = _norm_mesh_dim(x)
        if z is not None and (not is_dtensor(z) or tuple(z.placements) != tuple(x.placements)
                              or z.shape != x.shape):
            raise ValueError("tpnorm: rms_norm_gated needs the gate as a DTensor of the input's "
                             "shape and placements")
        xl = x.to_local().contiguous()
        zl = None if z is None else z.to_local().contiguous()
        wl = _local_param(weight, x, tp)
        gg = E._C.GatedGroups(group_size=group_size, hidden=x.shape[-1],
                              offset=_shard_offset(x, tp), norm_before_gate=norm_before_gate)
        y, rstd = E.rms_norm_gated_forward(comm, xl, zl, wl, gg, opt)
        ctx.save_for_backward(xl, zl, wl, rstd)
        ctx.comm, ctx.gg, ctx.opt = comm, gg, opt
        ctx.x, ctx.z, ctx.weight = _Meta(x), _Meta(z), _Meta(weight)
        return _wrap(y, x)

    @staticmethod
    def backward(ctx, dy):
        xl, zl, wl, rstd = ctx.saved_tensors
        x = ctx.x
        dx, dz, dw = E.rms_norm_gated_backward(ctx.comm, _local_grad(dy, x), xl, zl, wl, rstd,
                                                ctx.gg, ctx.opt)
        return (_wrap(dx, x), None if dz is None else _wrap(dz, x),
                _wrap_param_grad(dw, ctx.weight, x), None, None, None, None)


def _shard_offset(x, tp):
    """The first global column of this rank's shard of x's last dimension: Shard places
    torch.chunk's pieces, ceil(n / parts) columns each, in mesh-coordinate order."""
    if tp is None:
        return 0
    n, parts = x.shape[-1], x.device_mesh.size(tp)
    return min(x.device_mesh.get_coordinate()[tp] * (-(-n // parts)), n)


class _Meta:
    """What backward needs of a DTensor (mesh, placements, shape, stride) without keeping the
    tensor itself alive; for a plain tensor or None only whether it was there."""

    def __init__(self, t):
        self.present = t is not None
        self.dtensor = is_dtensor(t)
        if self.dtensor:
            self.device_mesh, self.placements = t.device_mesh, tuple(t.placements)
            self.shape, self.ndim, self._stride = t.shape, t.ndim, t.stride()

    def stride(self):
        return self._stride


# A parameter's gradient: a DTensor where the parameter was one (p is its _Meta), else the
# plain local tensor.
def _wrap_param_grad(g, p, x):
    if g is None or not p.dtensor:
        return g
    return DTensor.from_local(g, p.device_mesh, _grad_placements(p, x), run_check=False,
                              shape=p.shape, stride=p.stride())


def _comm_for(x, process_group):
    if process_group is not None:
        raise ValueError("tpnorm: with a DTensor input the group is the mesh dimension that "
                         "shards the normalized dimension; pass process_group=None")
    tp = _norm_mesh_dim(x)
    if tp is None:  # the whole row on every rank: its statistics need no collective
        return local(x.device)
    return _comm_of(x.device_mesh.get_group(tp))


def _options(x, normalized_shape, eps, stats):
    shape = F._shape_arg(normalized_shape)
    if len(shape) != 1 or shape[0] != x.shape[-1]:
        raise ValueError(f"tpnorm: with a DTensor input normalized_shape is the global size "
                         f"of its last dimension ({x.shape[-1]}), got {tuple(shape)}")
    _, hidden, eps = F._row_shape(x, shape, eps)
    return E.norm_options(eps, stats, hidden)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *, process_group=None,
               stats="robust"):
    """tpnorm.functional.layer_norm, also for a DTensor input (see the module doc)."""
    if not is_dtensor(input):
        return F.layer_norm(input, normalized_shape, weight, bias, eps,
                            process_group=process_group, stats=stats)
    comm = _comm_for(input, process_group)
    return _DRowNorm.apply(input, weight, bias, comm,
                           _options(input, normalized_shape, eps, stats), True)


def rms_norm(input, normalized_shape, weight=None, eps=None, *, process_group=None,
             stats="robust"):
    """tpnorm.functional.rms_norm, also for a DTensor input (see the module doc)."""
    if not is_dtensor(input):
        return F.rms_norm(input, normalized_shape, weight, eps, process_group=process_group,
                          stats=stats)
    comm = _comm_for(input, process_group)
    return _DRowNorm.apply(input, weight, None, comm,
                           _options(input, normalized_shape, eps, stats), False)


def fused_add_layer_norm(x, f, normalized_shape, weight=None, bias=None, alpha=1.0, eps=1e-5, *,
                         process_group=None, stats="robust"):
    """tpnorm.functional.fused_add_layer_norm, also for DTensors x and f: (h, y)."""
    if not is_dtensor(x):
        return F.fused_add_layer_norm(x, f, normalized_shape, weight, bias, alpha, eps,
                                      process_group=process_group, stats=stats)
    comm = _comm_for(x, process_group)
    return _DFusedAddNorm.apply(x, f, weight, bias, float(alpha), comm,
                                _options(x, normalized_shape, eps, stats), True)


def fused_add_rms_norm(x, f, normalized_shape, weight=None, alpha=1.0, eps=None, *,
                       process_group=None, stats="robust"):
    """tpnorm.functional.fused_add_rms_norm, also for DTensors x and f: (h, y)."""
    if not is_dtensor(x):
        return F.fused_add_rms_norm(x, f, normalized_shape, weight, alpha, eps,
                                    process_group=process_group, stats=stats)
    comm = _comm_for(x, process_group)
    return _DFusedAddNorm.apply(x, f, weight, None, float(alpha), comm,
                                _options(x, normalized_shape, eps, stats), False)


def rms_norm_gated(input, weight=None, gate=None, eps=1e-5, *, group_size=None,
                   norm_before_gate=False, hidden_size=None, offset=None, process_group=None,
                   stats="robust"):
    """tpnorm.functional.rms_norm_gated, also for a DTensor input (and gate) whose last
    dimension is Shard on one mesh dimension: hidden_size and offset come from the DTensor."""
    if not is_dtensor(input):
        return F.rms_norm_gated(input, weight, gate, eps, group_size=group_size,
                                norm_before_gate=norm_before_gate, hidden_size=hidden_size,
                                offset=offset, process_group=process_group, stats=stats)
    if hidden_size is not None and hidden_size != input.shape[-1]:
        raise ValueError(f"tpnorm: with a DTensor input hidden_size is the global size of its "
                         f"last dimension ({input.shape[-1]}), got {hidden_size}")
    comm = _comm_for(input, process_group)
    x, z, w, out = F.gated_inputs(input, gate, weight)  # x and the gate may differ in dtype
    y = _DRMSNormGated.apply(x, z, w, comm, -1 if group_size is None else int(group_size),
                             bool(norm_before_gate), E.norm_options(eps, stats))
    return y if out is None else y.to(out)
