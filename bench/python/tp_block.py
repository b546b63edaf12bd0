"""tpnorm.parallel.HiddenShardedNorm next to torch's own DTensor path on the same TP model.

The model: 2 blocks of x + down(relu(norm(up(x)))), up ColwiseParallel, down RowwiseParallel,
norm an nn.LayerNorm over the up projection's (sharded) output. Two ways to run the norm:

  tpnorm   tpnorm.parallel.HiddenShardedNorm: weight/bias Shard(0), tpnorm's all-reduce of
           per-row statistics on the local shards;
  torch    torch's own DTensor layer_norm: weight/bias replicated, and DTensor's sharding
           propagation all-gathers the Shard(-1) activation to run the norm on full rows
           (its output Replicate, sliced back to Shard(-1) for the row-parallel linear).

Per training step (forward + backward of a mean-square loss, after warm-up), on every rank:
collectives by kind and bytes this rank contributes (counted by a dispatch mode over the c10d
and functional-collective ops; tpnorm's own counters beside), milliseconds per step, and the
largest relative error of the loss and of every gradient against the same model in float64.

    mpiexec -n P python bench/python/tp_block.py [--rows 256 --hidden 512 --ff 2048]
"""
import argparse
import copy
import socket
import time
from collections import Counter

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

import tpnorm


class Block(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(d, ff), nn.LayerNorm(ff), nn.Linear(ff, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Model(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def make(d, ff, seed):
    m = Model(d, ff).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.2 * r if n.endswith("norm.weight") else r / p.shape[-1] ** 0.5)
    return m


def _replicate(name, module, mesh):
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(
            DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)))


def parallelize(m, mesh, path):
    if path == "tpnorm":
        norm = tpnorm.parallel.HiddenShardedNorm()
    else:  # torch's own: replicated parameters, DTensor's layer_norm on the Shard(-1) input
        for b in m.blocks:
            distribute_module(b.norm, mesh, _replicate)
        norm = None
    plan = {"blocks.*.up": ColwiseParallel(use_local_output=False),
            "blocks.*.down": RowwiseParallel()}
    if norm is not None:
        plan["blocks.*.norm"] = norm
    return parallelize_module(m, mesh, plan)


class CommBytes(TorchDispatchMode):
    """Counts collectives and the bytes this rank contributes to them (its input tensors)."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func.__name__.split(".")[0]
        # The collectives themselves, not their waits nor the functional-collective wrapper.
        if ns in ("c10d", "_c10d_functional") and name not in ("wait_tensor",
                                                               "_wrap_tensor_autograd"):
            self.calls[name] += 1
            first = args[0]
            ts = first if isinstance(first, (list, tuple)) else [first]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in ts
                                    if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def init_gloo():
    """A gloo default group over this MPI job's ranks (rank 0 picks the TCP port), one thread
    per rank; returns MPI.COMM_WORLD."""
    world = MPI.COMM_WORLD
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = world.bcast(s.getsockname()[1] if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    torch.set_num_threads(1)
    return world


def rel_err(a, b):
    a, b = full(a).detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ff", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    world = init_gloo()
    P = world.size
    mesh = init_device_mesh("cpu", (P,))
    ref = make(a.hidden, a.ff, 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(a.rows, a.hidden, generator=g, dtype=torch.float64)
    t = torch.randn(a.rows, a.hidden, generator=g, dtype=torch.float64)
    loss_ref = (ref(x) - t).pow(2).mean()
    loss_ref.backward()
    out = []
    for path in ("tpnorm", "torch"):
        m = parallelize(copy.deepcopy(ref).float(), mesh, path)
        xf, tf = x.float(), t.float()

        def step():
            m.zero_grad(set_to_none=True)
            loss = (m(xf) - tf).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(a.warmup):  # past tpnorm's first (strict) calls and torch's caches
            step()
        comms = [tpnorm.dtensor._comm_of(mesh.get_group(0))]
        calls0 = sum(c.calls for c in comms)
        bytes0 = sum(c.bytes_sent for c in comms)
        with CommBytes() as cb:
            loss = step()
        tp_calls = sum(c.calls for c in comms) - calls0
        tp_bytes = sum(c.bytes_sent for c in comms) - bytes0
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        dist.barrier()
        ms = (time.perf_counter() - t0) / a.steps * 1e3
        errs = [rel_err(loss, loss_ref)]
        errs += [rel_err(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())]
        out.append((path, dict(cb.calls), dict(cb.bytes), tp_calls, tp_bytes, ms,
                    errs[0], max(errs[1:])))
    ms_all = world.allgather([o[5] for o in out])
    if world.rank == 0:
        print(f"P = {P}: rows {a.rows}, hidden {a.hidden}, ff {a.ff}, float32, 2 blocks, "
              "per training step")
        for i, (path, calls, nbytes, tc, tb, _, el, eg) in enumerate(out):
            ms = max(r[i] for r in ms_all)
            kinds = ", ".join(f"{k} x{v} {nbytes[k] / 1024:.1f} KiB"
                              for k, v in sorted(calls.items())) or "none"
            print(f"  {path:6s}: {kinds}; total {sum(nbytes.values()) / 1024:.1f} KiB; "
                  f"{ms:.2f} ms; tpnorm counters {tc} calls {tb / 1024:.1f} KiB; "
                  f"rel err loss {el:.1e} grads {eg:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
