# test_row_norms.py — ShardedLayerNorm / ShardedRMSNorm (and the functional forms), forward
# and backward, against torch.nn.functional.layer_norm and an RMSNorm written in float64 on
# the gathered rows. Hidden sizes that split unevenly, and 2 columns so that at 3 or 4 ranks
# some rank holds none.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, cols, full, wrong

SHAPES = [(5, 7), (1, 2), (3, 64)]  # (rows, hidden)


def rms_norm_ref(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference(kind, X, W, B, dY, eps):
    """Forward + backward in float64 on the gathered tensors."""
    X, W, B = (t.double().requires_grad_() for t in (X, W, B))
    if kind == "layer_norm":
        Y = TF.layer_norm(X, (X.shape[-1],), W, B, eps)
    else:
        Y = rms_norm_ref(X, W, eps)
    Y.backward(dY.double())
    return Y.detach(), X.grad, W.grad, (B.grad if kind == "layer_norm" else None)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_row_norm_matches_torch(comm, kind, dtype, rows, hidden):
    r, P, eps = WORLD.rank, WORLD.size, 1e-5
    X = full(1, rows, hidden, scale=2.0, shift=0.5, dtype=dtype)
    W = full(2, hidden, scale=0.3, shift=1.0, dtype=dtype)
    B = full(3, hidden, scale=0.3, dtype=dtype)
    dY = full(4, rows, hidden, dtype=dtype)
    x = cols(X, r, P).requires_grad_()
    w = cols(W, r, P).requires_grad_()
    b = cols(B, r, P).requires_grad_()
    if kind == "layer_norm":
        y = tpnorm.layer_norm(x, (hidden,), w, b, eps, process_group=comm)
    else:
        y = tpnorm.rms_norm(x, (hidden,), w, eps, process_group=comm)
    y.backward(cols(dY, r, P))
    Y, dX, dW, dB = reference(kind, X, W, B, dY, eps)

    rt = RTOL[dtype]
    rstd_max = float(torch.rsqrt((X.double() - (X.double().mean(-1, keepdim=True)
                                  if kind == "layer_norm" else 0)).pow(2).mean(-1) + eps).max())
    report = []
    n = wrong("y", y, cols(Y, r, P), rt, rt, report)
    n += wrong("dx", x.grad, cols(dX, r, P), rt * max(1.0, rstd_max), 10 * rt, report)
    n += wrong("dgamma", w.grad, cols(dW, r, P), rt * rows, rt, report)
    if kind == "layer_norm":
        n += wrong("dbeta", b.grad, cols(dB, r, P), rt * rows, rt, report)
    else:
        assert b.grad is None
    assert y.dtype == dtype and x.grad.dtype == dtype
    # Strict calls: header, then payload; but a call this small on a communicator with
    # size-checked sums (MPI) carries its header in its one sum.
    strict_first = comm.sequence <= 16 and comm.size_checked_sum_bytes == 0
    assert comm.calls == (4 if strict_first else 2)
    assert_everywhere(n == 0, report)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_modules_are_nn_modules(comm, kind):
    """The modules hold this rank's slice as nn.Parameter and train like nn.LayerNorm."""
    r, P, H = WORLD.rank, WORLD.size, 10
    cls = tpnorm.ShardedLayerNorm if kind == "layer_norm" else tpnorm.ShardedRMSNorm
    m = cls(H, process_group=comm)
    lo, hi = tpnorm.shard_range(H, r, P)
    assert m.shard == (lo, hi) and m.weight.shape == (hi - lo,)
    names = {n for n, _ in m.named_parameters()}
    assert names == ({"weight", "bias"} if kind == "layer_norm" else {"weight"})
    X = full(5, 3, 4, H)
    ref = torch.nn.LayerNorm(H, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(full(6, H).double())
        m.weight.copy_(cols(full(6, H), r, P))
    y = m(cols(X, r, P))  # leading dims [3, 4] flatten into rows
    if kind == "layer_norm":
        want = ref(X.double())
    else:
        want = rms_norm_ref(X.double(), ref.weight, 1e-5)
    report = []
    n = wrong("y", y, cols(want.detach(), r, P), 1e-5, 1e-5, report)
    assert_everywhere(n == 0, report)
