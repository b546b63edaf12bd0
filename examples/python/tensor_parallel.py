"""A TP model parallelized with torch's own API and tpnorm's ParallelStyle (torch >= 2.5).

Two blocks of x + down(relu(norm(up(x)))): `up` column-parallel, `norm` an nn.LayerNorm made
hidden-sharded by tpnorm.parallel.HiddenShardedNorm, `down` row-parallel. It trains 3 SGD
steps next to the same model unsharded in float64, prints both losses, and exits non-zero if
they or the parameters differ by more than float32 rounding. Launch with

    torchrun --standalone --nproc-per-node 3 examples/python/tensor_parallel.py
"""
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import tpnorm


class Block(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(d, ff), nn.LayerNorm(ff), nn.Linear(ff, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Model(nn.Module):
    def __init__(self, d=16, ff=50, layers=2):  # ff = 50: uneven shards at 3 and 4 ranks
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial model and data on every rank
    ref = Model().double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = parallelize_module(copy.deepcopy(ref).float(), mesh, {
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.norm": tpnorm.parallel.HiddenShardedNorm(),
        "blocks.*.down": RowwiseParallel(),
    })
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    ok = True
    for step in range(3):
        x, target = torch.randn(8, 16), torch.randn(8, 16)
        for m, o, dtype in ((model, opt, torch.float32), (ref, opt_ref, torch.float64)):
            loss = (m(x.to(dtype)) - target.to(dtype)).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            if dtype == torch.float32:
                got = loss.item()
            else:
                want = loss.item()
        ok = ok and abs(got - want) <= 1e-5 * abs(want)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {got:.7f} (float64 unsharded: {want:.7f})")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        ok = ok and torch.allclose(full.double(), q, rtol=1e-4, atol=1e-5)
    if dist.get_rank() == 0:
        print("parameters match the float64 model" if ok else "MISMATCH")
    # A barrier last: gloo's worker threads let go of the earlier collectives' tensors while
    # this rank waits in it, not during the interpreter's exit (where freeing a tensor's
    # Python object from a worker thread ends the process in std::terminate).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
