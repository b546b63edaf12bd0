# test_dtensor.py — tpnorm's row norms on DTensors (tpnorm.dtensor): a 1-D TP mesh and a 2-D
# DP x TP mesh over the gloo world group, against a float64 reference on the gathered tensors
# (float32 and bf16 with fp32 parameters), uneven and empty shards; outputs and gradients keep
# the placements; the only collectives are tpnorm's all-reduces (counted with torch's
# CommDebugMode); a bad call on one rank is the same error on every rank.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import WORLD, assert_everywhere, full, wrong

pytestmark = pytest.mark.skipif(not tpnorm.dtensor.AVAILABLE,
                                reason=f"torch {torch.__version__} has no "
                                       "torch.distributed.tensor (needs >= 2.5)")

if tpnorm.dtensor.AVAILABLE:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,
                                          distribute_tensor)
    from torch.distributed.tensor.debug import CommDebugMode

P = WORLD.size
_meshes = {}


def mesh(*shape):
    """A cached CPU mesh over the world (making one is collective: every rank makes it)."""
    if shape not in _meshes:
        names = ("tp",) if len(shape) == 1 else ("dp", "tp")
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def two_d_shapes():
    """(dp, tp) meshes of the world: every split, so 4 ranks give 4x1, 2x2 and 1x4."""
    return [(P // t, t) for t in range(1, P + 1) if P % t == 0]


# Tolerance relative to the reference's largest element (outputs, input gradients) per dtype.
TOL = {torch.float32: 5e-5, torch.bfloat16: 2e-2}


def leaf(t, m, placements):
    return distribute_tensor(t, m, placements).detach().requires_grad_()


def check(name, got, want, dtype, report):
    tol = TOL[dtype] * max(float(want.detach().abs().max()) if want.numel() else 0.0, 1.0)
    return wrong(name, got, want, tol, TOL[dtype], report)


def run_row_norm(m, placements, shape, dtype, centered, seed):
    """Forward and backward of a DTensor row norm; returns the report of differences."""
    H = shape[-1]
    X, G = full(seed, *shape, dtype=dtype), full(seed + 1, *shape, dtype=dtype)
    W, B = full(seed + 2, H, shift=1.0), full(seed + 3, H)
    wpl = [Shard(0) if isinstance(p, Shard) and p.dim in (-1, len(shape) - 1) else Replicate()
           for p in placements]
    x, w = leaf(X, m, placements), leaf(W, m, wpl)
    b = leaf(B, m, wpl) if centered else None
    g = distribute_tensor(G, m, placements)
    comm = tpnorm.dtensor._comm_for(x, None)
    calls = comm.calls
    placements = x.placements  # as DTensor spells them (Shard(-1) is Shard(ndim - 1))
    with CommDebugMode() as comms:
        if centered:
            y = tpnorm.layer_norm(x, H, w, b, 1e-5)
        else:
            y = tpnorm.rms_norm(x, H, w, 1e-5)
        y.backward(g)
    report = []
    # Placements kept: y and dx as x; dweight as weight, Partial where the batch is sharded.
    want_w = [Partial() if isinstance(p, Shard) and p.dim != len(shape) - 1 else q
              for p, q in zip(placements, w.placements)]
    for what, t, pl in (("y", y, placements), ("dx", x.grad, placements),
                        ("dw", w.grad, want_w)):
        if tuple(t.placements) != tuple(pl):
            report.append(f"{what} placements {t.placements} != {tuple(pl)}")
    # Counted: only tpnorm's own all-reduces (torch's count = tpnorm's counter), one per
    # forward and one per backward once the communicator's first (strict) calls are past,
    # which check their header in one small sum more; no c10d call at one rank of the mesh
    # dimension (a one-process communicator).
    got = {str(k): v for k, v in comms.get_comm_counts().items() if v}
    ours = comm.calls - calls
    tp = m.size(len(placements) - 1)
    want = {"c10d.allreduce_": ours} if tp > 1 else {}
    if got != want or (tp > 1 and not 2 <= ours <= 4):
        report.append(f"collectives {got}, tpnorm's {ours}")
    Xr = X.double().requires_grad_()
    Wr, Br = W.double().requires_grad_(), B.double().requires_grad_()
    if centered:
        yr = TF.layer_norm(Xr, (H,), Wr, Br, 1e-5)
    else:
        yr = Xr * torch.rsqrt(Xr.pow(2).mean(-1, keepdim=True) + 1e-5) * Wr
    yr.backward(G.double())
    check("y", y.full_tensor(), yr, dtype, report)
    check("dx", x.grad.full_tensor(), Xr.grad, dtype, report)
    check("dw", w.grad.full_tensor(), Wr.grad, dtype, report)
    if centered:
        check("db", b.grad.full_tensor(), Br.grad, dtype, report)
    return report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 7), (1, 3)], ids=["even", "uneven", "tiny"])
def test_tp_mesh(shape, centered, dtype):
    # (1, 3) at 4 ranks: the last rank's shard of the hidden dimension is empty.
    report = run_row_norm(mesh(P), [Shard(-1)], shape, dtype, centered, 10)
    assert_everywhere(not report, report)


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_dp_tp_mesh(centered):
    # Batch 3 over dp ranks (uneven; empty at dp = 4), hidden 7 over tp ranks.
    report = []
    for dp, tp in two_d_shapes():
        report += [f"{dp}x{tp}: {line}" for line in
                   run_row_norm(mesh(dp, tp), [Shard(0), Shard(2)], (3, 2, 7), torch.float32,
                                centered, 20)]
    assert_everywhere(not report, report)


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_fused_add_norm(centered):
    m, H, alpha = mesh(P), 7, 0.5
    Xf, Ff = full(30, 4, H), full(31, 4, H)
    W, B = full(32, H, shift=1.0), full(33, H)
    Gh, Gy = full(34, 4, H), full(35, 4, H)
    x, f = leaf(Xf, m, [Shard(-1)]), leaf(Ff, m, [Shard(-1)])
    w = leaf(W, m, [Shard(0)])
    b = leaf(B, m, [Shard(0)]) if centered else None
    if centered:
        h, y = tpnorm.fused_add_layer_norm(x, f, H, w, b, alpha)
    else:
        h, y = tpnorm.fused_add_rms_norm(x, f, H, w, alpha, 1e-5)
    torch.autograd.backward([h, y], [distribute_tensor(Gh, m, [Shard(-1)]),
                                     distribute_tensor(Gy, m, [Shard(-1)])])
    Xr, Fr = Xf.double().requires_grad_(), Ff.double().requires_grad_()
    Wr, Br = W.double().requires_grad_(), B.double().requires_grad_()
    hr = alpha * Xr + Fr
    if centered:
        yr = TF.layer_norm(hr, (H,), Wr, Br, 1e-5)
    else:
        yr = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-5) * Wr
    torch.autograd.backward([hr, yr], [Gh.double(), Gy.double()])
    report = []
    for t in (h, y, x.grad, f.grad, w.grad):
        if tuple(t.placements) != ((Shard(0),) if t is w.grad else (Shard(1),)):
            report.append(f"placements {t.placements}")
    for name, got, want in (("h", h, hr), ("y", y, yr), ("dx", x.grad, Xr.grad),
                            ("df", f.grad, Fr.grad), ("dw", w.grad, Wr.grad)):
        check(name, got.full_tensor(), want, torch.float32, report)
    assert_everywhere(not report, report)


def test_local_parameters():
    # weight / bias as this rank's plain slices: the same values, gradients plain tensors.
    m, H = mesh(P), 7
    X, W = full(40, 3, H), full(41, H, shift=1.0)
    x = leaf(X, m, [Shard(-1)])
    wd = distribute_tensor(W, m, [Shard(0)])
    w = wd.to_local().clone().requires_grad_()
    y = tpnorm.layer_norm(x, H, w, None)
    y.sum().backward()
    Wr = W.double().requires_grad_()
    TF.layer_norm(X.double(), (H,), Wr).sum().backward()
    report = []
    check("y", y.full_tensor(), TF.layer_norm(X.double(), (H,), W.double()), torch.float32,
          report)
    check("dw", w.grad, distribute_tensor(Wr.grad, m, [Shard(0)]).to_local(), torch.float32,
          report)
    assert_everywhere(not type(w.grad).__name__ == "DTensor" and not report, report)


def test_bad_weight_on_one_rank_is_the_same_error_everywhere():
    m, H = mesh(P), 8
    x = leaf(full(50, 2, H), m, [Shard(-1)])
    local = x.to_local().shape[-1]
    w = torch.ones(local + (1 if WORLD.rank == 0 else 0))  # rank 0 passes one column more
    try:
        tpnorm.layer_norm(x, H, w)
        got = None
    except tpnorm.Error as e:
        got = (e.code, str(e))
    everyone = WORLD.allgather(got)
    ok = all(o is not None and o == everyone[0] for o in everyone)
    assert_everywhere(ok, [] if ok else [f"outcomes: {everyone}"])
    # The group is still usable: the next call on every rank succeeds.
    y = tpnorm.layer_norm(x, H)
    assert_everywhere(tuple(y.placements) == (Shard(1),))


def test_unsupported_placements_are_refused_before_any_collective():
    m = mesh(P)
    x = distribute_tensor(full(51, 2, 8), m, [Replicate()])
    with CommDebugMode() as comms:
        y = tpnorm.layer_norm(x, 8)  # the whole row on every rank: no collective
    report = []
    check("replicated", y.full_tensor(), TF.layer_norm(full(51, 2, 8).double(), (8,)),
          torch.float32, report)
    if comms.get_total_counts():
        report.append(f"collectives {comms.get_comm_counts()}")
    with pytest.raises(ValueError, match="placement"):
        tpnorm.layer_norm(DTensor.from_local(x.to_local(), m, [Partial()], run_check=False), 8)
    assert_everywhere(not report, report)
