# test_dtensor_checkpoint.py — full (unsharded) state dicts and hidden-sharded norms: an
# nn.LayerNorm's state dict loads into the sharded module (each rank takes its columns) and the
# sharded module's full state dict gathers it back bit for bit, with DTensor parameters
# (HiddenShardedNorm, through torch.distributed.checkpoint.state_dict) and with plain ones
# (tpnorm.ShardedLayerNorm, through tpnorm.parallel). The resharding of a
# torch.distributed.checkpoint across TP sizes is dtensor_reshard.py (separate jobs).
import pytest
import torch
from torch import nn

import tpnorm
from support import WORLD, assert_everywhere, full

P, R = WORLD.size, WORLD.rank


def reference(H, seed):
    m = nn.Sequential(nn.Linear(4, H), nn.LayerNorm(H))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(full(seed + i, *p.shape))
    return m


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("H", [8, 7, 3])
def test_plain_sharded_module_round_trip(H):
    ref = reference(H, 80)
    model = nn.Sequential(nn.Linear(4, H), tpnorm.ShardedLayerNorm(H))
    tpnorm.parallel.load_full_state_dict(model, ref.state_dict())
    lo, hi = tpnorm.shard_range(H, R, P)
    report = []
    if not same_bits(model[1].weight.detach(), ref[1].weight.detach()[lo:hi]):
        report.append("weight slice differs")
    got = tpnorm.parallel.full_state_dict(model)
    for k, v in ref.state_dict().items():
        if list(got) != list(ref.state_dict()) or not same_bits(got[k], v):
            report.append(f"{k} differs after the gather")
    assert_everywhere(not report, report)


@pytest.mark.skipif(not tpnorm.dtensor.AVAILABLE,
                    reason=f"torch {torch.__version__} has no torch.distributed.tensor")
@pytest.mark.parametrize("H", [8, 7, 3])
def test_dtensor_module_round_trip(H):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    ref = reference(H, 90)
    mesh = init_device_mesh("cpu", (P,))
    model = parallelize_module(nn.Sequential(nn.Linear(4, H), nn.LayerNorm(H)), mesh,
                               {"1": tpnorm.parallel.HiddenShardedNorm()})
    full_opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, ref.state_dict(), options=full_opts)
    w = model[1].weight
    want_local = torch.tensor_split(ref[1].weight.detach(), [(H + P - 1) // P * i for i in
                                                              range(1, P)])[R]
    report = [] if same_bits(w.to_local().detach(), want_local) else ["local slice differs"]
    got = get_model_state_dict(model, options=full_opts)
    if list(got) != list(ref.state_dict()):
        report.append(f"keys {list(got)}")
    for k, v in ref.state_dict().items():
        if not same_bits(got[k], v):
            report.append(f"{k} differs after the gather")
    assert_everywhere(not report, report)
