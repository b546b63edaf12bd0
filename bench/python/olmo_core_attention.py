"""The cost of a full-width QK-norm inside OLMo-core's own tensor parallelism, two routes.

One OLMo 2 attention of OLMo-core (olmo2_370M's: d_model 1024, 16 heads of 64, q_norm and
k_norm RMSNorms over all heads), applied as its block applies it (sequence-sharded input and
output, Shard(1)), float32, one thread per rank, per training step (forward + backward):

  olmo_core  OLMo-core's Attention.apply_tp: q and k redistributed from the heads' split to
             the tokens' (an all-to-all each; on CPU torch falls back to all-gather + chunk),
             the norms there, back to the heads' split; backward the same; the norms'
             weight gradients left Partial (an all-reduce each when read: counted here);
  tpnorm     tpnorm.parallel.olmo_core_qk_norm, then the same apply_tp: q and k stay
             head-sharded, both norms in one tpnorm all-reduce per pass;
  no_qknorm  the same attention without q_norm / k_norm (OLMo-core's plan: plain
             column-parallel w_q / w_k), the baseline: "norm part" = route - no_qknorm.

The routes run interleaved, step after step (in turns, each first as often), in one job. Per route: collectives by kind and
the bytes this rank puts in (a dispatch mode over torch's collective ops, tp_block.CommBytes,
which sees tpnorm's all-reduces on the gloo group too, and tpnorm's own counters), the median
milliseconds per step of the slowest rank, the median over steps of its difference to the
baseline's step (the norm part; and the difference of the fastest steps, the least disturbed
on a shared machine), and the largest relative error of the output, the input's
gradient and every parameter's gradient against the same attention in float64, unsharded.

    mpiexec -n P python bench/python/olmo_core_attention.py [--tokens 256 --batch 2]
"""
import argparse
import copy
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
from olmo_core.nn.transformer import TransformerConfig
from tp_block import CommBytes, full, init_gloo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import tpnorm

ROUTES = ("no_qknorm", "olmo_core", "tpnorm")


def rel_err(a, b):
    a, b = full(a).detach().double(), full(b).detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def attention(qk_norm):
    """olmo2_370M's attention (its own config), seeded weights, the norms' off ones."""
    cfg = TransformerConfig.olmo2_370M(vocab_size=128, n_layers=1).block.sequence_mixer
    if not qk_norm:
        cfg = dataclasses.replace(cfg, qk_norm=None)
    torch.manual_seed(0)
    m = cfg.build(1024, layer_idx=0, n_layers=1, init_device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * r if "norm" in n else r / 32)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--warmup", type=int, default=10,
                    help="steps before counting: past the first 16 calls of tpnorm's "
                         "communicator, whose header goes first (docs/cpp-api.md)")
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    world = init_gloo()
    P, r = world.size, world.rank
    mesh = init_device_mesh("cpu", (P,))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(a.batch, a.tokens, 1024, generator=g, dtype=torch.float64)
    dy = torch.randn(a.batch, a.tokens, 1024, generator=g, dtype=torch.float64)
    xl, dyl = (t.tensor_split(P, dim=1)[r].float().contiguous() for t in (x, dy))

    models, refs = {}, {}
    for route in ROUTES:
        base = attention(route != "no_qknorm")
        ref = copy.deepcopy(base).double()
        xr = x.clone().requires_grad_()
        ref(xr).backward(dy)
        refs[route] = (ref, xr.grad)
        if route == "tpnorm":
            tpnorm.parallel.olmo_core_qk_norm(base)
        base.apply_tp(mesh, input_layout=Shard(1), output_layout=Shard(1), use_local_output=False)
        models[route] = base

    def step(route):
        m = models[route]
        m.zero_grad(set_to_none=True)
        xi = xl.clone().requires_grad_()
        y = m(xi)
        y.to_local().backward(dyl)
        # what an optimizer step reads: each gradient in its parameter's layout (OLMo-core's
        # norms' weight gradients are Partial until then, an all-reduce each)
        grads = [p.grad if p.grad.placements == p.placements else
                 p.grad.redistribute(placements=p.placements) for p in m.parameters()]
        return y, xi.grad, grads

    comms = [tpnorm.dtensor._comm_of(mesh.get_group(0))]
    for _ in range(a.warmup):
        for route in ROUTES:
            step(route)
    rows = {}
    for route in ROUTES:
        calls0, bytes0 = sum(c.calls for c in comms), sum(c.bytes_sent for c in comms)
        with CommBytes() as cb:
            y, dx, grads = step(route)
        tc = sum(c.calls for c in comms) - calls0
        tb = sum(c.bytes_sent for c in comms) - bytes0
        ref, dx_ref = refs[route]
        errs = [rel_err(y, ref(x)), rel_err(dx, dx_ref.tensor_split(P, dim=1)[r])]
        errs += [rel_err(gr, q.grad) for gr, q in zip(grads, ref.parameters())]  # gathered
        rows[route] = dict(calls=dict(cb.calls), bytes=dict(cb.bytes), tc=tc, tb=tb,
                           err=max(errs), ms=[])
    for i in range(a.steps):
        for route in ROUTES[i % 3:] + ROUTES[:i % 3]:  # each route first as often
            dist.barrier()
            t0 = time.perf_counter()
            step(route)
            rows[route]["ms"].append((time.perf_counter() - t0) * 1e3)
    every = world.gather({k: v["ms"] for k, v in rows.items()}, root=0)
    if r == 0:
        # per step the slowest rank; the medians over steps of each route and of its
        # difference to the baseline in the same step (the norm part; pairs cancel drift)
        slow = {k: [max(e[k][i] for e in every) for i in range(a.steps)] for k in ROUTES}
        med = {k: statistics.median(v) for k, v in slow.items()}
        part = {k: statistics.median(t - b for t, b in zip(slow[k], slow["no_qknorm"]))
                for k in ROUTES}
        # and from the fastest step of each (the least disturbed on a shared machine)
        least = {k: min(v) - min(slow["no_qknorm"]) for k, v in slow.items()}
        print(f"P = {P}: OLMo-core olmo2_370M attention, {a.batch} x {a.tokens} tokens, float32, "
              f"sequence-sharded in and out; per training step, {a.steps} steps interleaved")
        for route in ROUTES:
            v = rows[route]
            kinds = ", ".join(f"{k} x{n} {v['bytes'][k] / 1024:.0f} KiB"
                              for k, n in sorted(v["calls"].items())) or "none"
            extra = "" if route == "no_qknorm" else \
                f"; norm part {part[route]:.2f} ms (from the minima {least[route]:.2f})"
            print(f"  {route:9s}: {med[route]:.2f} ms (min {min(slow[route]):.2f}){extra}; "
                  f"torch collectives {kinds}; "
                  f"tpnorm {v['tc']} x {v['tb'] / 1024:.1f} KiB; max rel err vs float64 "
                  f"{v['err']:.1e}")
        print(f"  tpnorm's norm part / OLMo-core's: {part['tpnorm'] / part['olmo_core']:.3f} "
              f"(from the minima {least['tpnorm'] / least['olmo_core']:.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
