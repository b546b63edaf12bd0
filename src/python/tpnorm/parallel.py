"""A torch.distributed.tensor.parallel ParallelStyle for hidden-sharded norms (torch >= 2.5).

    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    parallelize_module(model, tp_mesh, {"blocks.*.up": ColwiseParallel(),
                                        "blocks.*.norm": tpnorm.parallel.HiddenShardedNorm(),
                                        "blocks.*.down": RowwiseParallel()})

turns each matched norm into a hidden-sharded one in place: nn.LayerNorm, nn.RMSNorm, and a
model library's own LayerNorm / RMSNorm classes (HF transformers' Olmo2RMSNorm, LlamaRMSNorm,
...: any module with a 1-D weight and an eps / variance_epsilon computing either over the last
dimension), keeping that class's numerics (tpnorm.norm_classes says how they are found). weight
and bias become DTensor parameters Shard(0) on the mesh (uneven as DTensor splits), the module's
forward runs tpnorm's op on the local shards (one all-reduce of statistics per forward and per
backward, no all-gather of activations), and state_dict keys stay those of the module.
QKNormPair does the same for an attention's q_norm and k_norm with ONE all-reduce for both;
olmo_core_qk_norm puts it into OLMo-core's own tensor parallelism (Transformer.apply_tp).
HiddenShardedNorm also takes Mamba-2's gated RMSNorm (transformers' MambaRMSNormGated /
Mamba2RMSNormGated, mamba_ssm's RMSNormGated: forward(hidden_states, gate)): its groups may span
ranks, and both inputs are laid out alike. shard_mamba2_mixer splits a whole transformers
Mamba-2 mixer by heads (vLLM's and Megatron's split), its gated norm on tpnorm's op.

load_full_state_dict / full_state_dict do for tpnorm's own Sharded* row modules (plain-tensor
parameters) what torch.distributed.checkpoint.state_dict does for DTensor parameters: an
unsharded checkpoint loads slice by slice, and gathers back bit for bit.
"""
import inspect
import types
from functools import partial

import torch
from torch import nn

from . import dtensor as D
from . import functional as F
from . import library as _lib
from . import norm_classes
from .batched import _batched
from .comm import as_communicator
from .comm import handle_of as comm_handle
from .modules import ShardedRMSNormGated, _ShardedChannelNorm, _ShardedRowNorm

if D.AVAILABLE:
    from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
else:  # torch without DTensor: the style cannot be made (see HiddenShardedNorm)
    ParallelStyle = object


def _forward(self, x):
    """A sharded norm's forward: tpnorm's op on the local shards (the torch.library op while
    torch.compile traces), with the numerics the module's class has (norm_classes.Numerics)."""
    y = _local_norm(self, x.to_local())
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=x.stride())


def _local(p):
    # DTensor.to_local is differentiable: the parameter's gradient comes back as a DTensor.
    return None if p is None else p.to_local()


class _ScaleShift(torch.autograd.Function):
    """weight * y + bias, broadcast over y's rows, with the parameters' gradients summed over
    the rows in float64, one column at a time: the same bits whatever the number of columns
    (torch's own reduction of a [rows, columns] tensor is blocked by its width), so that the
    stats="exact" promise, the same bits at any TP size, holds for these classes too."""

    @staticmethod
    def forward(ctx, y, weight, bias):
        ctx.save_for_backward(y, weight)
        ctx.has_bias = bias is not None
        out = weight * y
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, dout):
        y, weight = ctx.saved_tensors

        def column_sums(t, like):
            return t.reshape(-1, t.shape[-1]).t().contiguous().double().sum(1).to(like.dtype)

        dy = (dout * weight).to(y.dtype)
        dw = column_sums(dout * y, weight)
        return dy, dw, column_sums(dout, weight) if ctx.has_bias else None


def _scale_shift(y, weight, bias):
    if weight is None:
        return y if bias is None else y + bias
    return _ScaleShift.apply(y, weight, bias)


def _local_norm(mod, x):
    """``mod``'s norm of this rank's columns ``x`` (a plain tensor), one collective."""
    n, hidden, eps, stats, comm, handle = mod._tpnorm
    weight = _local(mod.weight)
    bias = _local(mod.bias) if n.has_bias else None
    if n.weight_after_cast:  # y = weight * norm(x).to(x.dtype) (+ bias), as the class does
        y = F._row_norm(x, (hidden,), None, None, comm, eps, stats, n.centered, handle)
        return _scale_shift(y, weight, bias)
    return F._row_norm(x, (hidden,), weight, bias, comm, eps, stats, n.centered, handle)


# The module stays an instance of its class (isinstance, state_dict keys and the optimizer
# see an nn.LayerNorm or the model's own norm class); only its forward is tpnorm's: a subclass
# made once per class, assigned to the instance's __class__, rather than a per-instance bound
# method that deepcopy and pickle would have to carry.
_CLASSES = {}


def _sharded_class(cls):
    out = _CLASSES.get(cls)
    if out is None:
        out = _CLASSES[cls] = type(f"HiddenSharded{cls.__name__}", (cls,), {"forward": _forward})
    return out


def _is_gated(module):
    """Mamba-2's gated RMSNorm: a 1-D weight, a group_size and forward(x, gate / z)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return (hasattr(module, "group_size") and len(params) >= 3 and params[2] in ("gate", "z")
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 1)


def _gated_forward(self, hidden_states, gate=None):
    """A sharded gated norm's forward: tpnorm's rms_norm_gated on the local shards. transformers'
    classes multiply the weight after casting the normalized values to the input's dtype; that
    cast point is kept (mamba_ssm's, with norm_before_gate, multiplies before it)."""
    _, _, eps, stats, _, _ = self._tpnorm
    group_size, norm_before_gate, after_cast = self._tpnorm_gated
    weight = None if after_cast else self.weight
    y = D.rms_norm_gated(hidden_states, weight, gate, eps, group_size=group_size,
                         norm_before_gate=norm_before_gate, stats=stats)
    if not after_cast:
        return y
    yl = _scale_shift(y.to_local(), _local(self.weight), None)
    return DTensor.from_local(yl, y.device_mesh, y.placements, run_check=False, shape=y.shape,
                              stride=y.stride())


def _shard_gated(module, mesh, stats, src_data_rank):
    hidden = module.weight.shape[0]
    group_size = module.group_size or hidden
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    nbg = bool(getattr(module, "norm_before_gate", False))
    after_cast = not hasattr(module, "norm_before_gate")  # transformers' classes
    comm = D._comm_of(mesh.get_group(0))
    cls = type(module)
    sharded = _CLASSES.get(cls)
    if sharded is None:
        sharded = _CLASSES[cls] = type(f"HiddenSharded{cls.__name__}", (cls,),
                                       {"forward": _gated_forward})
    module.__class__ = sharded
    module._tpnorm = (None, hidden, eps, stats, comm, comm_handle(comm) if _lib.AVAILABLE else None)
    module._tpnorm_gated = (int(group_size), nbg, after_cast)
    module.register_parameter("weight", nn.Parameter(
        distribute_tensor(module.weight, mesh, [Shard(0)], src_data_rank=src_data_rank),
        requires_grad=module.weight.requires_grad))


def _shard_norm(module, mesh, stats, src_data_rank):
    """Turns ``module`` (a supported norm, see norm_classes, or a gated RMSNorm) into a
    hidden-sharded one on the 1-D ``mesh``, in place."""
    if mesh.ndim != 1:
        raise ValueError("tpnorm.parallel: the style takes a 1-D mesh (pass the TP dimension "
                         "of a larger one, e.g. mesh['tp'])")
    if _is_gated(module):
        return _shard_gated(module, mesh, stats, src_data_rank)
    n = norm_classes.numerics(module)  # refuses other modules first, on every rank alike
    hidden = norm_classes.hidden_size(module)
    eps = norm_classes.eps_of(module)  # None: nn.RMSNorm's default, the compute type's
    comm = D._comm_of(mesh.get_group(0))
    module.__class__ = _sharded_class(type(module))
    module._tpnorm = (n, hidden, eps, stats, comm, comm_handle(comm) if _lib.AVAILABLE else None)
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(param, mesh, [Shard(0)], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class HiddenShardedNorm(ParallelStyle):
    """Shard a LayerNorm / RMSNorm (torch's or a model library's, see the module doc) or a
    gated RMSNorm (Mamba-2's; its gate laid out as its input) over its hidden (last) dimension
    on a 1-D mesh.

    Keyword Args:
        input_layouts (Placement): the layout of a plain-tensor input, annotated as a DTensor
            on the mesh: default Shard(-1), this rank's columns (what ColwiseParallel gives).
            The global shape comes from the module's hidden size, so uneven shards
            annotate right. A DTensor input with another layout is redistributed to Shard(-1)
            (from Replicate: a local slice, no communication).
        output_layouts (Placement): the output's layout: default Shard(-1) (no communication);
            another is reached with DTensor.redistribute.
        use_local_output (bool): return the local tensor instead of the DTensor. Default
            False, as torch's SequenceParallel: RowwiseParallel then takes the DTensor as is,
            while a local tensor would be annotated assuming even shards. True where the
            model's own code works on the local columns next (an attention's heads).
        stats (str): "robust" (default), "naive" or "exact": the statistics mode of
            tpnorm.rms_norm; "exact" gives the same bits at any number of ranks.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=False,
                 stats="robust"):
        if not D.AVAILABLE:
            raise RuntimeError("tpnorm.parallel needs torch.distributed.tensor (torch >= 2.5)")
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.use_local_output = use_local_output
        self.stats = stats

    def _partition_fn(self, name, module, mesh):
        _shard_norm(module, mesh, self.stats, self.src_data_rank)

    @staticmethod
    def _prepare_input_fn(input_layouts, mod, inputs, mesh):
        # A gated norm's gate (its second input) is laid out as the first.
        n = 2 if getattr(mod, "_tpnorm_gated", None) and len(inputs) > 1 and \
            inputs[1] is not None else 1
        return tuple(HiddenShardedNorm._annotate(input_layouts, mod, x, mesh)
                     for x in inputs[:n]) + tuple(inputs[n:])

    @staticmethod
    def _annotate(input_layouts, mod, x, mesh):
        """x as a DTensor Shard(-1) on the mesh (a plain tensor annotated with input_layouts)."""
        if not isinstance(x, DTensor):
            hidden = mod._tpnorm[1]
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
        return x

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


class _Given:
    """What the attention's own forward sees as ``self`` in a paired call: the attention, except
    that its q/k projections return the tensors already computed and its q/k norms pass them
    through (they were normalized together). The module's own methods that its forward calls
    (OLMo-core's ``self._prepare_qkv(x)``, which runs the projections and the norms) are bound
    to this stand-in as well, so that they see the same replacements: bound to the module, they
    would run the projections a second time and the norms on plain tensors. Attributes the
    forward sets go to the module. Nothing else of the module is changed, so a concurrent or
    re-entrant call (activation checkpointing's recompute) sees the module as it is."""

    def __init__(self, module, given):
        self.__dict__["_module"], self.__dict__["_given"] = module, given

    def __getattr__(self, name):
        given = self.__dict__["_given"]
        if name in given:
            return given[name]
        module = self.__dict__["_module"]
        value = getattr(module, name)
        if isinstance(value, types.MethodType) and value.__self__ is module:
            return types.MethodType(value.__func__, self)
        return value

    def __setattr__(self, name, value):
        setattr(self.__dict__["_module"], name, value)


def _paired_forward(self, hidden_states, *args, **kwargs):
    q_proj, k_proj, q_norm, k_norm = self._tpnorm_pair
    q_mod, k_mod = getattr(self, q_norm), getattr(self, k_norm)
    q, k = _pair(q_mod, k_mod, getattr(self, q_proj)(hidden_states),
                 getattr(self, k_proj)(hidden_states))
    given = {q_proj: lambda _h: q, k_proj: lambda _h: k, q_norm: _same, k_norm: _same}
    return _PAIRED_BASE[type(self)].forward(_Given(self, given), hidden_states, *args, **kwargs)


def _same(t):
    return t


def _pair(q_mod, k_mod, q, k):
    """q_norm(q), k_norm(k) of two sharded norms (see _shard_norm) with one all-reduce, on this
    rank's columns (plain tensors, as the attention's projections and heads use them)."""
    mods = (q_mod, k_mod)
    after = [m._tpnorm[0].weight_after_cast for m in mods]
    ws = [None if a else _local(m.weight) for a, m in zip(after, mods)]
    bs = [_local(m.bias) if m._tpnorm[0].has_bias and not a else None
          for a, m in zip(after, mods)]
    _, _, eps, stats, comm, handle = q_mod._tpnorm
    ys = _batched([q, k], ws, bs, [m._tpnorm[0].centered for m in mods],
                  [m._tpnorm[1] for m in mods], comm, handle, eps, stats)
    out = []
    for a, m, y in zip(after, mods, ys):
        if a:
            y = _scale_shift(y, _local(m.weight),
                             _local(m.bias) if m._tpnorm[0].has_bias else None)
        out.append(y)
    return out


_PAIRED_BASE = {}  # paired class -> the attention class it was made from
_PAIRED = {}


def _paired_class(cls):
    out = _PAIRED.get(cls)
    if out is None:
        out = _PAIRED[cls] = type(f"QKNormPaired{cls.__name__}", (cls,),
                                  {"forward": _paired_forward})
        _PAIRED_BASE[out] = cls
    return out


class QKNormPair(ParallelStyle):
    """An attention's q_norm and k_norm, hidden-sharded as HiddenShardedNorm shards each, with
    ONE all-reduce for both per forward and per backward. For attentions that compute
    ``q = q_norm(q_proj(h))`` and ``k = k_norm(k_proj(h))`` over all their heads, ``h`` the
    forward's first argument, in the forward itself or in methods of the module that it calls
    (HF transformers' OLMo 2, OLMo 3, OLMoE, FlexOlmo, MiniMax-M2; OLMo-core's Attention, whose
    names are w_q, w_k: olmo_core_qk_norm below): apply it to the attention module, with
    torch's ColwiseParallel on the projections and RowwiseParallel on the output one:

        plan = {"model.layers.*.self_attn": tpnorm.parallel.QKNormPair(),
                "model.layers.*.self_attn.q_proj": ColwiseParallel(),
                "model.layers.*.self_attn.k_proj": ColwiseParallel(),
                "model.layers.*.self_attn.v_proj": ColwiseParallel(),
                "model.layers.*.self_attn.o_proj": RowwiseParallel()}

    The attention's class gets a forward that runs the two projections, normalizes both in one
    call and then runs the class's own forward with those results in place of the projections'
    and the norms' (the module is not changed meanwhile); parameters and state_dict keys stay.
    So nothing the attention does between a projection and its norm (OLMo-core's clip_qkv
    clamp) would come before the norm: such attentions are not for this style.

    Keyword Args:
        q_proj, k_proj, q_norm, k_norm (str): the submodules' names (HF's by default).
        stats (str): as HiddenShardedNorm's.
    """

    def __init__(self, *, q_proj="q_proj", k_proj="k_proj", q_norm="q_norm", k_norm="k_norm",
                 stats="robust"):
        if not D.AVAILABLE:
            raise RuntimeError("tpnorm.parallel needs torch.distributed.tensor (torch >= 2.5)")
        super().__init__()
        self.names = (q_proj, k_proj, q_norm, k_norm)
        self.stats = stats

    def _apply(self, module, device_mesh):
        for name in self.names:
            if not isinstance(getattr(module, name, None), nn.Module):
                raise ValueError(f"tpnorm.parallel.QKNormPair: {type(module).__name__} has no "
                                 f"submodule {name!r}")
        q_mod, k_mod = getattr(module, self.names[2]), getattr(module, self.names[3])
        for mod in (q_mod, k_mod):
            _shard_norm(mod, device_mesh, self.stats, self.src_data_rank)
        if q_mod._tpnorm[2:4] != k_mod._tpnorm[2:4]:
            raise ValueError("tpnorm.parallel.QKNormPair: q_norm and k_norm have different eps "
                             f"({q_mod._tpnorm[2]} and {k_mod._tpnorm[2]})")
        module.__class__ = _paired_class(type(module))
        module._tpnorm_pair = self.names
        return module

    def __repr__(self):
        return f"{type(self).__name__}(names={self.names}, stats={self.stats!r})"


# --- full state dicts ------------------------------------------------------------------------
# A checkpoint of the unsharded model (an nn.LayerNorm's [H] weight) loads into a sharded one,
# and the sharded one's full state dict gathers it back, bit for bit. For DTensor parameters
# (HiddenShardedNorm, torch's own styles) that is torch's
# torch.distributed.checkpoint.state_dict.{set,get}_model_state_dict(full_state_dict=True);
# these two do the same for every tpnorm module whose parameters are plain tensors holding this
# rank's slice: the row modules (Sharded{Layer,RMS}Norm, FusedAdd*: columns of the last
# dimension) and the channel modules (ShardedGroupNorm, ShardedInstanceNorm,
# ShardedRMSNormGated: [C_local] slices at their own offsets).

def _sharded_modules(model):
    kinds = (_ShardedRowNorm, _ShardedChannelNorm, ShardedRMSNormGated)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def _group_of(mod):
    import torch.distributed as dist

    g = mod.process_group
    if g is None:
        return dist.group.WORLD
    if isinstance(g, dist.ProcessGroup):
        return g
    raise ValueError("tpnorm.parallel: full state dicts of modules over an mpi4py or tpnorm "
                     "communicator are not supported; use a torch.distributed group")


def _slices(mod):
    """(this rank's [start, stop), every rank's, the group): a row module's columns are
    consecutive in rank order (its local sizes, gathered); a channel module's slice is its
    ``shard``, wherever it sits. Collective over the module's group."""
    import torch.distributed as dist

    group = _group_of(mod)
    mine = tuple(mod.shard) if getattr(mod, "shard", None) and not hasattr(mod, "local_size") \
        else (None, mod.local_size)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if mine[0] is None:  # row module: sizes -> consecutive slices
        starts = [sum(size for _, size in every[:r]) for r in range(len(every))]
        every = [(a, a + size) for a, (_, size) in zip(starts, every)]
    return every[dist.get_rank(group)], every, group


def load_full_state_dict(model, state_dict):
    """Load an unsharded state dict (e.g. of the same model built with nn.LayerNorm,
    nn.GroupNorm or transformers' Mamba2RMSNormGated) into ``model``: each tpnorm sharded module
    takes its slice of the full tensors' last dimension; every other entry loads as
    model.load_state_dict would (strict). Collective over each sharded module's group."""
    sd = dict(state_dict)
    for name, mod in _sharded_modules(model):
        (start, stop), _, _ = _slices(mod)
        prefix = f"{name}." if name else ""
        for p in ("weight", "bias"):
            key = prefix + p
            if getattr(mod, p, None) is not None and key in sd:
                sd[key] = sd[key][..., start:stop]
    return model.load_state_dict(sd)


def full_state_dict(model):
    """``model.state_dict()`` with each tpnorm sharded module's parameters gathered to their
    full tensors on every rank (collective over each module's group)."""
    import torch
    import torch.distributed as dist

    sd = model.state_dict()
    for name, mod in _sharded_modules(model):
        _, every, group = _slices(mod)
        sizes = [b - a for a, b in every]
        prefix = f"{name}." if name else ""
        for p in ("weight", "bias"):
            t = getattr(mod, p, None)
            if t is None:
                continue
            # all_gather needs equal sizes: pad every rank's slice to the widest, then place
            # each at its offset.
            width = max(sizes)
            pad = torch.zeros(*t.shape[:-1], width, dtype=t.dtype)
            pad[..., :t.shape[-1]] = t.detach()
            parts = [torch.empty_like(pad) for _ in sizes]
            dist.all_gather(parts, pad.contiguous(), group=group)
            full = torch.empty(*t.shape[:-1], max(b for _, b in every), dtype=t.dtype)
            for (a, b), q in zip(every, parts):
                full[..., a:b] = q[..., :b - a]
            sd[prefix + p] = full
    return sd


# --- HF transformers' own tensor-parallel plans ----------------------------------------------
def register_hf_style(name, style):
    """Registers a tpnorm ParallelStyle (QKNormPair, HiddenShardedNorm) under ``name`` in HF
    transformers' registry of tensor-parallel styles, so that a plan given to
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan=...))`` can name it:

        tpnorm.parallel.register_hf_style("tpnorm_qk_pair", tpnorm.parallel.QKNormPair())
        plan = {"model.layers.*.self_attn": "tpnorm_qk_pair",
                "model.layers.*.self_attn.q_proj": "colwise", ... k_proj, v_proj: "colwise",
                "model.layers.*.self_attn.o_proj": "rowwise"}

    HF applies a module's style before it loads the weights (on the meta device): the style
    shards the norms' parameters there, each rank its own slice (no broadcast), and HF's
    loader fills the DTensor slices from the checkpoint."""
    from transformers.distributed.tensor_parallel import (ALL_PARALLEL_STYLES,
                                                          TensorParallelLayer)

    if not isinstance(style, (HiddenShardedNorm, QKNormPair)):
        raise TypeError(f"tpnorm.parallel.register_hf_style: {type(style).__name__} is not "
                        "one of tpnorm's styles")

    class _HFStyle(TensorParallelLayer):
        def install_forward(self, module, mesh, *, config=None, mesh_manager=None):
            style.src_data_rank = None  # every rank slices its own part: nothing to broadcast
            style._apply(module, mesh)
            return module

        def __repr__(self):
            return f"hf({style!r})"

    ALL_PARALLEL_STYLES.register(name, _HFStyle())
    return name


# --- OLMo-core's tensor parallelism -------------------------------------------------------------
# OLMo-core (ai2-olmo-core) builds its models from its own modules, and Transformer.apply_tp (as
# its train module's parallelize_model) calls each block's apply_tp, which calls its attention's
# own apply_tp. For a q/k norm over all heads that one makes w_q / w_k put their output
# sequence-sharded (Shard(1): an all-to-all of q and of k from the heads' split), runs the norms
# as SequenceParallel and sends their output back to the heads' split (a second all-to-all),
# in each pass. olmo_core_qk_norm gives each such attention an apply_tp of its own instead, which
# OLMo-core's calls: its plan with q and k left head-sharded, and the two norms as QKNormPair.

def _olmo_core_attention_tp(attn, stats, tp_mesh, input_layout=None, output_layout=None,
                            use_local_output=True, float8_enabled=False):
    """OLMo-core's Attention.apply_tp (same signature, same plan for the input, w_v, w_out and
    w_g) with w_q / w_k plain column-parallel (local output) and q_norm / k_norm as QKNormPair."""
    from olmo_core.nn.utils import get_tp_wrappers
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    rowwise, colwise, prepare_input = get_tp_wrappers(float8_enabled=float8_enabled)
    del attn.apply_tp  # used once: the class's own again (applying TP twice fails as before)
    parallelize_module(attn, tp_mesh, prepare_input(
        input_layouts=None if input_layout is None else (input_layout,),
        desired_input_layouts=(Replicate(),)))
    plan = {"w_q": colwise(), "w_k": colwise(), "w_v": colwise(),
            "w_out": rowwise(output_layouts=output_layout, use_local_output=use_local_output)}
    if attn.w_g is not None:
        plan["w_g"] = colwise()
    parallelize_module(attn, tp_mesh, plan)
    parallelize_module(attn, tp_mesh, QKNormPair(q_proj="w_q", k_proj="w_k", stats=stats))


def olmo_core_qk_norm(model, *, stats="robust"):
    """Makes OLMo-core's tensor parallelism keep q and k head-sharded and normalize them with
    tpnorm, in every attention of ``model`` (an OLMo-core Transformer, or any module holding
    OLMo-core Attention modules) whose q_norm and k_norm span all heads (OLMo 2, OLMo 3, OLMoE:
    ``qk_norm`` without ``use_head_qk_norm``). Call it before TP is applied:

        model = TransformerConfig.olmo2_7B(vocab_size=...).build(init_device="meta")
        tpnorm.parallel.olmo_core_qk_norm(model)
        model.apply_tp(tp_mesh)       # or OLMo-core's train module, which calls it

    Each such attention gets an ``apply_tp`` of its own (an instance attribute, which OLMo-core's
    block calls in place of the class's; removed when used) with OLMo-core's plan except that
    w_q and w_k stay plain column-parallel and q_norm / k_norm become QKNormPair (stats: as its):
    one all-reduce of per-token statistics per layer and pass instead of the two all-to-alls of q
    and k. The norms' weights become DTensors Shard(0) (OLMo-core's: Replicate); state_dict keys
    stay, and a distributed checkpoint of either loads into the other. Attentions without these
    norms are left to OLMo-core. Refused, before anything changes: a model with none of them, a
    subclass with its own apply_tp (FusedAttentionV2's packed w_qkv, NormalizedAttention),
    clip_qkv (its clamp comes between projection and norm), scalable_softmax and
    use_recompute_qkv_prep (its recompute would no longer cover the projections and norms).
    Returns ``model``."""
    from olmo_core.nn.attention import Attention

    chosen = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Attention) or mod.q_norm is None or mod.k_norm is None or \
                mod.use_head_qk_norm:
            continue
        where = f"tpnorm.parallel.olmo_core_qk_norm: {name or 'the model'} ({type(mod).__name__})"
        if type(mod).apply_tp is not Attention.apply_tp:
            raise ValueError(f"{where} has its own apply_tp; only OLMo-core's Attention plan is "
                             "taken")
        if mod.clip_qkv is not None or mod.ssmax_scale is not None or \
                mod.use_recompute_qkv_prep:
            raise ValueError(f"{where} uses clip_qkv, scalable_softmax or "
                             "use_recompute_qkv_prep, which this route does not keep")
        if "apply_tp" in mod.__dict__:
            raise ValueError(f"{where} is already set")
        chosen.append(mod)
    if not chosen:
        raise ValueError("tpnorm.parallel.olmo_core_qk_norm: no OLMo-core Attention with q_norm "
                         "and k_norm over all heads in the model")
    for mod in chosen:
        mod.apply_tp = partial(_olmo_core_attention_tp, mod, stats)
    return model


# --- Mamba-2 mixers, head-parallel ------------------------------------------------------------
# transformers' Mamba-2 mixers (Mamba2Mixer; the hybrids' BambaMixer,
# GraniteMoeHybridMambaLayer) split over a group by heads, as vLLM and Megatron split them; the
# mixer's own forward then runs on this rank's parameters (with local head and channel counts),
# and its gated norm, whose groups span ranks, is tpnorm's.

class _CopyToRegion(torch.autograd.Function):
    """A tensor replicated on every rank of ``group`` that each rank's part of the model uses
    for its own share of the work: forward the identity, backward the sum over the ranks of the
    gradient (Megatron's "copy to the tensor-parallel region"), of rows [lo, hi) of dim 0 only
    when ``rows`` is (lo, hi), the other rows being this rank's alone."""

    @staticmethod
    def forward(ctx, t, group, rows):
        ctx.group, ctx.rows = group, rows
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad if ctx.rows is None else grad[ctx.rows[0]:ctx.rows[1]],
                        group=ctx.group)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    """The sum over ``group`` of the ranks' partial results (a row-parallel projection's):
    forward all-reduces, backward the identity (the sum's gradient is the same on every rank;
    Megatron's "reduce from the tensor-parallel region")."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        t = t.contiguous().clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _copied(p, group, rows):
    """``p`` whose rows [lo, hi) = ``rows`` are on every rank (None: no row is)."""
    return p if p is None or rows is None else _CopyToRegion.apply(p, group, rows)


def _in_proj_forward(self, x):
    """in_proj's rows of this rank: [z | x | B | C | dt], B and C those of every rank."""
    group, rows = self._tpnorm_heads
    return torch.nn.functional.linear(_CopyToRegion.apply(x, group, None),
                                      _copied(self.weight, group, rows),
                                      _copied(self.bias, group, rows))


def _out_proj_forward(self, x):
    """A row-parallel out_proj: this rank's columns' partial product, summed over the group."""
    group, _ = self._tpnorm_heads
    y = _ReduceFromRegion.apply(torch.nn.functional.linear(x, self.weight), group)
    return y if self.bias is None else y + self.bias


def _conv_param(name):
    """conv1d.weight / .bias as the mixer reads them: the parameter, its B and C channels'
    gradient summed over the group where those channels are on every rank."""

    def get(self):
        group, rows = self._tpnorm_heads
        return _copied(self._parameters[name], group, rows)

    return property(get)


def _norm_forward(self, hidden_states, gate=None):
    """transformers' gated norm on this rank's channels: tpnorm's op without the weight (the
    normalized values in the input's dtype), then ``weight *`` as the class multiplies it."""
    hidden, offset, comm = self._tpnorm_heads
    y = F._rms_norm_gated(hidden_states, gate, None, int(self.group_size), hidden, offset, False,
                          comm, self.variance_epsilon, "robust")
    return self.weight * y


def _mixer_forward(self, *args, **kwargs):
    """The mixer class's own forward, seeing ``training`` False: transformers' fused training
    kernel (mamba_ssm's mamba_split_conv1d_scan_combined, where installed) computes the whole
    mixer in one call, norm and out_proj included, which would not be head-parallel."""
    return _HEADS_BASE[type(self)].forward(_Given(self, {"training": False}), *args, **kwargs)


_HEADS_BASE = {}  # head-parallel class -> the class it was made from
_HEADS = {}  # (class, role) -> head-parallel class


def _heads_class(cls, role, namespace):
    """The subclass of ``cls`` made once per (class, role in the mixer)."""
    out = _HEADS.get((cls, role))
    if out is None:
        out = _HEADS[cls, role] = type(f"HeadParallel{cls.__name__}", (cls,), namespace)
        _HEADS_BASE[out] = cls
    return out


def _kept(p, index, dim=0):
    return None if p is None else nn.Parameter(p.detach().index_select(dim, index).clone(),
                                               requires_grad=p.requires_grad)


def shard_mamba2_mixer(mixer, process_group=None):
    """Splits a transformers Mamba-2 mixer over the ranks of ``process_group`` (a
    torch.distributed group; None: the default one) by heads, in place, and returns it:
    ``Mamba2Mixer`` and the mixers of the same layout (``BambaMixer``,
    ``GraniteMoeHybridMambaLayer``). With H heads of head_dim d (I = H d channels), n_groups G
    and state size N, rank r of P keeps heads [r H/P, (r+1) H/P), i.e. channels
    c = [r I/P, (r+1) I/P):

    - in_proj (rows [z: I | x: I | B: G N | C: G N | dt: H]): the z and x rows of c, the B and
      C rows of its groups, the dt rows of its heads; conv1d: the x channels of c and the B and
      C channels of its groups; dt_bias, A_log and D: its heads; the gated norm's weight: c.
    - G = 1: B and C are the same on every rank (every head reads them); each rank keeps all
      their rows and channels, and their gradients are summed over the group in backward.
      G a multiple of P: rank r keeps groups [r G/P, (r+1) G/P), its heads' own, nothing
      replicated. Other G are refused.
    - in_proj's input is replicated: its gradient is summed over the group in backward.
      out_proj is row-parallel: this rank's columns c, the product all-reduced in forward
      (its bias, if any, added once after the sum).
    - The gated norm stays an instance of its class and computes what it computes (its weight
      multiplied after the cast to the input's dtype), with tpnorm's op on channels c: one
      all-reduce of statistics per forward and per backward; its groups may span ranks.

    The mixer's own forward then runs with local head and channel counts (num_heads,
    intermediate_size, n_groups, conv_dim), except that it never takes transformers' fused
    training kernel (a whole-mixer call that would bypass the split); a cache holds this rank's
    heads' conv and recurrent states. Collectives besides the norm's: forward one (out_proj's),
    backward one for the input's gradient and, with G = 1, one per B/C parameter (in_proj's
    weight and bias, conv1d's weight and bias). Parameters are plain tensors holding this
    rank's rows and state_dict keys stay the mixer's: load the unsharded checkpoint first,
    then shard."""
    import torch.distributed as dist

    group = dist.group.WORLD if process_group is None else process_group
    P, r = dist.get_world_size(group), dist.get_rank(group)
    name = type(mixer).__name__
    if type(mixer) in _HEADS_BASE:
        raise ValueError(f"tpnorm.parallel.shard_mamba2_mixer: this {name} is already sharded")
    attrs = ("num_heads", "head_dim", "ssm_state_size", "n_groups", "intermediate_size",
             "in_proj", "conv1d", "out_proj", "norm", "dt_bias", "A_log", "D")
    if not all(hasattr(mixer, a) for a in attrs) or hasattr(mixer, "mup_vector") or \
            not _is_gated(mixer.norm) or mixer.in_proj.out_features != \
            2 * mixer.intermediate_size + 2 * mixer.n_groups * mixer.ssm_state_size + \
            mixer.num_heads or mixer.intermediate_size != mixer.num_heads * mixer.head_dim:
        raise ValueError(f"tpnorm.parallel.shard_mamba2_mixer: {name} is not laid out as "
                         "transformers' Mamba2Mixer (in_proj rows [z | x | B | C | dt], a gated "
                         "norm over intermediate_size channels)")
    H, d, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    I, norm = mixer.intermediate_size, mixer.norm
    if H % P or not (G == 1 or G % P == 0):
        raise ValueError(f"tpnorm.parallel.shard_mamba2_mixer: {name} has {H} heads in {G} "
                         f"groups; a split over {P} ranks needs the heads to divide by {P} and "
                         f"n_groups 1 or a multiple of {P}")
    Hl, Gl = H // P, (1 if G == 1 else G // P)
    h0, g0, Il = r * Hl, (0 if G == 1 else r * Gl), Hl * d

    def span(start, n):
        return list(range(start, start + n))

    bc = span(g0 * N, Gl * N)
    proj = (span(h0 * d, Il) + span(I + h0 * d, Il) + [2 * I + i for i in bc] +
            [2 * I + G * N + i for i in bc] + span(2 * I + 2 * G * N + h0, Hl))
    conv = span(h0 * d, Il) + [I + i for i in bc] + [I + G * N + i for i in bc]
    shared = G == 1 and P > 1  # B and C on every rank: their rows' gradients summed
    proj_rows = (2 * Il, 2 * Il + 2 * N) if shared else None
    conv_rows = (Il, Il + 2 * N) if shared else None
    proj, conv = torch.tensor(proj), torch.tensor(conv)
    heads = torch.arange(h0, h0 + Hl)

    lin = mixer.in_proj
    lin.weight, lin.bias = _kept(lin.weight, proj), _kept(lin.bias, proj)
    lin.out_features = len(proj)
    lin.__class__ = _heads_class(type(lin), "in_proj", {"forward": _in_proj_forward})
    lin._tpnorm_heads = (group, proj_rows)

    c1d = mixer.conv1d
    weight, bias = _kept(c1d.weight, conv), _kept(c1d.bias, conv)
    c1d.__class__ = _heads_class(type(c1d), "conv1d",
                                 {"weight": _conv_param("weight"), "bias": _conv_param("bias")})
    c1d._parameters["weight"], c1d._parameters["bias"] = weight, bias
    c1d.in_channels = c1d.out_channels = c1d.groups = len(conv)
    c1d._tpnorm_heads = (group, conv_rows)

    for pname in ("dt_bias", "A_log", "D"):
        setattr(mixer, pname, _kept(getattr(mixer, pname), heads))

    out = mixer.out_proj
    out.weight = _kept(out.weight, torch.arange(h0 * d, h0 * d + Il), dim=1)
    out.in_features = Il
    out.__class__ = _heads_class(type(out), "out_proj", {"forward": _out_proj_forward})
    out._tpnorm_heads = (group, None)

    norm.weight = _kept(norm.weight, torch.arange(h0 * d, h0 * d + Il))
    norm.__class__ = _heads_class(type(norm), "norm", {"forward": _norm_forward})
    norm._tpnorm_heads = (I, h0 * d, as_communicator(group))

    mixer.num_heads, mixer.intermediate_size, mixer.n_groups = Hl, Il, Gl
    mixer.conv_dim = Il + 2 * Gl * N
    mixer.__class__ = _heads_class(type(mixer), "mixer", {"forward": _mixer_forward})
    return mixer
