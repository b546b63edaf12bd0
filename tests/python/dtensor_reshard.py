# dtensor_reshard.py — a torch.distributed.checkpoint of a TP model (ColwiseParallel,
# tpnorm.parallel.HiddenShardedNorm, RowwiseParallel; 2 blocks, hidden 7: uneven shards)
# saved at one TP size loads at another with the same parameters bit for bit. Run as separate
# MPI jobs (dtensor_reshard.sh: save at 2 ranks, load at 3 and at 1):
#   mpiexec -n 2 python dtensor_reshard.py save DIR
#   mpiexec -n 3 python dtensor_reshard.py load DIR
# `save` also writes DIR/full.pt, the gathered parameters, which `load` compares with.
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import tpnorm

D, FF = 6, 7


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(D, FF), nn.LayerNorm(FF), nn.Linear(FF, D)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


def model(seed, mesh):
    m = nn.ModuleDict({"blocks": nn.ModuleList(Block() for _ in range(2))})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return parallelize_module(m, mesh, {"blocks.*.up": ColwiseParallel(),
                                        "blocks.*.norm": tpnorm.parallel.HiddenShardedNorm(),
                                        "blocks.*.down": RowwiseParallel()})


def main(mode, path):
    world = MPI.COMM_WORLD
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = world.bcast(s.getsockname()[1] if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    P = world.size
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("tp",))
    full_opts = StateDictOptions(full_state_dict=True)
    if mode == "save":
        m = model(100, mesh)
        dcp.save(get_model_state_dict(m), checkpoint_id=path)
        full = get_model_state_dict(m, options=full_opts)
        if world.rank == 0:
            torch.save(full, os.path.join(path, "full.pt"))
        ok, note = True, f"saved {len(full)} tensors at TP = {P}"
    else:
        m = model(200, mesh)  # other values: everything must come from the checkpoint
        sd = get_model_state_dict(m)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(m, sd)
        got = get_model_state_dict(m, options=full_opts)
        want = torch.load(os.path.join(path, "full.pt"))
        bad = [k for k in want if k not in got or not torch.equal(
            got[k].view(torch.int32), want[k].view(torch.int32))]
        # Each rank holds DTensor's split of the norm at this TP size (7 over 3: 3, 3, 1).
        w = m["blocks"][0].norm.weight
        local = w.to_local().shape[0]
        chunks = torch.arange(FF).chunk(P)
        want_local = len(chunks[world.rank]) if world.rank < len(chunks) else 0
        ok = not bad and local == want_local and list(got) == list(want)
        note = (f"loaded at TP = {P}: {len(want) - len(bad)} of {len(want)} tensors identical "
                f"bit for bit, norm columns here {local}" + (f"; differ: {bad}" if bad else ""))
    oks = world.allgather(ok)
    if world.rank == 0:
        print(f"dtensor_reshard: {note}")
    # A barrier last: gloo's worker threads let go of the earlier collectives' tensors while
    # this rank waits in it, not during the interpreter's exit (where freeing a tensor's
    # Python object from a worker thread ends the process in std::terminate).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
