# test_batched.py — tpnorm.batched_row_norm: K hidden-sharded row norms of different widths
# (an attention's q_norm and k_norm, a LayerNorm next to them) in ONE collective per pass,
# forward and backward against torch in float64 on the gathered tensors; widths that do not
# divide by the world size and one narrower than it (a rank with no column); DTensor inputs.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, cols, full, wrong

EPS = 1e-6


def _items(dtype):
    """(X, W, B, centered) per item: LayerNorm 9 wide with weight and bias, RMSNorm 7 wide with
    a weight, RMSNorm 2 wide without one."""
    return [(full(1, 5, 9, dtype=dtype), full(2, 9, shift=1.0, dtype=dtype), full(3, 9,
                                                                                  dtype=dtype),
             True),
            (full(4, 5, 7, scale=2.0, shift=0.5, dtype=dtype), full(5, 7, shift=1.0,
                                                                    dtype=dtype), None, False),
            (full(6, 5, 2, dtype=dtype), None, None, False)]


def _reference(items, dys):
    out = []
    for (X, W, B, centered), dY in zip(items, dys):
        Xd = X.double().requires_grad_()
        Wd = None if W is None else W.double().requires_grad_()
        Bd = None if B is None else B.double().requires_grad_()
        if centered:
            Yd = TF.layer_norm(Xd, (X.shape[-1],), Wd, Bd, EPS)
        else:
            Yd = Xd * torch.rsqrt(Xd.pow(2).mean(-1, keepdim=True) + EPS)
            Yd = Yd if Wd is None else Yd * Wd
        Yd.backward(dY.double())
        out.append((Yd.detach(), Xd.grad, None if Wd is None else Wd.grad,
                    None if Bd is None else Bd.grad))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_row_norm_matches_torch_in_one_collective(comm, dtype):
    r, P = WORLD.rank, WORLD.size
    items = _items(dtype)
    dys = [full(10 + i, *X.shape, dtype=dtype) for i, (X, _, _, _) in enumerate(items)]
    xs = [cols(X, r, P).requires_grad_() for X, _, _, _ in items]
    ws = [None if W is None else cols(W, r, P).requires_grad_() for _, W, _, _ in items]
    bs = [None if B is None else cols(B, r, P).requires_grad_() for _, _, B, _ in items]
    comm.set_strict_calls(0)  # no first-call check: the calls counted are the op's own
    c0 = comm.calls
    ys = tpnorm.batched_row_norm(xs, ws, bs, EPS, centered=[c for *_, c in items],
                                 hidden_sizes=[X.shape[-1] for X, *_ in items],
                                 process_group=comm)
    c1 = comm.calls
    torch.autograd.backward(list(ys), [cols(d, r, P) for d in dys])
    report = []
    if (c1 - c0, comm.calls - c1) != (1, 1):
        report.append(f"collectives (forward, backward) {(c1 - c0, comm.calls - c1)}, "
                      "want 1, 1")
    rt, n = RTOL[dtype], 0
    for i, (y, x, w, b, (Y, dX, dW, dB)) in enumerate(zip(ys, xs, ws, bs,
                                                         _reference(items, dys))):
        rows = x.shape[0]
        n += wrong(f"y{i}", y, cols(Y, r, P), rt, rt, report)
        n += wrong(f"dx{i}", x.grad, cols(dX, r, P), 4 * rt, 10 * rt, report)
        if w is not None:
            n += wrong(f"dweight{i}", w.grad, cols(dW, r, P), rt * rows, rt, report)
        if b is not None:
            n += wrong(f"dbias{i}", b.grad, cols(dB, r, P), rt * rows, rt, report)
    assert_everywhere(n == 0 and not report, report)


def test_batched_row_norm_of_dtensors():
    if not tpnorm.dtensor.AVAILABLE:
        pytest.skip("needs torch.distributed.tensor")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD.size,))
    items = _items(torch.float32)[:2]
    dys = [full(20 + i, *X.shape) for i, (X, *_) in enumerate(items)]
    xs = [distribute_tensor(X, mesh, [Shard(1)]).requires_grad_() for X, *_ in items]
    ws = [distribute_tensor(W, mesh, [Shard(0)]).requires_grad_() for _, W, *_ in items]
    bs = [distribute_tensor(items[0][2], mesh, [Shard(0)]).requires_grad_(), None]
    ys = tpnorm.batched_row_norm(xs, ws, bs, EPS, centered=[True, False])
    torch.autograd.backward(list(ys), [distribute_tensor(d, mesh, [Shard(1)]) for d in dys])
    report, n = [], 0
    for i, (y, x, w, (Y, dX, dW, _)) in enumerate(zip(ys, xs, ws, _reference(items, dys))):
        if not isinstance(y, DTensor) or y.placements != x.placements:
            report.append(f"y{i}: not a DTensor laid out as its input")
            continue
        n += wrong(f"y{i}", y.full_tensor(), Y, 1e-5, 1e-5, report)
        n += wrong(f"dx{i}", x.grad.full_tensor(), dX, 4e-5, 1e-4, report)
        n += wrong(f"dweight{i}", w.grad.full_tensor(), dW, 5e-5, 1e-5, report)
    n += wrong("dbias0", bs[0].grad.full_tensor(), _reference(items, dys)[0][3], 5e-5, 1e-5,
               report)
    assert_everywhere(n == 0 and not report, report)
