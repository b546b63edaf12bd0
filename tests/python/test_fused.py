# test_fused.py — fused residual add + sharded norm (Pre-LN / Post-LN alpha = 1, DeepNorm
# alpha), forward (h and y) and backward (dx, df, dgamma, dbeta, with h's own gradient
# arriving as dh_extra) against torch in float64 on the gathered tensors.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, cols, full, wrong


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("alpha", ["1", "deepnorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(4, 9), (2, 3)])
def test_fused_add_norm_matches_torch(comm, kind, alpha, dtype, rows, hidden):
    r, P, eps = WORLD.rank, WORLD.size, 1e-5
    a = 1.0 if alpha == "1" else tpnorm.deepnorm_alpha("encoder_only", 6)
    X, Fx = full(11, rows, hidden, dtype=dtype), full(12, rows, hidden, shift=0.3, dtype=dtype)
    W, B = full(13, hidden, shift=1.0, dtype=dtype), full(14, hidden, dtype=dtype)
    dY, dH = full(15, rows, hidden, dtype=dtype), full(16, rows, hidden, dtype=dtype)
    x, f = cols(X, r, P).requires_grad_(), cols(Fx, r, P).requires_grad_()
    w, b = cols(W, r, P).requires_grad_(), cols(B, r, P).requires_grad_()
    if kind == "layer_norm":
        h, y = tpnorm.fused_add_layer_norm(x, f, hidden, w, b, alpha=a, eps=eps,
                                           process_group=comm)
    else:
        h, y = tpnorm.fused_add_rms_norm(x, f, hidden, w, alpha=a, eps=eps, process_group=comm)
    torch.autograd.backward([y, h], [cols(dY, r, P), cols(dH, r, P)])

    # Reference: h rounded once to the storage dtype, as the op stores it, then the norm.
    Xd, Fd, Wd, Bd = (t.double().requires_grad_() for t in (X, Fx, W, B))
    Hd = a * Xd + Fd
    Hr = Hd + (Hd.detach().to(dtype).double() - Hd.detach())  # rounded value, exact gradient
    if kind == "layer_norm":
        Yd = TF.layer_norm(Hr, (hidden,), Wd, Bd, eps)
    else:
        Yd = Hr * torch.rsqrt(Hr.pow(2).mean(-1, keepdim=True) + eps) * Wd
    torch.autograd.backward([Yd, Hd], [dY.double(), dH.double()])

    rt = RTOL[dtype]
    report = []
    n = wrong("h", h, cols(Hd.detach(), r, P), rt, rt, report)
    n += wrong("y", y, cols(Yd.detach(), r, P), rt, rt, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P), 4 * rt, 10 * rt, report)
    n += wrong("df", f.grad, cols(Fd.grad, r, P), 4 * rt, 10 * rt, report)
    n += wrong("dgamma", w.grad, cols(Wd.grad, r, P), rt * rows, rt, report)
    if kind == "layer_norm":
        n += wrong("dbeta", b.grad, cols(Bd.grad, r, P), rt * rows, rt, report)
    assert_everywhere(n == 0, report)


def test_fused_module_pre_ln_residual(comm):
    """FusedAddLayerNorm as Pre-LN uses it: h continues the residual stream, y feeds the next
    sublayer; a gradient through h only (y unused) still reaches x and f."""
    r, P, H = WORLD.rank, WORLD.size, 6
    m = tpnorm.FusedAddLayerNorm(H, process_group=comm)
    x = cols(full(21, 2, H), r, P).requires_grad_()
    f = cols(full(22, 2, H), r, P).requires_grad_()
    h, y = m(x, f)
    (h.sum() + 0 * y.sum()).backward()
    report = []
    n = wrong("dx", x.grad, torch.ones_like(x), 1e-6, 0, report)
    n += wrong("df", f.grad, torch.ones_like(f), 1e-6, 0, report)
    n += wrong("dgamma", m.weight.grad, torch.zeros_like(m.weight), 1e-6, 0, report)
    assert_everywhere(n == 0, report)
