# test_compile.py — torch.compile(fullgraph=True) over tpnorm's torch.library ops (registered
# only where torch >= 2.4; with an older torch the test is skipped with the reason).
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import WORLD, assert_everywhere, cols, full, wrong


@pytest.mark.skipif(not tpnorm.library.AVAILABLE, reason=str(tpnorm.library.REASON))
def test_compiled_layer_norm_matches_eager(comm):
    r, P, H = WORLD.rank, WORLD.size, 12
    handle = tpnorm.library.comm_handle(comm)
    w = cols(full(3, H, shift=1.0), r, P).requires_grad_()
    b = cols(full(4, H), r, P).requires_grad_()

    def f(x):
        return tpnorm.library.layer_norm_op(x, w, b, handle).relu()

    compiled = torch.compile(f, fullgraph=True)
    X = full(5, 4, H)
    x = cols(X, r, P).requires_grad_()
    y = compiled(x)
    y.sum().backward()
    Xd = X.double().requires_grad_()
    Yd = TF.layer_norm(Xd, (H,), full(3, H, shift=1.0).double(), full(4, H).double()).relu()
    Yd.sum().backward()
    report = []
    n = wrong("y", y, cols(Yd.detach(), r, P), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P), 1e-4, 1e-4, report)
    assert_everywhere(n == 0, report)
