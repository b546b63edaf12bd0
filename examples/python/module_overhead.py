"""Every tpnorm module's forward + backward next to its torch counterpart, on one process (the
single-process communicator, one thread): the per-call cost of tpnorm's Python and autograd
layers at a small shape, and the kernels' at a large one. A measurement, not a test.

    PYTHONPATH=build/python OMP_NUM_THREADS=1 /usr/bin/python3 examples/python/module_overhead.py
    OMP_NUM_THREADS=1 .venv-torch/bin/python examples/python/module_overhead.py   # PyPI torch

For each op and shape: the median over 5 blocks of calls of one step (zero the gradients,
forward, backward), microseconds per step, for tpnorm's module and the torch counterpart
(torch.nn's layer; nn.RMSNorm where torch has it, else its formula in torch ops; transformers'
Mamba2RMSNormGated where transformers is installed, else its formula), interleaved block by
block, and the ratio tpnorm / torch. The header says which eager autograd path tpnorm takes.
--shapes small|large|all (default all); --filter REGEX on the op names.
"""
import argparse
import re
import statistics
import time

import torch
from torch import nn

import tpnorm

EPS = 1e-6


class _RMSNorm(nn.Module):
    """torch.nn.RMSNorm's formula where torch has no nn.RMSNorm (torch < 2.4)."""

    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def rms_norm(h):
    return nn.RMSNorm(h, eps=EPS) if hasattr(nn, "RMSNorm") else _RMSNorm(h)


class _Gated(nn.Module):
    """transformers' Mamba2RMSNormGated (its formula where transformers is not installed)."""

    def __init__(self, h, group_size):
        super().__init__()
        self.weight, self.group_size = nn.Parameter(torch.ones(h)), group_size

    def forward(self, x, gate):
        u = x.float() * nn.functional.silu(gate.float())
        g = u.view(*u.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * g.view(u.shape).to(x.dtype)


def gated(h, group_size):
    try:
        from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated
        return Mamba2RMSNormGated(h, group_size=group_size, eps=EPS)
    except ImportError:
        return _Gated(h, group_size)


class _AddThen(nn.Module):
    """x + f, then the norm: what a fused add + norm replaces."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, f):
        h = x + f
        return h, self.norm(h)


class _Batched(nn.Module):
    """q_norm and k_norm of an attention: two norms, or tpnorm's one batched call."""

    def __init__(self, hq, hk, tp):
        super().__init__()
        self.wq, self.wk, self.tp = nn.Parameter(torch.ones(hq)), nn.Parameter(torch.ones(hk)), tp
        self.q, self.k = rms_norm(hq), rms_norm(hk)

    def forward(self, q, k):
        if self.tp:
            return tpnorm.batched_row_norm([q, k], [self.wq, self.wk], eps=EPS,
                                           hidden_sizes=[q.shape[-1], k.shape[-1]])
        return self.q(q), self.k(k)


def cases(size):
    """(op name, tpnorm module, torch module, input shapes)."""
    rows, h = (4, 64) if size == "small" else (4096, 1024)
    img = (2, 8, 4, 4) if size == "small" else (32, 64, 16, 16)
    C = img[1]
    return [
        ("LayerNorm", tpnorm.ShardedLayerNorm(h), nn.LayerNorm(h), [(rows, h)]),
        ("RMSNorm", tpnorm.ShardedRMSNorm(h, eps=EPS), rms_norm(h), [(rows, h)]),
        ("FusedAddLayerNorm", tpnorm.FusedAddLayerNorm(h), _AddThen(nn.LayerNorm(h)),
         [(rows, h), (rows, h)]),
        ("FusedAddRMSNorm", tpnorm.FusedAddRMSNorm(h, eps=EPS), _AddThen(rms_norm(h)),
         [(rows, h), (rows, h)]),
        ("batched q/k RMSNorm", _Batched(h, h // 4, True), _Batched(h, h // 4, False),
         [(rows, h), (rows, h // 4)]),
        ("GroupNorm", tpnorm.ShardedGroupNorm(4, C), nn.GroupNorm(4, C), [img]),
        ("InstanceNorm", tpnorm.ShardedInstanceNorm(C, affine=True),
         nn.InstanceNorm2d(C, affine=True), [img]),
        ("SyncBatchNorm", tpnorm.SyncBatchNorm(C), nn.BatchNorm2d(C), [img]),
        ("RMSNormGated", tpnorm.ShardedRMSNormGated(h, EPS, h // 8), gated(h, h // 8),
         [(rows, h), (rows, h)]),
    ]


def step_of(module, shapes):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, generator=g).requires_grad_() for s in shapes]
    params = [p for p in module.parameters()] + xs

    def step():
        for p in params:
            p.grad = None
        out = module(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])

    return step


def blocks(step, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", choices=["small", "large", "all"], default="all")
    ap.add_argument("--filter", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = "C++ (tpnorm._autograd)" if tpnorm.functional.CPP_AUTOGRAD else \
        f"Python ({tpnorm.functional.CPP_AUTOGRAD_REASON})"
    print(f"# torch {torch.__version__}, tpnorm eager autograd: {path}; one thread; "
          "us per step (zero grads, forward, backward), median of 5 interleaved blocks")
    print(f"{'op':22s} {'shape':18s} {'tpnorm':>10s} {'torch':>10s} {'ratio':>7s}")
    for size in (["small", "large"] if a.shapes == "all" else [a.shapes]):
        for name, tp, ref, shapes in cases(size):
            if not re.search(a.filter, name):
                continue
            st, sr = step_of(tp, shapes), step_of(ref, shapes)
            iters = 2000 if size == "small" else 5
            for f in (st, sr):  # warm up
                blocks(f, max(1, iters // 10))
            t, r = [], []
            for _ in range(5):
                t.append(blocks(st, iters))
                r.append(blocks(sr, iters))
            mt, mr = statistics.median(t), statistics.median(r)
            shape = "x".join(str(d) for d in shapes[0])
            print(f"{name:22s} {shape:18s} {mt:10.1f} {mr:10.1f} {mt / mr:7.2f}")


if __name__ == "__main__":
    main()
