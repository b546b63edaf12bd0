"""One data-parallel training step of torchvision's ResNet-18, with three kinds of BatchNorm.

  BatchNorm2d   torch.nn.BatchNorm2d: each rank normalises with its own batch's statistics
                (no synchronisation: the floor a synchronised BatchNorm is measured against);
  tpnorm        tpnorm.SyncBatchNorm.convert_sync_batchnorm over the gloo group: statistics over
                every rank's batch, one all-reduce per BatchNorm forward and one per backward;
  tpnorm-mpi    the same over an mpi4py communicator (tpnorm.from_mpi4py): the norms' sums go
                through MPI (shared memory on one node) instead of gloo;
  naive         what a CPU user writes without tpnorm (torch.nn.SyncBatchNorm runs on CUDA
                only), as detectron2's NaiveSyncBatchNorm does: per-channel mean and mean of
                squares all-reduced through torch.distributed.nn's autograd-aware all_reduce,
                the normalisation in torch ops.

Every model is wrapped in DistributedDataParallel over the same gloo group, which also carries
the norms' all-reduces. Per step: forward, cross-entropy, backward, SGD with momentum. The kinds
are timed in turn, round by round (--rounds), --steps steps each after a warm-up; the table gives
the median milliseconds per step over every round's steps, the ratio to BatchNorm2d, and the
milliseconds per step spent inside the norms' torch.distributed.all_reduce calls (timed around
each call, waiting for the other rank included: DDP's gradient buckets are not among them; MPI's
sums are not timed).

    mpiexec -n 2 python bench/python/vision_step.py [--batch 32] [--size 32] [--steps 10]

`./launch/tpnorm perf --vision` runs it at 2 ranks under the PyPI torch of the test suite.
"""
import argparse
import copy
import os
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torchvision
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tpnorm

# torch.distributed.nn.functional.all_reduce is deprecated in favour of functional collectives
# that have no autograd on a gloo group; it is still what such a SyncBatchNorm calls.
warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_reduce is deprecated")
# broadcast_buffers=False keeps each rank's running statistics its own, as every kind here needs.
warnings.filterwarnings("ignore", category=FutureWarning, message=".*broadcast_buffers. is deprecated")

_norm_comm_s = [0.0]
_all_reduce = dist.all_reduce


def _timed_all_reduce(*args, **kwargs):
    """torch.distributed.all_reduce, its time added up: the norms' collectives (tpnorm's
    process-group communicator and torch.distributed.nn both call it; DDP's reducer does not)."""
    t0 = time.perf_counter()
    try:
        return _all_reduce(*args, **kwargs)
    finally:
        _norm_comm_s[0] += time.perf_counter() - t0


dist.all_reduce = _timed_all_reduce


class NaiveSyncBatchNorm(nn.BatchNorm2d):
    """Batch statistics over every rank's batch from two all-reduced per-channel means (weighted
    by the local batch size, so uneven batches count right), in torch ops; eval as BatchNorm2d."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        C, n = x.shape[1], x.numel() // x.shape[1]
        moments = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)),
                             x.new_full((1,), float(n))])
        moments = dnn.all_reduce(moments)
        count = moments[-1]
        mean = moments[:C] / count
        var = moments[C:2 * C] / count - mean * mean
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * count / (count - 1), self.momentum)
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        return x * scale.view(1, C, 1, 1) + shift.view(1, C, 1, 1)


def rel_diff(a, b):
    return float((a - b).abs().max() / b.abs().max())


def naive(model):
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            m = NaiveSyncBatchNorm(child.num_features, child.eps, child.momentum)
            m.load_state_dict(child.state_dict())
            setattr(model, name, m)
        else:
            naive(child)
    return model


KINDS = {
    "BatchNorm2d": lambda m: m,
    "tpnorm": lambda m: tpnorm.SyncBatchNorm.convert_sync_batchnorm(m, dist.group.WORLD),
    "tpnorm-mpi": lambda m: tpnorm.SyncBatchNorm.convert_sync_batchnorm(
        m, tpnorm.from_mpi4py(MPI.COMM_WORLD)),
    "naive": naive,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="images per rank (default 32)")
    ap.add_argument("--size", type=int, default=32, help="image side (default 32: CIFAR)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per kind and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the kinds (default 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--formats", default="nchw,channels_last")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    port = world.bcast(port if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    rank, P = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    base = torchvision.models.resnet18(weights=None, num_classes=10)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    labels = torch.randint(0, 10, (args.batch,), generator=g)
    rows, checks = [], []
    for fname in args.formats.split(","):
        fmt = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}[fname]
        xf = x.contiguous(memory_format=fmt)
        runs = {}
        for kind, convert in KINDS.items():
            model = DDP(convert(copy.deepcopy(base)).to(memory_format=fmt),
                        process_group=dist.group.WORLD, broadcast_buffers=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
            runs[kind] = (model, opt, [], [])

        # The same step's logits in each synchronised kind, from the same weights (a check that
        # the naive layer computes what tpnorm's does, not a test).
        with torch.no_grad():
            logits = {k: runs[k][0](xf) for k in ("tpnorm", "naive")}
        check = world.allreduce(rel_diff(logits["naive"], logits["tpnorm"]), op=MPI.MAX)

        def step(model, opt):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xf), labels).backward()
            opt.step()

        for kind, (model, opt, _, _) in runs.items():
            for _ in range(args.warmup):
                step(model, opt)
        for _ in range(args.rounds):
            for kind, (model, opt, times, comm) in runs.items():
                for _ in range(args.steps):
                    dist.barrier()
                    _norm_comm_s[0] = 0.0
                    t0 = time.perf_counter()
                    step(model, opt)
                    times.append(time.perf_counter() - t0)
                    comm.append(_norm_comm_s[0])
        floor = None
        for kind, (_, _, times, comm) in runs.items():
            # the slowest rank's time of each step, then the median over the steps; the norms'
            # all-reduce time is rank 0's
            per_rank = world.allgather(times)
            step_ms = [1e3 * max(r[i] for r in per_rank) for i in range(len(times))]
            comm_ms = [1e3 * c for c in world.allgather(comm)[0]]
            med = statistics.median(step_ms)
            floor = floor or med
            rows.append((fname, kind, med, min(step_ms), max(step_ms), med / floor,
                         statistics.median(comm_ms)))
        checks.append((fname, check))
    if rank == 0:
        print(f"ResNet-18, {P} ranks over gloo, {args.batch} images of {args.size}x{args.size} "
              f"per rank, {torch.get_num_threads()} thread(s) per rank, torch {torch.__version__}; "
              f"{args.rounds} rounds x {args.steps} steps per kind")
        print(f"{'format':<14} {'BatchNorm':<12} {'ms/step':>9} {'min':>8} {'max':>8} "
              f"{'/ floor':>8} {'norm all-reduce ms':>19}")
        for f, k, med, lo, hi, ratio, comm in rows:
            c = f"{comm:19.2f}" if k != "tpnorm-mpi" else f"{'(MPI, not timed)':>19}"
            print(f"{f:<14} {k:<12} {med:9.1f} {lo:8.1f} {hi:8.1f} {ratio:8.3f} {c}")
        for f, c in checks:
            print(f"{f}: naive vs tpnorm logits of the first training forward: {c:.2e} "
                  f"relative (largest over the ranks)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
