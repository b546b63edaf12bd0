# test_olmo_core.py — tpnorm inside OLMo-core (ai2-olmo-core), AllenAI's training stack, under
# its own tensor parallelism. OLMo-core's Attention.apply_tp sends q and k from the heads' split
# to the sequence's (an all-to-all each), runs q_norm / k_norm there and sends them back;
# tpnorm.parallel.olmo_core_qk_norm makes the same apply_tp keep q and k head-sharded and
# normalize both with tpnorm's QKNormPair (one all-reduce per layer and pass). Models come from
# OLMo-core's own configs (olmo2_1M, olmo3_1M: random weights, nothing downloaded), 24 query
# heads and 12 key/value heads of 2 (q_norm over 48 columns, k_norm over 24), two layers, an MLP
# of 48, a vocabulary of 96: every head count and sharded width divides by 1-4; OLMo 3 with a
# sliding window. Each is compared with the same model unsharded and with OLMo-core's own TP of
# it, at the job's world size as the TP size:
#
# - float32: loss, logits and every gradient, three AdamW steps, the parameters after them, and
#   tpnorm's collectives per forward and per backward (one per layer);
# - bf16 parameters: logits against both;
# - OLMo-core's activation checkpointing (apply_activation_checkpointing("full")): the same
#   gradients, the recompute's collective counted;
# - OLMo-core's distributed checkpoint (save_model_and_optim_state) saved at TP P and loaded at
#   TP 1 (each rank alone, in the same job) and at P = 4 also at TP 2, with the optimizer's
#   state, bit for bit, computing the saved model's logits; either route's checkpoint into
#   either route;
# - stats="exact": the q/k norms of OLMo-core's RMSNorm class give the same bits at TP P as at
#   TP 1 (outputs, input and weight gradients; float32 and bf16);
# - OLMoE (olmoe_1B_7B's attention config, made small): its attention alone against the
#   unsharded one and OLMo-core's route (OLMo-core's MoE layers need its GPU kernels);
# - the negative control: a per-rank local norm in tpnorm's place fails the float32
#   comparison, measured by the same check.
#
# Runs at 1-4 ranks; needs OLMo-core (launch/python-env.sh installs it into the PyPI-torch venv:
# TPNORM_EXPECT_OLMO_CORE=1 makes its absence a failure instead of a skip).
import copy
import os

import pytest
import torch
import torch.distributed as dist

import tpnorm
from support import WORLD, assert_everywhere, full

_EXPECT = os.environ.get("TPNORM_EXPECT_OLMO_CORE") == "1"
try:
    from olmo_core.nn.attention import SlidingWindowAttentionConfig
    from olmo_core.nn.transformer import TransformerConfig
except ImportError as e:  # Debian's torch has none
    if _EXPECT:
        raise
    pytest.skip(f"needs OLMo-core ({e})", allow_module_level=True)
if not tpnorm.dtensor.AVAILABLE:
    pytest.skip("needs torch.distributed.tensor", allow_module_level=True)

from olmo_core.distributed.checkpoint import (load_model_and_optim_state,
                                              save_model_and_optim_state)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

P = WORLD.size
LAYERS, VOCAB = 2, 96
SIZES = dict(vocab_size=VOCAB, n_layers=LAYERS, n_heads=24, n_kv_heads=12, head_dim=2,
             hidden_size_multiple_of=24)
# OLMo 3: sliding-window attention (a window of 4 tokens in layer 0, full in layer 1; OLMo 3's
# own windows of 4096 would cover these 12 tokens whole)
CONFIGS = {"olmo2": lambda: TransformerConfig.olmo2_1M(**SIZES),
           "olmo3": lambda: TransformerConfig.olmo3_1M(**SIZES, sliding_window=(
               SlidingWindowAttentionConfig(pattern=[4, -1], force_full_attention_on_first_layer=
                                            False, force_full_attention_on_last_layer=True)))}
_meshes = {}


def mesh(tp=P):
    """A TP mesh of ``tp`` ranks: the world, or the "tp" dimension of a (P / tp, tp) mesh."""
    if tp not in _meshes:
        _meshes[tp] = init_device_mesh("cpu", (P,)) if tp == P else init_device_mesh(
            "cpu", (P // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    return _meshes[tp]


def build(name, dtype=torch.float32):
    """The unsharded model, its norms' weights moved off ones (so that a lost weight shows)."""
    torch.manual_seed(0)
    model = CONFIGS[name]().build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def tpnorm_tp(model, tp=P, stats="robust"):
    """A copy of ``model`` with OLMo-core's TP and tpnorm's q/k norms."""
    out = copy.deepcopy(model)
    tpnorm.parallel.olmo_core_qk_norm(out, stats=stats)
    out.apply_tp(mesh(tp))
    return out


def olmo_core_tp(model, tp=P):
    """A copy of ``model`` with OLMo-core's own TP (its all-to-all route)."""
    out = copy.deepcopy(model)
    out.apply_tp(mesh(tp))
    return out


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(got, want):
    got, want = whole(got).detach().double(), whole(want).detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def ids(seed):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def tpnorm_comm(tp=P):
    return tpnorm.dtensor._comm_of(mesh(tp).get_group(0))


def differences(models, x, tol=2e-5, grad_tol=1e-4):
    """Runs forward + backward of each model on ``x``; the lines where the others' loss, logits
    or a gradient differ from the first's (relative to its largest value), and the largest
    errors seen, per model."""
    outs = [m(x, labels=x) for m in models]
    for o in outs:
        o.loss.backward()
    report, worst = [], []
    want = outs[0]
    for i, (m, o) in enumerate(zip(models[1:], outs[1:]), 1):
        e = {"loss": rel(o.loss, want.loss), "logits": rel(o.logits, want.logits), "grad": 0.0}
        for (n, a), (_, b) in zip(models[0].named_parameters(), m.named_parameters()):
            err = rel(b.grad, a.grad)
            e["grad"] = max(e["grad"], err)
            if err > grad_tol:
                report.append(f"model {i}: grad of {n} off by {err:.3g}")
        for k in ("loss", "logits"):
            if e[k] > tol:
                report.append(f"model {i}: {k} off by {e[k]:.3g}")
        worst.append(e)
    return report, worst


@pytest.mark.parametrize("name", list(CONFIGS))
def test_trains_as_the_unsharded_model_and_olmo_cores_tp(name):
    ref = build(name)
    tp, oc = tpnorm_tp(ref), olmo_core_tp(ref)
    models = (ref, tp, oc)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in models]
    comm = tpnorm_comm()
    comm.set_strict_calls(0)  # one collective per call from here on
    report, counts = [], []
    for step in range(3):
        x = ids(10 + step)
        c0 = comm.calls
        out = tp(x, labels=x)
        c1 = comm.calls
        out.loss.backward()
        counts.append((c1 - c0, comm.calls - c1))
        for m in models:
            m.zero_grad()
        lines, worst = differences(models, x)
        report += [f"step {step}: {line}" for line in lines]
        if step == 0:
            print(f"\nrank {WORLD.rank} {name} P={P}: tpnorm vs unsharded {worst[0]}, OLMo-core's "
                  f"TP vs unsharded {worst[1]}, tpnorm vs OLMo-core's TP: logits "
                  f"{rel(tp(x).detach(), oc(x).detach()):.3g}")
        for o in opts:
            o.step()
            o.zero_grad()
    for (n, a), (_, b), (_, c) in zip(*(m.named_parameters() for m in models)):
        for who, p in (("tpnorm", b), ("OLMo-core's TP", c)):
            err = float((whole(p).detach() - a.detach()).abs().max())
            if err > 1e-4:  # a tenth of one step's update (lr 1e-3)
                report.append(f"after 3 steps: {who}'s {n} off by {err:.3g}")
    if P > 1 and any(c != (LAYERS, LAYERS) for c in counts):
        report.append(f"tpnorm collectives (forward, backward) per step {counts}, want "
                      f"{LAYERS} each")
    assert_everywhere(not report, report)


def test_bf16_and_activation_checkpointing():
    report = []
    ref16 = build("olmo2", torch.bfloat16)
    x = ids(4)
    with torch.no_grad():
        want = ref16(x).float()
        got, oc = tpnorm_tp(ref16)(x), olmo_core_tp(ref16)(x)
    if whole(got).dtype != torch.bfloat16 or rel(got, want) > 3e-2 or rel(got, oc) > 3e-2:
        report.append(f"bf16 logits ({whole(got).dtype}) off by {rel(got, want):.3g} from the "
                      f"unsharded model, {rel(got, oc):.3g} from OLMo-core's TP")
    print(f"\nrank {WORLD.rank} P={P}: bf16 logits {rel(got, want):.3g} from the unsharded, "
          f"{rel(got, oc):.3g} from OLMo-core's TP")
    # OLMo-core's activation checkpointing, applied after TP as its train module does
    ref = build("olmo2")
    tp = tpnorm_tp(ref)
    tp.apply_activation_checkpointing("full")
    comm = tpnorm_comm()
    comm.set_strict_calls(0)
    c0 = comm.calls
    lines, worst = differences((ref, tp), ids(5))
    report += [f"checkpointing: {line}" for line in lines]
    calls = comm.calls - c0
    if P > 1 and calls != 3 * LAYERS:  # forward, the recompute's forward, backward
        report.append(f"checkpointing: {calls} tpnorm collectives per step, want {3 * LAYERS}")
    print(f"rank {WORLD.rank} P={P}: checkpointed, against the unsharded {worst[0]}")
    assert_everywhere(not report, report)


def _state(model, optim):
    """Every parameter and optimizer state tensor, whole, by parameter name."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = whole(p).detach().clone()
        for k, v in optim.state[p].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"{n}/{k}"] = whole(v).detach().clone()
    return out


def _trained(model, steps=2):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for step in range(steps):
        x = ids(20 + step)
        model(x, labels=x).loss.backward()
        optim.step()
        optim.zero_grad()
    return optim


def test_distributed_checkpoint_loads_at_another_tp_size(tmp_path):
    base = [str(tmp_path)]
    dist.broadcast_object_list(base, src=0)  # rank 0's directory, one file system
    ref = build("olmo2")
    report = []
    saved, logits = {}, {}
    x = ids(31)
    for route, make in (("tpnorm", tpnorm_tp), ("olmo_core", olmo_core_tp)):
        model = make(ref)
        optim = _trained(model)
        save_model_and_optim_state(f"{base[0]}/{route}", model, optim, save_overwrite=True)
        saved[route] = _state(model, optim)
        with torch.no_grad():
            logits[route] = whole(model(x))
    # at every smaller TP size that divides P, either route's checkpoint into either route
    for tp in [t for t in (1, 2) if t < P and P % t == 0] or [P]:
        for route, into in ((r, i) for r in saved for i in (tpnorm_tp, olmo_core_tp)):
            model = into(build("olmo2"), tp)
            optim = _trained(model, steps=1)  # other values, the optimizer's state made
            load_model_and_optim_state(f"{base[0]}/{route}", model, optim,
                                       process_group=mesh(tp).get_group(0))
            got = _state(model, optim)
            want = saved[route]
            bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
            if bad or sorted(got) != sorted(want):
                report.append(f"{route}'s checkpoint at TP {P} -> {into.__name__} at TP {tp}: "
                              f"{len(bad)} tensors not bit for bit, e.g. {bad[:3]}")
            with torch.no_grad():  # and it computes what the saved model computed
                err = rel(model(x), logits[route])
            if err > 2e-5:
                report.append(f"{route}'s checkpoint at TP {P} -> {into.__name__} at TP {tp}: "
                              f"logits off by {err:.3g}")
    dist.barrier()  # rank 0's directory stays until every rank has loaded it
    assert_everywhere(not report, report)


def _exact_norms(tp, dtype):
    """(q_norm(q), k_norm(k), dq, dk, dq_weight, dk_weight) of layer 0's norms, OLMo-core's
    RMSNorm class on tpnorm's route at TP ``tp`` with stats="exact", on this rank's columns of
    the seeded q [9, 48], k [9, 24]."""
    model = tpnorm_tp(build("olmo2"), tp, stats="exact")
    attn = model.blocks["0"].attention
    r, n = mesh(tp).get_local_rank(), tp
    q = full(22, 9, 48, scale=2.0, shift=0.5, dtype=dtype)
    k = full(23, 9, 24, scale=0.5, shift=-0.3, dtype=dtype)
    ql = q.tensor_split(n, dim=-1)[r].contiguous().requires_grad_()
    kl = k.tensor_split(n, dim=-1)[r].contiguous().requires_grad_()
    yq, yk = tpnorm.parallel._pair(attn.q_norm, attn.k_norm, ql, kl)
    dyq = full(24, 9, 48, dtype=yq.dtype).tensor_split(n, dim=-1)[r]
    dyk = full(25, 9, 24, dtype=yk.dtype).tensor_split(n, dim=-1)[r]
    torch.autograd.backward([yq, yk], [dyq, dyk])
    return [yq, yk, ql.grad, kl.grad, whole(attn.q_norm.weight.grad),
            whole(attn.k_norm.weight.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_stats_give_the_same_bits_at_any_tp_size(dtype):
    got, want = _exact_norms(P, dtype), _exact_norms(1, dtype)
    names = ["q_norm(q)", "k_norm(k)", "dq", "dk", "dq_weight", "dk_weight"]
    report = []
    for i, (name, g, w) in enumerate(zip(names, got, want)):
        if i < 4:  # activations: this rank's columns of TP 1's
            w = w.tensor_split(P, dim=-1)[WORLD.rank]
        if g.dtype != w.dtype or not torch.equal(g.detach(), w.detach()):
            report.append(f"{name}: not the bits of TP 1 (max diff "
                          f"{float((g.detach().double() - w.detach().double()).abs().max()):.3g})")
    assert_everywhere(not report, report)


def test_olmoe_attention():
    """OLMoE 1B-7B's attention (the same class and q/k norms as OLMo 2's), made small."""
    cfg = TransformerConfig.olmoe_1B_7B(vocab_size=VOCAB, d_model=48, n_layers=LAYERS,
                                        n_heads=12).block.sequence_mixer
    torch.manual_seed(0)
    ref = cfg.build(48, layer_idx=0, n_layers=LAYERS, init_device="cpu")
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "norm" in n else 0.15) + ("norm" in n))
    tp, oc = copy.deepcopy(ref), copy.deepcopy(ref)
    tpnorm.parallel.olmo_core_qk_norm(tp)
    for m in (tp, oc):
        m.apply_tp(mesh())
    x = full(40, 2, 12, 48)
    outs = [m(x.clone().requires_grad_()) for m in (ref, tp, oc)]
    dy = full(41, 2, 12, 48)
    for o in outs:
        o.backward(dy)
    report = []
    for who, m, o in (("tpnorm", tp, outs[1]), ("OLMo-core's TP", oc, outs[2])):
        if rel(o, outs[0]) > 2e-5:
            report.append(f"{who}: output off by {rel(o, outs[0]):.3g}")
        for (n, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
            if rel(b.grad, a.grad) > 1e-4:
                report.append(f"{who}: grad of {n} off by {rel(b.grad, a.grad):.3g}")
    if P > 1 and type(tp).__name__ != "QKNormPairedAttention":
        report.append(f"not tpnorm's route: {type(tp).__name__}")
    assert_everywhere(not report, report)


def test_refuses_what_it_does_not_keep():
    report = []
    for field, value, why in (("qk_norm", None, "no q/k norm"),
                              ("use_head_qk_norm", True, "per-head norms"),
                              ("clip_qkv", 8.0, "clip_qkv"),
                              ("use_recompute_qkv_prep", True, "recomputed q/k preparation")):
        cfg = TransformerConfig.olmo2_1M(**SIZES)
        setattr(cfg.block.sequence_mixer, field, value)
        model = cfg.build(init_device="meta")
        try:
            tpnorm.parallel.olmo_core_qk_norm(model)
            report.append(f"{why}: not refused")
        except ValueError:
            pass
        if any("apply_tp" in m.__dict__ for m in model.modules()):
            report.append(f"{why}: a module was changed before the refusal")
    assert_everywhere(not report, report)


@pytest.mark.skipif(P == 1, reason="at one rank the local statistics are the global ones")
def test_a_per_rank_norm_fails_the_comparison(monkeypatch):
    """The negative control: tpnorm's pair replaced by each rank's own q_norm / k_norm over its
    columns alone (the module's class on the local shards) — the check of the first test must
    report it."""

    def local_pair(q_mod, k_mod, q, k):
        out = []
        for mod, t in ((q_mod, q), (k_mod, k)):
            local = copy.copy(mod)
            local.__class__ = type(mod).__mro__[1]  # the model's own class
            local._parameters = {"weight": mod.weight.to_local(), "bias": None}
            local.normalized_shape = (t.shape[-1],)
            out.append(local(t))
        return out

    monkeypatch.setattr(tpnorm.parallel, "_pair", local_pair)
    ref = build("olmo2")
    lines, worst = differences((ref, tpnorm_tp(ref)), ids(10))
    print(f"\nrank {WORLD.rank} P={P}: a per-rank norm against the unsharded model: {worst[0]}")
    assert_everywhere(worst[0]["logits"] > 1e-2 and len(lines) > 0,
                      [f"the per-rank norm passed: {worst[0]}"])
