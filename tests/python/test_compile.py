# test_compile.py — tpnorm under torch.compile (torch >= 2.4; with an older torch, e.g. Debian's
# 1.13, every test here is skipped with the reason):
#   * torch.library.opcheck of every custom op (schema, autograd registration, fake
#     implementation, AOT dispatch with dynamic shapes), on inputs that require grad;
#   * a tensor-parallel block (LayerNorm, fused add + RMSNorm, RMSNorm, SyncBatchNorm) compiled
#     with fullgraph=True: no graph break (torch._dynamo.explain), and forward, backward and
#     running statistics equal to the eager block's and, within tolerance, to a float64
#     reference in torch ops on the full, unsharded data.
import pytest
import torch
import torch.nn.functional as TF
from mpi4py import MPI

import tpnorm
from support import WORLD, agree, assert_everywhere, cols, full, wrong

lib = tpnorm.library
pytestmark = pytest.mark.skipif(not lib.AVAILABLE, reason=str(lib.REASON))

H, ROWS, C, N = 12, 5, 3, 7  # hidden size, rows; SyncBatchNorm channels and global batch


@pytest.fixture(autouse=True, scope="module")
def fresh_compiles():
    """Every compile here really compiles: no FX graph or AOT autograd cache entry from an
    earlier run (or another rank) may stand in for this code's graphs."""
    from torch._functorch import config as aot_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), \
            aot_config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture(scope="module")
def handle():
    return lib.comm_handle(tpnorm.from_mpi4py(MPI.COMM_WORLD))


def _shard(t, grad=True):
    t = cols(t, WORLD.rank, WORLD.size)
    return t.requires_grad_() if grad else t


def _forward_samples(h):
    x, f = _shard(full(1, ROWS, H)), _shard(full(2, ROWS, H))
    w, b = _shard(full(3, H, shift=1.0)), _shard(full(4, H))
    g, gb = full(5, C, shift=1.0).requires_grad_(), full(6, C).requires_grad_()
    img = cols(full(7, N, C, 2, 3), WORLD.rank, WORLD.size, dim=0).requires_grad_()
    img_last = img.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    gx = cols(full(8, 2, H, 5), WORLD.rank, WORLD.size, dim=1).requires_grad_()  # InstanceNorm
    C_l = gx.shape[1]
    gw, gbias = full(9, C_l, shift=1.0).requires_grad_(), full(10, C_l).requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)
    groups_x = cols(full(11, 2, 6, 5), WORLD.rank, WORLD.size, dim=1).requires_grad_()
    G_l = groups_x.shape[1]
    g_off = tpnorm.shard_range(6, WORLD.rank, WORLD.size)[0]
    return {
        "layer_norm": (lib.row_norm, (x, w, b, h, 1e-5, "robust", True, H)),
        "layer_norm_no_affine": (lib.row_norm, (x, None, None, h, 1e-5, "naive", True, H)),
        "rms_norm": (lib.row_norm, (x, w, None, h, 1e-6, "robust", False, H)),
        "fused_add_layer_norm": (lib.fused_add_norm, (x, f, w, b, 0.7, h, 1e-5, "robust", True,
                                                      H)),
        "fused_add_rms_norm": (lib.fused_add_norm, (x, f, w, None, 1.0, h, 1e-5, "robust",
                                                    False, H)),
        "group_norm": (lib.group_norm, (groups_x, full(12, G_l).requires_grad_(),
                                        full(13, G_l).requires_grad_(), 3, 6, g_off, h, 1e-5,
                                        "robust", False)),
        "instance_norm_sharded": (lib.group_norm, (gx, gw, gbias, H, H,
                                                   tpnorm.shard_range(H, WORLD.rank,
                                                                      WORLD.size)[0],
                                                   h, 1e-5, "robust", True)),
        "sync_batch_norm_train": (lib.sync_batch_norm, (img, g, gb, rm, rv, h, True, 0.1, 1e-5,
                                                        "robust")),
        "sync_batch_norm_eval": (lib.sync_batch_norm, (img, g, gb, torch.zeros(C),
                                                       torch.ones(C) * 2, h, False, 0.1, 1e-5,
                                                       "robust")),
        "sync_batch_norm_channels_last": (lib.sync_batch_norm, (img_last, g, gb, None, None, h,
                                                                True, 0.1, 1e-5, "robust")),
        # a LayerNorm with weight and bias and an RMSNorm without weight, one collective
        "batched_row_norm": (lib.batched_row_norm, ([x, f], [w, b], [True, False],
                                                    [True, False], [True, False], [H, H], h,
                                                    1e-5, "robust")),
    }


FORWARD = ["layer_norm", "layer_norm_no_affine", "rms_norm", "fused_add_layer_norm",
           "fused_add_rms_norm", "group_norm", "instance_norm_sharded",
           "sync_batch_norm_train", "sync_batch_norm_eval", "sync_batch_norm_channels_last",
           "batched_row_norm"]


def _opcheck(op, args):
    """opcheck's verdict on this rank (its failures are assertion errors with a message)."""
    try:
        torch.library.opcheck(op, args)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        return [f"{type(e).__name__}: {str(e)[:2000]}"]
    return []


@pytest.mark.parametrize("name", FORWARD)
def test_opcheck_forward_op(handle, name):
    op, args = _forward_samples(handle)[name]
    report = _opcheck(op, args)
    assert_everywhere(not report, report)


def _backward_samples(h):
    """Each backward op on the saved statistics its forward op returned."""
    s = _forward_samples(h)
    out = {}
    x, w, b = s["layer_norm"][1][:3]
    with torch.no_grad():
        _, mean, rstd = lib.row_norm(*s["layer_norm"][1])
        dy = torch.randn_like(x)
        out["row_norm_backward"] = (lib.row_norm_backward,
                                    (dy, x.detach(), w.detach(), b.detach(), mean, rstd, h, 1e-5,
                                     "robust", True, H))
        _, _, mean0, rstd0 = lib.fused_add_norm(*s["fused_add_rms_norm"][1])
        hh = torch.randn_like(x)
        out["fused_add_norm_backward"] = (lib.fused_add_norm_backward,
                                          (torch.randn_like(x), dy, hh, w.detach(), None, mean0,
                                           rstd0, 1.0, h, 1e-5, "robust", False, H))
        gargs = s["group_norm"][1]
        _, gm, gr = lib.group_norm(*gargs)
        gx = gargs[0].detach()
        out["group_norm_backward"] = (lib.group_norm_backward,
                                      (torch.randn_like(gx), gx, gargs[1].detach(),
                                       gargs[2].detach(), gm, gr) + tuple(gargs[3:]))
        bargs = s["sync_batch_norm_train"][1]
        _, sm, si, _, _ = lib.sync_batch_norm(*bargs)
        img = bargs[0].detach()
        out["sync_batch_norm_backward"] = (lib.sync_batch_norm_backward,
                                           (torch.randn_like(img), img, bargs[1].detach(),
                                            bargs[2].detach(), sm, si) + tuple(bargs[5:]))
        kargs = s["batched_row_norm"][1]
        kx = [t.detach() for t in kargs[0]]
        ko = lib.batched_row_norm(*kargs)
        out["batched_row_norm_backward"] = (lib.batched_row_norm_backward,
                                            ([torch.randn_like(t) for t in kx], kx,
                                             [t.detach() for t in kargs[1]], list(ko[1::3]),
                                             list(ko[2::3])) + tuple(kargs[2:]))
    return out


def test_opcheck_backward_ops(handle):
    torch.manual_seed(0)  # the same random dy on every rank
    report = []
    for name, (op, args) in _backward_samples(handle).items():
        report += [f"{name}: {line}" for line in _opcheck(op, args)]
    assert_everywhere(not report, report)


class Block(torch.nn.Module):
    """Hidden-sharded rows through LayerNorm, a fused residual add + RMSNorm and an RMSNorm,
    and a data-parallel image batch through SyncBatchNorm."""

    def __init__(self, comm):
        super().__init__()
        r, P = comm.rank, comm.size
        self.ln = tpnorm.ShardedLayerNorm(H, process_group=comm)
        self.fused = tpnorm.FusedAddRMSNorm(H, 1e-5, alpha=0.8, process_group=comm)
        self.rms = tpnorm.ShardedRMSNorm(H, 1e-6, process_group=comm)
        self.bn = tpnorm.SyncBatchNorm(C, process_group=comm)
        with torch.no_grad():
            self.ln.weight.copy_(cols(full(20, H, shift=1.0), r, P))
            self.ln.bias.copy_(cols(full(21, H), r, P))
            self.fused.weight.copy_(cols(full(22, H, shift=1.0), r, P))
            self.rms.weight.copy_(cols(full(23, H, shift=1.0), r, P))
            self.bn.weight.copy_(full(24, C, shift=1.0))
            self.bn.bias.copy_(full(25, C))

    def forward(self, x, img):
        y = self.ln(x)
        h, z = self.fused(x, y.relu())
        return self.rms(z * 2.0) + h, self.bn(img)


def _rms(t, w, eps):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(X, IMG, GY, GB):
    """Outputs and input gradients of Block on the full data, float64, in torch ops."""
    X, IMG = X.double().requires_grad_(), IMG.double().requires_grad_()
    d = lambda s, shift=0.0: full(s, H, shift=shift).double()  # noqa: E731
    y = TF.layer_norm(X, (H,), d(20, 1.0), d(21))
    h = 0.8 * X + y.relu()
    z = _rms(h, d(22, 1.0), 1e-5)
    out = _rms(z * 2.0, d(23, 1.0), 1e-6) + h
    b = TF.batch_norm(IMG, torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64),
                      full(24, C, shift=1.0).double(), full(25, C).double(), training=True)
    ((out * GY.double()).sum() + (b * GB.double()).sum()).backward()
    return out.detach(), b.detach(), X.grad, IMG.grad


def _run(block, fn, X, IMG, GY, GB):
    r, P = WORLD.rank, WORLD.size
    x = cols(X, r, P).requires_grad_()
    img = cols(IMG, r, P, dim=0).requires_grad_()
    out, b = fn(x, img)
    ((out * cols(GY, r, P)).sum() + (b * cols(GB, r, P, dim=0)).sum()).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    stats = {n: t.clone() for n, t in block.named_buffers()}
    return out.detach(), b.detach(), x.grad, img.grad, grads, stats


@pytest.mark.parametrize("rows", [ROWS, 1])
def test_compiled_block_matches_eager_and_reference(rows):
    torch._dynamo.reset()
    comm = tpnorm.from_mpi4py(MPI.COMM_WORLD)
    r, P = WORLD.rank, WORLD.size
    X, GY = full(30, 2, rows, H), full(31, 2, rows, H)
    IMG, GB = full(32, N, C, 2, 3, scale=2.0, shift=0.5), full(33, N, C, 2, 3)

    eager = Block(comm)
    want = _run(eager, eager, X, IMG, GY, GB)
    compiled_block = Block(comm)
    got = _run(compiled_block, torch.compile(compiled_block, fullgraph=True), X, IMG, GY, GB)

    report = []
    names = ["y", "bn", "dx", "dimg"]
    n = 0
    for name, g, w in zip(names, got[:4], want[:4]):
        n += wrong(f"compiled vs eager {name}", g, w, 1e-6, 1e-6, report)
    for kind, i in (("grad", 4), ("buffer", 5)):
        for k in want[i]:
            n += wrong(f"compiled vs eager {kind} {k}", got[i][k], want[i][k], 1e-6, 1e-6, report)
    ref = _reference(X, IMG, GY, GB)
    shard = [cols(ref[0], r, P), cols(ref[1], r, P, dim=0), cols(ref[2], r, P),
             cols(ref[3], r, P, dim=0)]
    for name, g, w in zip(names, got[:4], shard):
        n += wrong(f"compiled vs float64 reference {name}", g, w, 1e-4, 1e-4, report)
    assert_everywhere(n == 0, report)


def test_block_compiles_without_graph_breaks():
    torch._dynamo.reset()
    comm = tpnorm.from_mpi4py(MPI.COMM_WORLD)
    r, P = WORLD.rank, WORLD.size
    block = Block(comm)
    x = cols(full(40, ROWS, H), r, P).requires_grad_()
    img = cols(full(41, N, C, 2, 3), r, P, dim=0).requires_grad_()
    explained = torch._dynamo.explain(block)(x, img)
    report = [f"{explained.graph_break_count} graph breaks: "
              f"{[str(b.reason)[:300] for b in explained.break_reasons]}"]
    ok = explained.graph_break_count == 0 and explained.graph_count == 1
    assert_everywhere(ok, [] if ok else report)


def test_functional_forms_compile_without_graph_breaks():
    torch._dynamo.reset()
    comm = tpnorm.from_mpi4py(MPI.COMM_WORLD)
    r, P = WORLD.rank, WORLD.size
    w = cols(full(50, H, shift=1.0), r, P).requires_grad_()

    def f(x, res):
        h, y = tpnorm.fused_add_layer_norm(x, res, H, w, None, process_group=comm)
        return tpnorm.rms_norm(y, H, w, process_group=comm) + h

    x, res = cols(full(51, ROWS, H), r, P), cols(full(52, ROWS, H), r, P)
    explained = torch._dynamo.explain(f)(x, res)
    ok = explained.graph_break_count == 0
    ok_all, lines = agree(ok, [] if ok else [str(b.reason)[:300] for b in
                                             explained.break_reasons])
    assert ok_all, lines
    compiled = torch.compile(f, fullgraph=True)(x, res)
    report = []
    n = wrong("compiled functional vs eager", compiled, f(x, res), 1e-6, 1e-6, report)
    assert_everywhere(n == 0, report)
