"""tpnorm.ShardedLayerNorm in a torch.distributed job (gloo on CPU; an NCCL group on GPUs).

Each rank holds a slice of the hidden dimension; the norm's statistics are summed over the
group in one collective per call, never gathering the rows. Launch with either

    torchrun --nproc_per_node 3 examples/python/sharded_layer_norm.py
    mpirun -n 3 /usr/bin/python3 examples/python/sharded_layer_norm.py

(from an installed package, or with PYTHONPATH=build/python after ./launch/tpnorm build).
It checks the result against torch.nn.LayerNorm on the gathered rows and exits non-zero if
they differ by more than float32 rounding.
"""
import os
import socket

import torch
import torch.distributed as dist

import tpnorm


def init():
    if "RANK" in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return
    from mpi4py import MPI  # mpirun: rank 0 picks a free port, MPI tells the others

    world = MPI.COMM_WORLD
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)


def local_rank():
    """This process's rank on its node (torchrun, mpirun or srun say it), which picks its GPU:
    the global rank would name GPUs the node does not have on every node but the first."""
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def main():
    init()
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    hidden, rows = 10, 4  # 10 columns over 3 ranks: 3, 3, 4

    norm = tpnorm.ShardedLayerNorm(hidden).to(device)  # the default group
    lo, hi = norm.shard
    torch.manual_seed(0)  # the same full tensors on every rank, for the check below
    X = torch.randn(rows, hidden)
    x = X[:, lo:hi].contiguous().to(device).requires_grad_()
    y = norm(x)
    y.sum().backward()

    ref = torch.nn.LayerNorm(hidden)
    Y = ref(X)
    err = (y.detach().cpu() - Y.detach()[:, lo:hi]).abs().max().item() if hi > lo else 0.0
    err_t = torch.tensor([err])
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ShardedLayerNorm over {size} ranks ({dist.get_backend()}), hidden {hidden}: "
              f"max |y - nn.LayerNorm(gathered)| = {err_t.item():.3g}; "
              f"rank 0 holds columns [{lo}, {hi}), weight.grad {tuple(norm.weight.grad.shape)}")
    # A barrier last: gloo's worker threads let go of the earlier collectives' tensors while
    # this rank waits in it, not during the interpreter's exit (where freeing a tensor's
    # Python object from a worker thread ends the process in std::terminate).
    dist.barrier()
    dist.destroy_process_group()
    if err_t.item() > 1e-5:
        raise SystemExit("mismatch")


if __name__ == "__main__":
    main()
