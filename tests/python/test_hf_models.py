# test_hf_models.py — tpnorm's ParallelStyles inside HF transformers' own modeling code: OLMo 2,
# OLMoE, FlexOlmo and MiniMax-M2, whose q_norm / k_norm are RMSNorms over all heads of the q / k
# projection (so, with the heads split over ranks, their statistics span ranks). Each model is
# built from a tiny Config (random weights, nothing downloaded), tensor-parallelized with torch's
# parallelize_module (ColwiseParallel q/k/v, RowwiseParallel o; OLMo 2's MLP too) and either
# HiddenShardedNorm on q_norm and k_norm (HF's own norm classes, their numerics kept) or
# QKNormPair on the attention (both norms in one collective), and compared with the same model
# unsharded in one process:
#
# - float32: loss, logits and every gradient after backward (2e-5 of each tensor's largest
#   value; 1e-4 for the gradients, whose MoE routers amplify float32 rounding), the parameters
#   after three AdamW steps (1e-4, a tenth of one step's update), and the number of tpnorm collectives
#   per forward and per backward (one per layer with the pair, two without);
# - bf16: logits of the bf16 model against the unsharded bf16 model (3e-2 of the largest);
# - greedy generate with a KV cache: the same tokens;
# - activation checkpointing (HF's gradient_checkpointing_enable): the same gradients;
# - torch.compile: no graph break in the sharded model (torch._dynamo.explain), and a compiled
#   forward + backward (aot_eager) as the eager one;
# - the full state_dict round trip: an unsharded checkpoint loads into the sharded model and
#   gathers back bit for bit (torch.distributed.checkpoint.state_dict).
#
# Same bits at any TP size: with stats="exact", the q/k norms' outputs and gradients (both
# numerics: weight in float32 as OLMo 2, weight after the cast as OLMoE) are bit-identical to
# TP 1 (a one-rank mesh in the same job) at every world size the suite runs (1-3). The negative
# control: RMSNorm with its sum of squares all-reduced outside autograd (as training code that
# calls torch.distributed.all_reduce on the statistics does) gets dx wrong by far more than
# tpnorm's error, which the test measures instead of asserting.
#
# Runs at 1, 2 and 3 ranks; needs transformers (the PyPI-torch venv of the suite has it:
# TPNORM_EXPECT_HF=1 makes its absence a failure instead of a skip).
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpnorm
from support import WORLD, assert_everywhere, full

_EXPECT = os.environ.get("TPNORM_EXPECT_HF") == "1"
try:
    import transformers as T
except ImportError as e:  # Debian's torch has none
    if _EXPECT:
        raise
    pytest.skip(f"needs transformers ({e})", allow_module_level=True)
if not tpnorm.dtensor.AVAILABLE:
    pytest.skip("needs torch.distributed.tensor", allow_module_level=True)
if WORLD.size > 3:
    pytest.skip("runs at 1, 2 and 3 ranks", allow_module_level=True)

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

P = WORLD.size
LAYERS = 2
# 12 query heads and 6 key/value heads (GQA) of 4: q_norm over 48, k_norm over 24 columns. Every
# sharded width (48, 24 and the MLP's 72) divides by 1, 2 and 3: torch's ColwiseParallel shards
# a DTensor evenly, and the attention splits each rank's columns into whole heads.
COMMON = dict(vocab_size=64, hidden_size=48, intermediate_size=72, num_hidden_layers=LAYERS,
              num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=64,
              pad_token_id=0, rms_norm_eps=1e-6, attn_implementation="sdpa")
MOE = dict(num_experts=4, num_experts_per_tok=2)
MODELS = {
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON)),
    "olmoe": lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**COMMON, **MOE)),
    "flex_olmo": lambda: T.FlexOlmoForCausalLM(T.FlexOlmoConfig(**COMMON, **MOE)),
    "minimax_m2": lambda: T.MiniMaxM2ForCausalLM(T.MiniMaxM2Config(
        **COMMON, head_dim=4, num_local_experts=4, num_experts_per_tok=2)),
}
_mesh = []


def mesh():
    if not _mesh:
        _mesh.append(init_device_mesh("cpu", (P,)))
    return _mesh[0]


def build(name):
    """The unsharded model, its norms' weights moved off ones (so a lost weight shows)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def plan(name, style, stats="robust"):
    attn = "model.layers.*.self_attn"
    out = {f"{attn}.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    out[f"{attn}.o_proj"] = RowwiseParallel()
    if style == "pair":
        out[attn] = tpnorm.parallel.QKNormPair(stats=stats)
    else:
        for n in ("q_norm", "k_norm"):
            out[f"{attn}.{n}"] = tpnorm.parallel.HiddenShardedNorm(use_local_output=True,
                                                                   stats=stats)
    if name == "olmo2":  # the dense MLP too; the MoE models' experts stay replicated
        out.update({"model.layers.*.mlp.gate_proj": ColwiseParallel(),
                    "model.layers.*.mlp.up_proj": ColwiseParallel(),
                    "model.layers.*.mlp.down_proj": RowwiseParallel()})
    return out


def sharded(model, name, style, stats="robust"):
    return parallelize_module(copy.deepcopy(model), mesh(), plan(name, style, stats))


def full_grad(p):
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def full_value(p):
    return p.full_tensor() if isinstance(p, DTensor) else p


def rel(got, want):
    return float((got.detach().double() - want.detach().double()).abs().max() /
                 want.detach().double().abs().max().clamp_min(1e-30))


def ids(seed=2, rows=2, cols=7):
    return torch.randint(1, 64, (rows, cols), generator=torch.Generator().manual_seed(seed))


def tpnorm_comm():
    return tpnorm.dtensor._comm_of(mesh().get_group(0))


@pytest.mark.parametrize("style", ["single", "pair"])
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_as_the_unsharded_model(name, style):
    ref = build(name)
    tp = sharded(ref, name, style)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (ref, tp)]
    comm = tpnorm_comm()
    comm.set_strict_calls(0)  # one collective per call from here on
    report, counts = [], []
    for step in range(3):
        x = ids(seed=10 + step)
        out_r = ref(input_ids=x, labels=x)
        c0 = comm.calls
        out_t = tp(input_ids=x, labels=x)
        c1 = comm.calls
        out_r.loss.backward()
        out_t.loss.backward()
        counts.append((c1 - c0, comm.calls - c1))
        if abs(float(out_t.loss) - float(out_r.loss)) > 1e-5 * abs(float(out_r.loss)):
            report.append(f"step {step}: loss {float(out_t.loss)} != {float(out_r.loss)}")
        if rel(out_t.logits, out_r.logits) > 2e-5:
            report.append(f"step {step}: logits off by {rel(out_t.logits, out_r.logits):.3g}")
        for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
            if a.grad is None and b.grad is None:
                continue  # an expert no token was routed to
            if rel(full_grad(b), a.grad) > 1e-4:
                report.append(f"step {step}: grad of {n} off by {rel(full_grad(b), a.grad):.3g}")
        for o in opts:
            o.step()
            o.zero_grad()
    for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        err = float((full_value(b).detach() - a.detach()).abs().max())
        if err > 1e-4:  # a tenth of one step's update (lr 1e-3)
            report.append(f"after 3 steps: {n} off by {err:.3g}")
    per_layer = 1 if style == "pair" else 2
    if P > 1 and any(c != (per_layer * LAYERS,) * 2 for c in counts):
        report.append(f"tpnorm collectives (forward, backward) per step {counts}, want "
                      f"{per_layer * LAYERS} each")
    assert_everywhere(not report, report)


@pytest.mark.parametrize("style", ["single", "pair"])
@pytest.mark.parametrize("name", ["olmo2", "olmoe"])
def test_bf16_generate_and_checkpointing(name, style):
    ref = build(name)
    tp = sharded(ref, name, style)
    report = []
    # greedy generation with a KV cache (float32): the same tokens
    prompt = ids(seed=3, rows=1, cols=5)
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.no_grad():
        want, got = ref.generate(prompt, **kw), tp.generate(prompt, **kw)
    if not torch.equal(want, got):
        report.append(f"generate: {got.tolist()} != {want.tolist()}")
    # activation checkpointing: the same gradients
    x = ids(seed=4)
    for m in (ref, tp):
        m.train()
        m.gradient_checkpointing_enable()
        m(input_ids=x, labels=x).loss.backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        if a.grad is not None and rel(full_grad(b), a.grad) > 1e-4:
            report.append(f"checkpointing: grad of {n} off by {rel(full_grad(b), a.grad):.3g}")
    # bf16 parameters and activations: logits against the unsharded bf16 model
    ref16 = build(name).bfloat16()
    tp16 = sharded(ref16, name, style)
    with torch.no_grad():
        lr, lt = ref16(input_ids=x).logits, tp16(input_ids=x).logits
    if lt.dtype != torch.bfloat16 or rel(lt, lr) > 3e-2:
        report.append(f"bf16 logits ({lt.dtype}) off by {rel(lt, lr):.3g}")
    assert_everywhere(not report, report)


@pytest.mark.parametrize("style", ["single", "pair"])
def test_compiles_without_graph_breaks(style):
    ref = build("olmo2")
    tp = sharded(ref, "olmo2", style)
    x = ids(seed=5)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(tp)(input_ids=x)
    report = []
    if explained.graph_break_count:
        report.append(f"{explained.graph_break_count} graph breaks: "
                      f"{[str(b.reason)[:200] for b in explained.break_reasons]}")
    torch._dynamo.reset()
    compiled = torch.compile(tp, backend="aot_eager", fullgraph=True)
    out_c = compiled(input_ids=x, labels=x)
    out_c.loss.backward()
    grads_c = {n: full_grad(p).clone() for n, p in tp.named_parameters()}
    tp.zero_grad()
    out_e = tp(input_ids=x, labels=x)
    out_e.loss.backward()
    if rel(out_c.logits, out_e.logits) > 1e-6:
        report.append(f"compiled logits off by {rel(out_c.logits, out_e.logits):.3g}")
    for n, p in tp.named_parameters():
        if rel(grads_c[n], full_grad(p)) > 1e-6:
            report.append(f"compiled grad of {n} off by {rel(grads_c[n], full_grad(p)):.3g}")
    torch._dynamo.reset()
    assert_everywhere(not report, report)


@pytest.mark.parametrize("name", ["olmo2", "minimax_m2"])
def test_state_dict_round_trip(name):
    ref = build(name)
    tp = sharded(ref, name, "pair")
    other = build(name)  # another checkpoint: every norm weight different from ref's
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5).add_(0.25)
    sd = other.state_dict()
    opts = StateDictOptions(full_state_dict=True)
    # (a copy: set_model_state_dict replaces the dict's tensors by the model's DTensors)
    set_model_state_dict(tp, {k: v.clone() for k, v in sd.items()}, options=opts)
    back = get_model_state_dict(tp, options=opts)
    report = []
    if sorted(back) != sorted(sd):
        report.append(f"keys differ: {sorted(set(back) ^ set(sd))}")
    for k, v in sd.items():
        if k in back and not torch.equal(full_value(back[k]), v):
            report.append(f"{k} not bit for bit")
    x = ids(seed=6)
    with torch.no_grad():
        if rel(tp(input_ids=x).logits, other(input_ids=x).logits) > 2e-5:
            report.append("the loaded sharded model does not compute as the checkpoint's")
    assert_everywhere(not report, report)


# --- the same bits at any TP size, and the gradient others get wrong -----------------------

class _QK(nn.Module):
    """An attention's q/k part of the OLMo 2 shape: projections, then norms over all heads."""

    def __init__(self, norm_cls, q_width, k_width, eps=1e-6):
        super().__init__()
        self.q_proj, self.k_proj = nn.Identity(), nn.Identity()
        self.q_norm, self.k_norm = norm_cls(q_width, eps), norm_cls(k_width, eps)

    def forward(self, q, k):
        return self.q_norm(self.q_proj(q)), self.k_norm(self.k_proj(k))


def _exact_qk(norm_cls, style, tp_mesh, dtype):
    """(q, k outputs, dq, dk, dweights) of the style's q/k norms on tp_mesh, this rank's
    columns of the full seeded q [9, 48], k [9, 24] (stats="exact")."""
    torch.manual_seed(0)
    mod = _QK(norm_cls, 48, 24)
    with torch.no_grad():
        mod.q_norm.weight.copy_(full(20, 48, scale=0.3, shift=1.0))
        mod.k_norm.weight.copy_(full(21, 24, scale=0.3, shift=1.0))
    if style == "pair":
        parallelize_module(mod, tp_mesh, tpnorm.parallel.QKNormPair(stats="exact"))
    else:
        parallelize_module(mod, tp_mesh, {
            n: tpnorm.parallel.HiddenShardedNorm(use_local_output=True, stats="exact")
            for n in ("q_norm", "k_norm")})
    r, n = tp_mesh.get_local_rank(), tp_mesh.size()
    q = full(22, 9, 48, scale=2.0, shift=0.5, dtype=dtype)
    k = full(23, 9, 24, scale=0.5, shift=-0.3, dtype=dtype)
    ql = q.tensor_split(n, dim=-1)[r].contiguous().requires_grad_()
    kl = k.tensor_split(n, dim=-1)[r].contiguous().requires_grad_()
    # the pair's forward takes one hidden state for both projections: its core on q and k
    yq, yk = mod(ql, kl) if style != "pair" else _pair_forward(mod, ql, kl)
    dyq = full(24, 9, 48, dtype=yq.dtype).tensor_split(n, dim=-1)[r]
    dyk = full(25, 9, 24, dtype=yk.dtype).tensor_split(n, dim=-1)[r]
    torch.autograd.backward([yq, yk], [dyq, dyk])
    return [yq, yk, ql.grad, kl.grad, full_grad(mod.q_norm.weight),
            full_grad(mod.k_norm.weight)]


def _pair_forward(mod, q, k):
    return tpnorm.parallel._pair(mod.q_norm, mod.k_norm, q, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["single", "pair"])
@pytest.mark.parametrize("norm", ["Olmo2RMSNorm", "OlmoeRMSNorm"])
def test_exact_stats_give_the_same_bits_at_any_tp_size(norm, style, dtype):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    cls = {"Olmo2RMSNorm": Olmo2RMSNorm, "OlmoeRMSNorm": OlmoeRMSNorm}[norm]
    got = _exact_qk(cls, style, mesh(), dtype)
    # TP 1 in the same job: a (P, 1) mesh's second dimension is each rank alone
    one = init_device_mesh("cpu", (P, 1), mesh_dim_names=("dp", "tp"))["tp"]
    want = _exact_qk(cls, style, one, dtype)
    r = WORLD.rank
    names = ["q_norm(q)", "k_norm(k)", "dq", "dk", "dq_weight", "dk_weight"]
    report = []
    for i, (name, g, w) in enumerate(zip(names, got, want)):
        if i < 4:  # activations: this rank's columns of TP 1's
            w = w.tensor_split(P, dim=-1)[r]
        if g.dtype != w.dtype or not torch.equal(g.detach(), w.detach()):
            report.append(f"{name}: not the bits of TP 1 (max diff "
                          f"{float((g.detach().double() - w.detach().double()).abs().max()):.3g})")
    assert_everywhere(not report, report)


@pytest.mark.skipif(P == 1, reason="at one rank the local statistics are the global ones")
def test_statistics_all_reduced_outside_autograd_get_dx_wrong():
    """The negative control: the sum of squares all-reduced with torch.distributed.all_reduce
    (not seen by autograd) gives dx without the other ranks' term through the shared rms."""
    H, eps = 48, 1e-6
    x = full(30, 9, H, scale=1.5, shift=0.4)
    w = full(31, H, scale=0.3, shift=1.0)
    dy = full(32, 9, H)
    xd = x.double().requires_grad_()
    (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).backward(dy.double())
    want = xd.grad.tensor_split(P, dim=-1)[WORLD.rank]
    xl = x.tensor_split(P, dim=-1)[WORLD.rank].contiguous()
    wl, dyl = w.tensor_split(P)[WORLD.rank], dy.tensor_split(P, dim=-1)[WORLD.rank]

    a = xl.clone().requires_grad_()
    ss = a.pow(2).sum(-1, keepdim=True)
    dist.all_reduce(ss)  # in place: autograd still sees the local sum
    (a * torch.rsqrt(ss / H + eps) * wl).backward(dyl)
    b = xl.clone().requires_grad_()
    tpnorm.rms_norm(b, H, wl, eps).backward(dyl)

    wrong, right = rel(a.grad, want), rel(b.grad, want)
    print(f"\nrank {WORLD.rank}: dx off by {wrong:.3g} (all-reduce outside autograd), "
          f"{right:.3g} (tpnorm)")
    assert_everywhere(right < 1e-5 and wrong > 1e-2 and wrong > 1e3 * right,
                      [f"outside autograd {wrong:.3g}, tpnorm {right:.3g}"])


# --- HF's own loading path: from_pretrained with a tp_plan naming tpnorm's style ------------

def test_from_pretrained_with_a_tp_plan_naming_tpnorms_style(tmp_path):
    """A checkpoint saved by save_pretrained loads straight into the sharded model through HF's
    own tensor-parallel loader (DistributedConfig's tp_plan), with the q/k norms as tpnorm's
    QKNormPair registered under a name; it computes and trains as the unsharded model."""
    from transformers.distributed import DistributedConfig

    path = [str(tmp_path / "olmo2")]
    dist.broadcast_object_list(path, src=0)  # rank 0's directory, one file system
    if WORLD.rank == 0:
        build("olmo2").save_pretrained(path[0])
    dist.barrier()
    tpnorm.parallel.register_hf_style("tpnorm_qk_pair", tpnorm.parallel.QKNormPair())
    attn = "model.layers.*.self_attn"
    plan = {attn: "tpnorm_qk_pair", f"{attn}.q_proj": "colwise", f"{attn}.k_proj": "colwise",
            f"{attn}.v_proj": "colwise", f"{attn}.o_proj": "rowwise"}
    ref = T.Olmo2ForCausalLM.from_pretrained(path[0])
    tp = T.Olmo2ForCausalLM.from_pretrained(
        path[0], distributed_config=DistributedConfig(tp_plan=plan, tp_size=P))
    x = ids(seed=7)
    out_r, out_t = ref(input_ids=x, labels=x), tp(input_ids=x, labels=x)
    out_r.loss.backward()
    out_t.loss.backward()
    report = []
    q_norm = tp.model.layers[0].self_attn.q_norm
    if P > 1 and (type(tp.model.layers[0].self_attn).__name__ != "QKNormPairedOlmo2Attention"
                  or not isinstance(q_norm.weight, DTensor)):  # HF applies no plan at TP 1
        report.append(f"not sharded by tpnorm: {type(tp.model.layers[0].self_attn).__name__}")
    if rel(out_t.logits, out_r.logits) > 2e-5:
        report.append(f"logits off by {rel(out_t.logits, out_r.logits):.3g}")
    for (n, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        if rel(full_grad(b), a.grad) > 1e-4:
            report.append(f"grad of {n} off by {rel(full_grad(b), a.grad):.3g}")
    assert_everywhere(not report, report)
    dist.barrier()  # rank 0's directory stays until every rank has loaded it
