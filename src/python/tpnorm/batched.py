"""Several hidden-sharded row norms in ONE collective (tpnorm/batched.h): an attention's q-norm
and k-norm, say, whose statistics would otherwise cost one latency-bound all-reduce each.

    q, k = tpnorm.batched_row_norm([q, k], [q_weight, k_weight], eps=1e-6,
                                   hidden_sizes=[n_heads * head_dim, n_kv_heads * head_dim])

Each input is [..., local] (this rank's columns of its own hidden size), with its own weight
(this rank's slice) and optional bias; all share eps, the statistics mode and the group. Inputs
may be plain tensors (``process_group`` as for tpnorm.rms_norm; ``hidden_sizes``, each item's
whole hidden size, which the ranks' slices must tile, as rms_norm's normalized_shape) or
DTensors whose last dimension is Shard on one mesh dimension (the group is that mesh
dimension's, the hidden sizes the DTensors' own; outputs are DTensors laid out as the inputs).
Forward and backward each make exactly one all-reduce for all items.
"""
import torch

from . import _eager as E
from . import dtensor as D
from . import functional as F
from . import library as _lib
from .comm import address_of, as_communicator


def _check_lists(inputs, weights, biases, centered):
    k = len(inputs)
    weights = [None] * k if weights is None else list(weights)
    biases = [None] * k if biases is None else list(biases)
    if isinstance(centered, bool):
        centered = [centered] * k
    centered = [bool(c) for c in centered]
    if not (len(weights) == len(biases) == len(centered) == k):
        raise ValueError("tpnorm.batched_row_norm: inputs, weights, biases and centered need "
                         "one entry per item")
    for c, b in zip(centered, biases):
        if b is not None and not c:
            raise ValueError("tpnorm.batched_row_norm: an RMSNorm item has no bias")
    return weights, biases, centered


def batched_row_norm(inputs, weights=None, biases=None, eps=1e-5, *, centered=False,
                     hidden_sizes=None, process_group=None, stats="robust"):
    """LayerNorm (centered) / RMSNorm of each input over its sharded last dimension, all in
    one collective; returns the outputs as a tuple. ``centered`` is one bool for all items or
    one per item; ``weights`` / ``biases`` lists with None for an absent parameter (a DTensor
    parameter must be Shard(0) on the mesh dimension that shards its input). ``hidden_sizes``:
    each plain input's whole (unsharded) last dimension, which every rank checks the ranks'
    slices tile; needed where the group has more than one rank (DTensors carry their own)."""
    inputs = list(inputs)
    weights, biases, centered = _check_lists(inputs, weights, biases, centered)
    k = len(inputs)
    if hidden_sizes is not None:
        hidden_sizes = [int(n) for n in hidden_sizes]
        if len(hidden_sizes) != k:
            raise ValueError("tpnorm.batched_row_norm: hidden_sizes needs one entry per item")
    if k and D.is_dtensor(inputs[0]):
        hidden_sizes = [x.shape[-1] for x in inputs]
        comm = D._comm_for(inputs[0], process_group)
        tp = D._norm_mesh_dim(inputs[0])
        for x in inputs[1:]:
            if not D.is_dtensor(x) or x.device_mesh != inputs[0].device_mesh or \
                    D._norm_mesh_dim(x) != tp:
                raise ValueError("tpnorm.batched_row_norm: DTensor inputs must all shard their "
                                 "last dimension on the same mesh dimension")
        local = []
        for x, w, b in zip(inputs, weights, biases):
            # to_local / from_local are differentiable: gradients come back as DTensors
            local += [x.to_local(), _local(w, x, tp), _local(b, x, tp)]
    else:
        comm = as_communicator(process_group)
        local = [t for item in zip(inputs, weights, biases) for t in item]
        if hidden_sizes is None:
            if comm.size > 1:  # the same verdict on every rank: the size is the group's
                raise ValueError("tpnorm.batched_row_norm: pass hidden_sizes (each item's whole "
                                 "hidden size) when the group has more than one rank, so that "
                                 "the ranks' slices can be checked")
            hidden_sizes = [x.shape[-1] for x in inputs]
    ys = _batched(local[0::3], local[1::3], local[2::3], centered, hidden_sizes, comm, None, eps,
                  stats)
    if k and D.is_dtensor(inputs[0]):
        return tuple(D.DTensor.from_local(y, x.device_mesh, x.placements, run_check=False,
                                          shape=x.shape, stride=x.stride())
                     for y, x in zip(ys, inputs))
    return tuple(ys)


def _batched(xs, ws, bs, centered, hidden, comm, handle, eps, stats):
    """The K outputs of plain local tensors: the torch.library op while torch.compile traces
    (``handle``: comm's, looked up when None), else the eager autograd Function; hidden: each
    item's whole hidden size."""
    eps, hidden = float(eps), [int(n) for n in hidden]
    if _lib.compiling():
        h = _lib.comm_handle(comm) if handle is None else handle
        params = [w for w in ws if w is not None] + [b for b in bs if b is not None]
        return _lib.batched_row_norm(list(xs), params, [w is not None for w in ws],
                                     [b is not None for b in bs], list(centered), hidden, h, eps,
                                     stats)[0::3]
    if F._cpp(*xs):
        params = [w for w in ws if w is not None] + [b for b in bs if b is not None]
        return tuple(E._autograd.batched_row_norm(
            list(xs), params, [w is not None for w in ws], [b is not None for b in bs],
            [bool(c) for c in centered], hidden, address_of(comm), E._opt_address(eps, stats, 0)))
    return E._BatchedRowNorm.apply((comm, E.norm_options(eps, stats, 0), tuple(centered),
                                  tuple(hidden), len(xs)),
                                 *[t for item in zip(xs, ws, bs) for t in item])


def _local(p, x, tp):
    """A DTensor parameter's local slice (differentiable), checked against x's layout."""
    if p is None or not D.is_dtensor(p):
        return p
    D._local_param(p.detach(), x, tp)  # the placement checks only
    return p.to_local()
