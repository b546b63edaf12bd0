# test_group_norm.py — ShardedGroupNorm / ShardedInstanceNorm (channels sharded, groups that
# span ranks, ranks with no channel) against torch.nn.functional.group_norm / instance_norm in
# float64 on the gathered channels.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, cols, full, wrong


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C,G,spatial", [(6, 3, (4, 5)), (6, 2, (3,)), (2, 1, (5, 2)), (8, 8, ())])
def test_group_norm_matches_torch(comm, dtype, C, G, spatial):
    r, P, N, eps = WORLD.rank, WORLD.size, 3, 1e-5
    X = full(31, N, C, *spatial, scale=1.5, shift=0.7, dtype=dtype)
    W, B = full(32, C, shift=1.0, dtype=dtype), full(33, C, dtype=dtype)
    dY = full(34, N, C, *spatial, dtype=dtype)
    m = tpnorm.ShardedGroupNorm(G, C, eps, dtype=dtype, process_group=comm)
    with torch.no_grad():
        m.weight.copy_(cols(W, r, P, dim=0))
        m.bias.copy_(cols(B, r, P, dim=0))
    x = cols(X, r, P, dim=1).requires_grad_()
    y = m(x)
    y.backward(cols(dY, r, P, dim=1))
    Xd, Wd, Bd = (t.double().requires_grad_() for t in (X, W, B))
    Yd = TF.group_norm(Xd, G, Wd, Bd, eps)
    Yd.backward(dY.double())
    rt, count = RTOL[dtype], N * (C // G) * max(1, torch.Size(spatial).numel())
    report = []
    n = wrong("y", y, cols(Yd.detach(), r, P, 1), rt, rt, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P, 1), 4 * rt, 10 * rt, report)
    n += wrong("dgamma", m.weight.grad, cols(Wd.grad, r, P, 0), rt * count, rt, report)
    n += wrong("dbeta", m.bias.grad, cols(Bd.grad, r, P, 0), rt * count, rt, report)
    assert_everywhere(n == 0, report)


@pytest.mark.parametrize("affine", [False, True])
def test_instance_norm_matches_torch(comm, affine):
    r, P, N, C, eps = WORLD.rank, WORLD.size, 2, 5, 1e-5
    X, dY = full(41, N, C, 3, 4, shift=2.0), full(42, N, C, 3, 4)
    m = tpnorm.ShardedInstanceNorm(C, eps, affine=affine, process_group=comm)
    x = cols(X, r, P, dim=1).requires_grad_()
    m(x).backward(cols(dY, r, P, dim=1))
    Xd = X.double().requires_grad_()
    Yd = TF.instance_norm(Xd, eps=eps)  # affine params start at 1 / 0
    Yd.backward(dY.double())
    report = []
    n = wrong("y", m(x), cols(Yd.detach(), r, P, 1), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P, 1), 4e-5, 1e-4, report)
    if affine:
        n += wrong("dgamma", m.weight.grad, cols((dY.double() * Yd.detach()).sum((0, 2, 3)),
                                                   r, P, 0), 1e-5 * 24, 1e-5, report)
    assert_everywhere(n == 0, report)
