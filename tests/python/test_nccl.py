# test_nccl.py — CUDA tensors over tpnorm's NCCL communicator bootstrapped through a
# torch.distributed NCCL group (ncclUniqueId broadcast over the group), on
# torch.cuda.current_stream(). Needs one GPU per rank and a build with NCCL; skipped otherwise
# with the reason (e.g. on a machine without a GPU).
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as TF

import tpnorm
from support import WORLD, assert_everywhere, cols, full, wrong


def why_not():
    if not tpnorm._C.has_nccl():
        return "this build of tpnorm has no NCCL backend"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.cuda.device_count() < WORLD.size:
        return f"{torch.cuda.device_count()} GPUs for {WORLD.size} ranks (NCCL: one GPU per rank)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL process groups"
    return None


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_sharded_layer_norm_on_gpu_over_an_nccl_group():
    r, P, H = WORLD.rank, WORLD.size, 1000
    torch.cuda.set_device(r)
    group = dist.new_group(list(range(P)), backend="nccl")
    norm = tpnorm.ShardedLayerNorm(H, device="cuda", process_group=group)
    assert norm.comm.device == f"cuda:{r}"
    X, dY = full(1, 8, H), full(2, 8, H)
    x = cols(X, r, P).cuda().requires_grad_()
    y = norm(x)
    y.backward(cols(dY, r, P).cuda())
    torch.cuda.synchronize()
    Xd = X.double().requires_grad_()
    Yd = TF.layer_norm(Xd, (H,))
    Yd.backward(dY.double())
    report = []
    n = wrong("y", y.cpu(), cols(Yd.detach(), r, P), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad.cpu(), cols(Xd.grad, r, P), 1e-4, 1e-4, report)
    assert_everywhere(n == 0, report)
