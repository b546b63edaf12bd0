# test_convnet.py — a small conv net converted with tpnorm.SyncBatchNorm.convert_sync_batchnorm
# and trained data-parallel on uneven per-rank batches (rank 1 empty at 2+ ranks), against the
# same net with torch.nn.BatchNorm2d trained in one process on the concatenated batch: loss of
# every step, parameters after training, running statistics, num_batches_tracked, eval outputs,
# and the state_dict loaded back into the BatchNorm2d net. Both a gloo group and an mpi4py
# communicator carry the norms; the gradient all-reduce of data parallelism is the gloo group's.
import copy

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import tpnorm
from support import WORLD, agree, full

STEPS, TOL = 8, 1e-5  # float32 activations; partial sums differ by rank count (as C++: 1e-5)


def make_net():
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
        torch.nn.Conv2d(6, 4, 3, padding=1), torch.nn.BatchNorm2d(4, momentum=None),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))


def sizes_for(P):
    return [3, 0, 2, 1][:P] if P <= 4 else [1] * P


def rows(t, sizes, r):
    lo = sum(sizes[:r])
    return t[lo:lo + sizes[r]]


@pytest.mark.parametrize("backend", ["gloo", "mpi4py"])
def test_converted_convnet_trains_like_batchnorm2d_on_the_whole_batch(backend):
    r, P = WORLD.rank, WORLD.size
    sizes = sizes_for(P)
    N = sum(sizes)
    ref = make_net()
    net = copy.deepcopy(ref)
    group = tpnorm.from_mpi4py(MPI.COMM_WORLD) if backend == "mpi4py" else dist.group.WORLD
    net = tpnorm.SyncBatchNorm.convert_sync_batchnorm(net, group)
    assert sum(isinstance(m, tpnorm.SyncBatchNorm) for m in net.modules()) == 2
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    report, worst = [], 0.0

    def rel(a, b):
        return float((a.detach().double() - b.detach().double()).abs().max()
                     / b.detach().double().abs().max().clamp_min(1e-30))

    for step in range(STEPS):
        X = full(700 + step, N, 3, 5, 5, shift=0.3)
        labels = torch.arange(N) % 3
        # one process, the whole batch; loss summed over samples / N
        opt_ref.zero_grad()
        loss_ref = torch.nn.functional.cross_entropy(ref(X), labels, reduction="sum") / N
        loss_ref.backward()
        opt_ref.step()
        # data parallel: this rank's rows; gradients summed over ranks (the global loss's)
        opt.zero_grad()
        local = torch.nn.functional.cross_entropy(net(rows(X, sizes, r)), rows(labels, sizes, r),
                                                  reduction="sum") / N
        local.backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        d = abs(float(loss) - float(loss_ref)) / abs(float(loss_ref))
        worst = max(worst, d)
        if d > TOL:
            report.append(f"step {step}: loss {float(loss)} vs {float(loss_ref)}")
    sd, sd_ref = net.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        if k.endswith("num_batches_tracked"):
            if int(sd[k]) != int(v):
                report.append(f"{k}: {int(sd[k])} vs {int(v)}")
            continue
        e = rel(sd[k], v)
        worst = max(worst, e)
        if e > TOL:
            report.append(f"{k}: rel diff {e:.3g}")
    # eval: running statistics, each rank its own rows of a test batch
    net.eval(), ref.eval()
    Xt = full(799, N, 3, 5, 5)
    with torch.no_grad():
        e = rel(net(rows(Xt, sizes, r)), rows(ref(Xt), sizes, r)) if sizes[r] else 0.0
    worst = max(worst, e)
    if e > TOL:
        report.append(f"eval output rel diff {e:.3g}")
    # the trained state_dict loads into the BatchNorm2d net and gives the same eval output
    back = make_net().eval()
    back.load_state_dict(sd)
    with torch.no_grad():
        if rel(back(Xt), ref(Xt)) > TOL:
            report.append("state_dict loaded into BatchNorm2d gives another eval output")
    if r == 0:
        print(f"\n[convnet {backend}] per-rank batches {sizes}: loss {float(loss_ref):.6f} after "
              f"{STEPS} steps; max rel diff vs BatchNorm2d on the whole batch {worst:.3g}")
    ok, lines = agree(not report, report)
    assert ok, lines
