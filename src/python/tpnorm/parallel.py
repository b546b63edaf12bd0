"""A torch.distributed.tensor.parallel ParallelStyle for hidden-sharded norms (torch >= 2.5).

    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    parallelize_module(model, tp_mesh, {"blocks.*.up": ColwiseParallel(),
                                        "blocks.*.norm": tpnorm.parallel.HiddenShardedNorm(),
                                        "blocks.*.down": RowwiseParallel()})

turns each matched nn.LayerNorm / nn.RMSNorm into a hidden-sharded one in place: weight and
bias become DTensor parameters Shard(0) on the mesh (uneven as DTensor splits), the module's
forward runs tpnorm's op on the local shards (one all-reduce of statistics per forward and per
backward, no all-gather of activations), and state_dict keys stay those of the nn module.

load_full_state_dict / full_state_dict do for tpnorm's own Sharded* row modules (plain-tensor
parameters) what torch.distributed.checkpoint.state_dict does for DTensor parameters: an
unsharded checkpoint loads slice by slice, and gathers back bit for bit.
"""
from functools import partial

from torch import nn

from . import dtensor as D

if D.AVAILABLE:
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
else:  # torch without DTensor: the style cannot be made (see HiddenShardedNorm)
    ParallelStyle = object


def _forward_layer_norm(self, x):
    return D.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _forward_rms_norm(self, x):
    return D.rms_norm(x, self.normalized_shape, self.weight, self.eps)


# The module stays an instance of its class (isinstance, state_dict keys and the optimizer
# see an nn.LayerNorm); only its forward is tpnorm's: a subclass made once per nn class, assigned to
# the instance's __class__, rather than a per-instance bound method that deepcopy and pickle
# would have to carry.
_CLASSES = {}


def _sharded_class(cls):
    out = _CLASSES.get(cls)
    if out is None:
        if issubclass(cls, nn.LayerNorm):
            fwd = _forward_layer_norm
        elif hasattr(nn, "RMSNorm") and issubclass(cls, nn.RMSNorm):
            fwd = _forward_rms_norm
        else:
            raise NotImplementedError(f"tpnorm.parallel.HiddenShardedNorm: {cls.__name__} is "
                                      "neither nn.LayerNorm nor nn.RMSNorm")
        out = _CLASSES[cls] = type(f"HiddenSharded{cls.__name__}", (cls,), {"forward": fwd})
    return out


class HiddenShardedNorm(ParallelStyle):
    """Shard an nn.LayerNorm / nn.RMSNorm over its hidden (last) dimension on a 1-D mesh.

    Keyword Args:
        input_layouts (Placement): the layout of a plain-tensor input, annotated as a DTensor
            on the mesh: default Shard(-1), this rank's columns (what ColwiseParallel gives).
            The global shape comes from the module's normalized_shape, so uneven shards
            annotate right. A DTensor input with another layout is redistributed to Shard(-1)
            (from Replicate: a local slice, no communication).
        output_layouts (Placement): the output's layout: default Shard(-1) (no communication);
            another is reached with DTensor.redistribute.
        use_local_output (bool): return the local tensor instead of the DTensor. Default
            False, as torch's SequenceParallel: RowwiseParallel then takes the DTensor as is,
            while a local tensor would be annotated assuming even shards.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=False):
        if not D.AVAILABLE:
            raise RuntimeError("tpnorm.parallel needs torch.distributed.tensor (torch >= 2.5)")
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.use_local_output = use_local_output

    def _partition_fn(self, name, module, mesh):
        cls = _sharded_class(type(module))  # refuses other modules first
        if mesh.ndim != 1:
            raise ValueError("tpnorm.parallel.HiddenShardedNorm takes a 1-D mesh (pass the TP "
                             "dimension of a larger one, e.g. mesh['tp'])")
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"tpnorm.parallel.HiddenShardedNorm: normalized_shape {shape} "
                             "has more than one dimension")
        module.__class__ = cls
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_input_fn(input_layouts, mod, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            hidden = mod.normalized_shape[-1]
            layout = input_layouts[0]
            sharded = isinstance(layout, Shard) and layout.dim % x.dim() == x.dim() - 1
            shape = (*x.shape[:-1], hidden) if sharded else x.shape
            stride = [1] * len(shape)  # row-major global strides of that shape
            for i in range(len(shape) - 2, -1, -1):
                stride[i] = stride[i + 1] * shape[i + 1]
            x = DTensor.from_local(x.contiguous(), mesh, input_layouts, run_check=False,
                                   shape=shape, stride=tuple(stride))
        want = (Shard(x.ndim - 1),)
        if tuple(x.placements) != want:
            x = x.redistribute(mesh, want)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh):
        if tuple(outputs.placements) != tuple(output_layouts) and \
                not (isinstance(output_layouts[0], Shard) and
                     output_layouts[0].dim % outputs.ndim == outputs.ndim - 1):
            outputs = outputs.redistribute(mesh, output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module, device_mesh):
        return distribute_module(
            module, device_mesh, self._partition_fn,
            partial(self._prepare_input_fn, self.input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    def __repr__(self):
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


# --- full state dicts ------------------------------------------------------------------------
# A checkpoint of the unsharded model (an nn.LayerNorm's [H] weight) loads into a sharded one,
# and the sharded one's full state dict gathers it back, bit for bit. For DTensor parameters
# (HiddenShardedNorm, torch's own styles) that is torch's
# torch.distributed.checkpoint.state_dict.{set,get}_model_state_dict(full_state_dict=True);
# these two do the same for tpnorm's Sharded* / FusedAdd* row modules, whose parameters are
# plain tensors holding this rank's columns.

def _row_modules(model):
    from .modules import _ShardedRowNorm

    return [(n, m) for n, m in model.named_modules() if isinstance(m, _ShardedRowNorm)]


def _group_of(mod):
    import torch.distributed as dist

    g = mod.process_group
    if g is None:
        return dist.group.WORLD
    if isinstance(g, dist.ProcessGroup):
        return g
    raise ValueError("tpnorm.parallel: full state dicts of modules over an mpi4py or tpnorm "
                     "communicator are not supported; use a torch.distributed group")


def _columns(mod):
    """[start, stop) of this rank's columns, from the ranks' local sizes (collective)."""
    import torch.distributed as dist

    group = _group_of(mod)
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, mod.local_size, group=group)
    start = sum(sizes[:dist.get_rank(group)])
    return start, start + mod.local_size, sizes, group


def load_full_state_dict(model, state_dict):
    """Load an unsharded state dict (e.g. of the same model built with nn.LayerNorm) into
    ``model``: each tpnorm row module takes its columns of the full [..., H] tensors; every
    other entry loads as model.load_state_dict would (strict). Collective over each row
    module's group."""
    sd = dict(state_dict)
    for name, mod in _row_modules(model):
        start, stop, _, _ = _columns(mod)
        prefix = f"{name}." if name else ""
        for p in ("weight", "bias"):
            key = prefix + p
            if getattr(mod, p, None) is not None and key in sd:
                sd[key] = sd[key][..., start:stop]
    return model.load_state_dict(sd)


def full_state_dict(model):
    """``model.state_dict()`` with each tpnorm row module's parameters gathered to their full
    [..., H] tensors on every rank (collective over each row module's group)."""
    import torch
    import torch.distributed as dist

    sd = model.state_dict()
    for name, mod in _row_modules(model):
        _, _, sizes, group = _columns(mod)
        prefix = f"{name}." if name else ""
        for p in ("weight", "bias"):
            t = getattr(mod, p, None)
            if t is None:
                continue
            # all_gather needs equal sizes: pad every rank's columns to the widest, then cut.
            width = max(sizes)
            pad = torch.zeros(*t.shape[:-1], width, dtype=t.dtype)
            pad[..., :t.shape[-1]] = t.detach()
            parts = [torch.empty_like(pad) for _ in sizes]
            dist.all_gather(parts, pad.contiguous(), group=group)
            sd[prefix + p] = torch.cat([q[..., :n] for q, n in zip(parts, sizes)], dim=-1)
    return sd
