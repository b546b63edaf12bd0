# test_dtensor_parallel.py — tpnorm.parallel.HiddenShardedNorm with torch's own tensor
# parallelism: a 2-block TP model (column-parallel linear, hidden-sharded norm, row-parallel
# linear) parallelized with parallelize_module trains for a few SGD steps with the losses and
# parameters of the same model unsharded in float64; no all-gather appears (counted with
# CommDebugMode); state_dict keys stay those of the nn model.
import copy

import pytest
import torch
from torch import nn

import tpnorm
from support import WORLD, assert_everywhere, full, wrong

pytestmark = pytest.mark.skipif(not tpnorm.dtensor.AVAILABLE,
                                reason=f"torch {torch.__version__} has no "
                                       "torch.distributed.tensor (needs >= 2.5)")

if tpnorm.dtensor.AVAILABLE:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

P = WORLD.size
_mesh = []


def tp_mesh():
    if not _mesh:
        _mesh.append(init_device_mesh("cpu", (P,), mesh_dim_names=("tp",)))
    return _mesh[0]


class Block(nn.Module):
    def __init__(self, d, ff, norm):
        super().__init__()
        self.up = nn.Linear(d, ff)
        self.norm = nn.LayerNorm(ff) if norm == "layer" else nn.RMSNorm(ff, eps=1e-5)
        self.down = nn.Linear(ff, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Model(nn.Module):
    def __init__(self, d, ff, norm, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, ff, norm) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def seeded(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * r if name.endswith("norm.weight") else 0.5 * r)
    return model


def parallelize(model):
    return parallelize_module(model, tp_mesh(), {
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.norm": tpnorm.parallel.HiddenShardedNorm(),
        "blocks.*.down": RowwiseParallel()})


def full_of(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("ff", [8, 7], ids=["even", "uneven"])
def test_trains_as_the_unsharded_model(norm, ff):
    # No empty shard here (test_dtensor.py has those for the norm): with ff < P torch's own
    # ColwiseParallel linear gets a Replicate weight gradient for its Shard(0) weight, and SGD's
    # in-place update refuses it (torch 2.15), before any norm is involved.
    d, steps, lr = 6, 3, 0.1
    ref = seeded(Model(d, ff, norm).double(), 60)
    tp = parallelize(copy.deepcopy(ref).float())
    keys_ok = list(tp.state_dict().keys()) == list(ref.state_dict().keys())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=lr, foreach=False)
    report = [] if keys_ok else [f"state_dict keys {list(tp.state_dict())}"]
    gathers = 0
    for step in range(steps):
        x, t = full(61 + step, 5, d), full(71 + step, 5, d)
        loss_ref = (ref(x.double()) - t.double()).pow(2).mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()
        with CommDebugMode() as comms:
            loss = (tp(x) - t).pow(2).mean()
            opt_tp.zero_grad()
            loss.backward()
        gathers += sum(v for k, v in comms.get_comm_counts().items() if "gather" in str(k))
        opt_tp.step()
        wrong(f"loss {step}", full_of(loss).detach(), loss_ref.detach(), 1e-5, 1e-4, report)
    for (name, p), (_, q) in zip(tp.named_parameters(), ref.named_parameters()):
        wrong(name, full_of(p.detach()), q.detach(), 1e-5, 1e-4, report)
    norm_mod = tp.blocks[0].norm
    if not isinstance(norm_mod.weight, DTensor) or \
            not isinstance(norm_mod, type(ref.blocks[0].norm)):
        report.append(f"norm not sharded: {type(norm_mod)} {type(norm_mod.weight)}")
    if gathers:
        report.append(f"{gathers} all-gathers in {steps} steps")
    assert_everywhere(not report, report)


def test_refuses_other_modules():
    with pytest.raises(NotImplementedError, match="BatchNorm1d computes neither"):
        parallelize_module(nn.Sequential(nn.BatchNorm1d(4)), tp_mesh(),
                           {"0": tpnorm.parallel.HiddenShardedNorm()})
