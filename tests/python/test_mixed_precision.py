# test_mixed_precision.py — fp16/bf16 activations (x, y, dy, dx) with float32 gamma/beta and
# float32 gradients of them, as training stacks run LayerNorm (apex MixedFusedLayerNorm,
# Megatron, TransformerEngine): sharded LayerNorm / RMSNorm and the fused add + LayerNorm
# against torch in float64 on the gathered tensors. y and dx carry the activation dtype's
# tolerance; dgamma/dbeta, summed in double and rounded once to float32, carry float32's.
# Both the default statistics and Stats::kExact (integer limbs) are run.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, cols, full, wrong


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "fused_add_layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(6, 11), (1, 2)])
@pytest.mark.parametrize("stats", ["robust", "exact"])
def test_half_activations_with_fp32_parameters(comm, kind, dtype, rows, hidden, stats):
    r, P, eps = WORLD.rank, WORLD.size, 1e-5
    X, Fx = full(61, rows, hidden, shift=0.5, dtype=dtype), full(62, rows, hidden, dtype=dtype)
    W, B = full(63, hidden, scale=0.3, shift=1.0), full(64, hidden, scale=0.3)  # float32
    dY = full(65, rows, hidden, dtype=dtype)
    x, f = cols(X, r, P).requires_grad_(), cols(Fx, r, P).requires_grad_()
    w, b = cols(W, r, P).requires_grad_(), cols(B, r, P).requires_grad_()
    if kind == "layer_norm":
        y = tpnorm.layer_norm(x, (hidden,), w, b, eps, process_group=comm, stats=stats)
    elif kind == "rms_norm":
        y = tpnorm.rms_norm(x, (hidden,), w, eps, process_group=comm, stats=stats)
    else:
        _, y = tpnorm.fused_add_layer_norm(x, f, hidden, w, b, eps=eps, process_group=comm,
                                           stats=stats)
    y.backward(cols(dY, r, P))

    Xd, Fd, Wd, Bd = (t.double().requires_grad_() for t in (X, Fx, W, B))
    if kind == "fused_add_layer_norm":
        Hd = Xd + Fd
        Hd = Hd + (Hd.detach().to(dtype).double() - Hd.detach())  # h is stored in x's dtype
    else:
        Hd = Xd
    if kind == "rms_norm":
        Yd = Hd * torch.rsqrt(Hd.pow(2).mean(-1, keepdim=True) + eps) * Wd
    else:
        Yd = TF.layer_norm(Hd, (hidden,), Wd, Bd, eps)
    Yd.backward(dY.double())

    rt, r32 = RTOL[dtype], RTOL[torch.float32]
    report = []
    n = int(y.dtype != dtype or w.grad.dtype != torch.float32 or x.grad.dtype != dtype)
    n += wrong("y", y, cols(Yd.detach(), r, P), rt, rt, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P), 4 * rt, 10 * rt, report)
    n += wrong("dgamma (fp32)", w.grad, cols(Wd.grad, r, P), r32 * rows, r32, report)
    if kind != "rms_norm":
        n += wrong("dbeta (fp32)", b.grad, cols(Bd.grad, r, P), r32 * rows, r32, report)
    assert_everywhere(n == 0, report)


def test_parameters_of_a_third_dtype_name_the_argument(comm):
    r, P = WORLD.rank, WORLD.size
    x = cols(full(66, 3, 8, dtype=torch.bfloat16), r, P)
    w = torch.ones(x.shape[-1], dtype=torch.float16)
    try:
        tpnorm.rms_norm(x, 8, w, process_group=comm)
        got = None
    except tpnorm.Error as e:
        got = str(e)
    everyone = WORLD.allgather(got)
    ok = all(g is not None and g == everyone[0] and "argument 'gamma' has dtype fp16" in g
             for g in everyone)
    assert_everywhere(ok, [] if ok else [str(everyone)])
