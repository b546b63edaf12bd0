# test_public_entries.py — every public module and function of tpnorm, called with its
# documented defaults (process_group=None: the default torch.distributed group) on an UNEVEN
# split of the sharded dimension (not shard_range's), against the unsharded torch op on the full
# tensor in float64. Each entry runs twice: with the sizes only (each rank its own local size,
# no offset) and with explicit offsets, in rank order and reversed. Either the result is the
# unsharded op's, or the call raises the same tpnorm.Error on every rank (a function documented
# to split as shard_range does when given sizes only); never a wrong result, never a wait.
#
# ENTRIES lists every public callable of the package; a name added to tpnorm without a case
# here fails test_every_public_entry_has_a_case, so a new op cannot skip this test.
import copy

import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import WORLD, agree, assert_everywhere, full, wrong

RT = 2e-5  # float32 against float64, forward outputs


def split(total, P):
    """An uneven split of `total` over P ranks, not shard_range's: the last rank holds most."""
    if P == 1:
        return [total]
    base = [max(1, total // (2 * P))] * (P - 1)
    return base + [total - sum(base)]


def layout(total, P, order):
    """(sizes, offsets) by rank: the uneven split, its slices laid in rank order or reversed."""
    sizes = split(total, P)
    ranks = list(range(P)) if order == "rank order" else list(reversed(range(P)))
    offsets, at = [0] * P, 0
    for r in ranks:
        offsets[r] = at
        at += sizes[r]
    return sizes, offsets


def mine(t, sizes, offsets, dim=-1):
    r = WORLD.rank
    return t.narrow(dim, offsets[r], sizes[r]).contiguous()


def rms_ref(x, w, eps):
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


def gated_ref(x, z, w, group_size, eps):
    u = x.double() * TF.silu(z.double())
    g = u.view(*u.shape[:-1], -1, group_size)
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(u.shape) * w.double()


H, C, ROWS = 13, 12, 4

# Each case: (sizes, offsets, with_offsets) -> (got local tensor, want full float64, dim).


def _row(fn_name):
    def run(sizes, offsets, with_offsets):
        X, W, B = full(1, ROWS, H), full(2, H, shift=1.0), full(3, H)
        x, w, b = (mine(t, sizes, offsets) for t in (X, W, B))
        if fn_name == "layer_norm":
            return tpnorm.layer_norm(x, (H,), w, b), TF.layer_norm(X.double(), (H,), W.double(),
                                                                   B.double())
        if fn_name == "rms_norm":
            return tpnorm.rms_norm(x, (H,), w, eps=1e-6), rms_ref(X, W, 1e-6)
        F_ = full(4, ROWS, H)
        f = mine(F_, sizes, offsets)
        hd = X.double() + F_.double()
        if fn_name == "fused_add_layer_norm":
            return (tpnorm.fused_add_layer_norm(x, f, (H,), w, b)[1],
                    TF.layer_norm(hd, (H,), W.double(), B.double()))
        return tpnorm.fused_add_rms_norm(x, f, (H,), w, eps=1e-6)[1], rms_ref(hd, W, 1e-6)
    return run


def _row_module(cls):
    def run(sizes, offsets, with_offsets):
        X = full(5, ROWS, H)
        m = getattr(tpnorm, cls)(H, local_size=sizes[WORLD.rank])
        with torch.no_grad():
            m.weight.copy_(mine(full(6, H, shift=1.0), sizes, offsets))
        x = mine(X, sizes, offsets)
        if cls.startswith("FusedAdd"):
            F_ = full(7, ROWS, H)
            y = m(x, mine(F_, sizes, offsets))[1]
            X = X + F_
        else:
            y = m(x)
        W = full(6, H, shift=1.0).double()
        if "Layer" in cls:
            return y, TF.layer_norm(X.double(), (H,), W, torch.zeros(H, dtype=torch.float64))
        return y, rms_ref(X, W, torch.finfo(torch.float32).eps)
    return run


def _channel(name):
    def run(sizes, offsets, with_offsets):
        X = full(8, 3, C, 5, scale=2.0, shift=0.5)
        x = mine(X, sizes, offsets, dim=1)
        r = WORLD.rank
        kw = {"channel_offset": offsets[r]} if with_offsets else {}
        if name == "group_norm":
            y = tpnorm.group_norm(x, 4, num_channels=C, **kw)
            return y, TF.group_norm(X.double(), 4), 1
        if name == "instance_norm":
            y = tpnorm.instance_norm(x, num_channels=C, **kw)
            return y, TF.instance_norm(X.double()), 1
        if name == "ShardedGroupNorm":
            m = tpnorm.ShardedGroupNorm(4, C, local_channels=sizes[r], **kw)
            return m(x), TF.group_norm(X.double(), 4), 1
        m = tpnorm.ShardedInstanceNorm(C, local_channels=sizes[r], **kw)
        return m(x), TF.instance_norm(X.double()), 1
    return run


def _gated(name):
    def run(sizes, offsets, with_offsets):
        X, Z, W = full(9, ROWS, C, shift=0.3), full(10, ROWS, C), full(11, C, shift=1.0)
        x, z, w = (mine(t, sizes, offsets) for t in (X, Z, W))
        r = WORLD.rank
        want = gated_ref(X, Z, W, 4, 1e-5)
        if name == "rms_norm_gated":
            kw = {"offset": offsets[r]} if with_offsets else {}
            return tpnorm.rms_norm_gated(x, w, z, group_size=4, hidden_size=C, **kw), want
        kw = {"offset": offsets[r]} if with_offsets else {}
        m = tpnorm.ShardedRMSNormGated(C, group_size=4, local_size=sizes[r], **kw)
        with torch.no_grad():
            m.weight.copy_(w)
        return m(x, z), want
    return run


def _batched(sizes, offsets, with_offsets):
    X, W = full(12, ROWS, H), full(13, H, shift=1.0)
    x, w = mine(X, sizes, offsets), mine(W, sizes, offsets)
    y = tpnorm.batched_row_norm([x], [w], eps=1e-6, hidden_sizes=[H])[0]
    return y, rms_ref(X, W, 1e-6)


def _batch_norm(sizes, offsets, with_offsets):
    """SyncBatchNorm splits the batch, not the channels: the uneven split is of the rows."""
    X = full(14, H, 3, 4, scale=1.5)
    x = X[offsets[WORLD.rank]:offsets[WORLD.rank] + sizes[WORLD.rank]].contiguous()
    return (tpnorm.SyncBatchNorm(3)(x), TF.batch_norm(X.double(), None, None, training=True), 0)


def _sync_batch_norm_fn(sizes, offsets, with_offsets):
    X = full(15, H, 3, scale=1.5)
    x = X[offsets[WORLD.rank]:offsets[WORLD.rank] + sizes[WORLD.rank]].contiguous()
    rm, rv = torch.zeros(3), torch.ones(3)
    y = tpnorm.sync_batch_norm(x, rm, rv, training=True)
    return y, TF.batch_norm(X.double(), None, None, training=True), 0


ENTRIES = {
    "layer_norm": _row("layer_norm"),
    "rms_norm": _row("rms_norm"),
    "fused_add_layer_norm": _row("fused_add_layer_norm"),
    "fused_add_rms_norm": _row("fused_add_rms_norm"),
    "ShardedLayerNorm": _row_module("ShardedLayerNorm"),
    "ShardedRMSNorm": _row_module("ShardedRMSNorm"),
    "FusedAddLayerNorm": _row_module("FusedAddLayerNorm"),
    "FusedAddRMSNorm": _row_module("FusedAddRMSNorm"),
    "group_norm": _channel("group_norm"),
    "instance_norm": _channel("instance_norm"),
    "ShardedGroupNorm": _channel("ShardedGroupNorm"),
    "ShardedInstanceNorm": _channel("ShardedInstanceNorm"),
    "rms_norm_gated": _gated("rms_norm_gated"),
    "ShardedRMSNormGated": _gated("ShardedRMSNormGated"),
    "batched_row_norm": _batched,
    "SyncBatchNorm": _batch_norm,
    "sync_batch_norm": _sync_batch_norm_fn,
}
# Public names that are not ops on a sharded dimension, each with where it is tested.
NOT_OPS = {
    "Communicator", "Error", "InvalidArgumentError", "as_communicator", "from_mpi4py",
    "from_nccl_group", "from_process_group", "single", "shard_range", "deepnorm_alpha",
    "deepnorm_beta",
    "SyncBatchNormAct",  # made by SyncBatchNorm.convert_sync_batchnorm (test_vision_models)
}
# Functions documented to split as shard_range when given no offset: with another split and no
# offset they must refuse on every rank (their documented misuse), never compute.
SPLIT_BY_DEFAULT = {"group_norm", "instance_norm", "rms_norm_gated"}


def _public():
    names = set()
    for n in dir(tpnorm):
        if n.startswith("_") or n in ("functional", "modules", "comm", "dtensor", "library",
                                      "parallel", "batched", "norm_classes"):
            continue
        if callable(getattr(tpnorm, n)):
            names.add(n)
    return names


def test_every_public_entry_has_a_case():
    missing = _public() - set(ENTRIES) - NOT_OPS
    assert not missing, f"public entries without a case in ENTRIES: {sorted(missing)}"


@pytest.mark.parametrize("order", ["rank order", "reversed"])
@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_documented_defaults_on_an_uneven_split(name, with_offsets, order):
    P = WORLD.size
    if P == 1 and (with_offsets or order == "reversed"):
        pytest.skip("one rank holds everything")
    total = {"SyncBatchNorm": H, "sync_batch_norm": H}.get(name, C if name in (
        "group_norm", "instance_norm", "ShardedGroupNorm", "ShardedInstanceNorm",
        "rms_norm_gated", "ShardedRMSNormGated") else H)
    sizes, offsets = layout(total, P, order)
    with_offset_arg = name in SPLIT_BY_DEFAULT | {"ShardedGroupNorm", "ShardedInstanceNorm",
                                                  "ShardedRMSNormGated"}
    if (with_offsets or order == "reversed") and not with_offset_arg:
        pytest.skip("no offset argument: the slices are consecutive in rank order")
    if order == "reversed" and not with_offsets:
        pytest.skip("without offsets the slices are consecutive in rank order")
    report, refused = [], None
    try:
        out = ENTRIES[name](sizes, offsets, with_offsets)
    except tpnorm.Error as e:
        refused = str(e).splitlines()[0]
    verdicts = WORLD.allgather(refused)
    if any(v is not None for v in verdicts):
        # Allowed only where documented, and then on every rank alike.
        ok = (name in SPLIT_BY_DEFAULT and not with_offsets and P > 1
              and all(v is not None for v in verdicts))
        report.append(f"refused: {refused}")
        assert_everywhere(ok, [] if ok else report)
        return
    got, want = out[0], out[1]
    dim = out[2] if len(out) > 2 else -1
    if dim == -1:
        want = mine(want, sizes, offsets)
    elif dim == 1:
        want = mine(want, sizes, offsets, dim=1)
    else:  # the batch
        want = want[offsets[WORLD.rank]:offsets[WORLD.rank] + sizes[WORLD.rank]]
    n = wrong(name, got, want, RT, RT, report)
    assert_everywhere(n == 0, report)
