# test_guarantees.py — README's guarantees, each broken once by a documented call a user makes:
# slices that overlap or leave a gap are the same tpnorm.Error on every rank; batched_row_norm
# checks that its slices tile the hidden size; a module's offsets, when only its local size is
# given, are consecutive in rank order; SyncBatchNorm in eval makes no collective (a rank may run
# it alone, a deep copy too); a check that fails in Python on one rank is every rank's error;
# full_state_dict gathers every sharded module; instance_norm refuses one spatial element as
# torch does; a functional call makes no new communicator per call.
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as TF

import tpnorm
from support import WORLD, agree, assert_everywhere, cols, full, wrong


def raises_everywhere(fn, kind=tpnorm.Error, needle=""):
    """Runs fn on every rank; True on every rank iff it raised `kind` on every rank (with
    `needle` in the message)."""
    try:
        fn()
        got = "no error"
    except kind as e:
        got = "" if needle in str(e) else f"message without {needle!r}: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - reported
        got = f"{type(e).__name__}: {str(e)[:300]}"
    return agree(got == "", [got] if got else [])


@pytest.mark.parametrize("op", ["group_norm", "instance_norm", "rms_norm_gated"])
def test_overlapping_offsets_fail_on_every_rank(op):
    """Every rank at offset 0 with C / P channels: the counts add up, the slices overlap."""
    P = WORLD.size
    if P == 1:
        pytest.skip("one rank cannot overlap itself")
    C = 4 * P
    x = full(1, 2, C // P, 3)
    if op == "group_norm":
        fn = lambda: tpnorm.group_norm(x, 2, num_channels=C, channel_offset=0)  # noqa: E731
    elif op == "instance_norm":
        fn = lambda: tpnorm.instance_norm(x, num_channels=C, channel_offset=0)  # noqa: E731
    else:
        xg = full(2, 3, C // P)
        fn = lambda: tpnorm.rms_norm_gated(xg, None, xg, group_size=2, hidden_size=C,  # noqa
                                           offset=0)
    ok, lines = raises_everywhere(fn, needle="held by more than one rank")
    assert ok, lines


def test_module_offsets_follow_rank_order_and_overlaps_fail():
    P, r = WORLD.size, WORLD.rank
    sizes = [1] * (P - 1) + [8 - (P - 1)]  # uneven: the last rank holds most
    X = full(3, 2, 8, 5, scale=2.0)
    m = tpnorm.ShardedGroupNorm(4, 8, local_channels=sizes[r])
    lo = sum(sizes[:r])
    report = []
    if m.shard != (lo, lo + sizes[r]):
        report.append(f"shard {m.shard}, want {(lo, lo + sizes[r])}")
    else:
        wrong("y", m(X[:, lo:lo + sizes[r]].contiguous()),
              TF.group_norm(X.double(), 4)[:, lo:lo + sizes[r]], 2e-5, 2e-5, report)
    assert_everywhere(not report, report)
    if P > 1:
        bad = tpnorm.ShardedGroupNorm(4, 8, local_channels=8 // P, channel_offset=0)
        ok, lines = raises_everywhere(lambda: bad(full(4, 2, 8 // P, 5)),
                                      needle="held by more than one rank")
        assert ok, lines


def test_batched_row_norm_checks_its_tiling():
    P = WORLD.size
    X = full(5, 3, 8)
    if P > 1:  # every rank passing its whole rows, as for an unsharded norm
        ok, lines = raises_everywhere(
            lambda: tpnorm.batched_row_norm([X], None, None, eps=1e-6, hidden_sizes=[8]),
            needle="add up to")
        assert ok, lines
        ok, lines = raises_everywhere(
            lambda: tpnorm.batched_row_norm([X], None, None, eps=1e-6), kind=ValueError,
            needle="hidden_sizes")
        assert ok, lines
    y = tpnorm.batched_row_norm([cols(X, WORLD.rank, P)], None, None, eps=1e-6,
                                hidden_sizes=[8])[0]
    Xd = X.double()
    want = Xd * torch.rsqrt(Xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    report = []
    wrong("y", y, cols(want, WORLD.rank, P), 1e-5, 1e-5, report)
    assert_everywhere(not report, report)


def test_sync_batch_norm_eval_alone_makes_no_collective():
    """Validation on rank 0 alone, of a module over an mpi4py communicator never used before
    (its communicator would be made collectively) and of a deep copy of it (an EMA model)."""
    m = tpnorm.SyncBatchNorm(3, process_group=WORLD.Dup())
    m.eval()
    ema = copy.deepcopy(m)
    report = []
    if WORLD.rank == 0:
        x = full(6, 4, 3, 2)
        for mod in (m, ema):
            want = TF.batch_norm(x.double(), torch.zeros(3, dtype=torch.float64),
                                 torch.ones(3, dtype=torch.float64))
            wrong("y", mod(x), want, 1e-5, 1e-5, report)
    assert_everywhere(not report, report)


def test_sync_batch_norm_eval_without_running_stats_uses_own_batch():
    m = tpnorm.SyncBatchNorm(3, track_running_stats=False).eval()
    x = full(7 + WORLD.rank, 4, 3, 2)
    report = []
    wrong("y", m(x), TF.batch_norm(x.double(), None, None, training=True), 1e-5, 1e-5, report)
    assert_everywhere(not report, report)


def test_a_python_check_failing_on_one_rank_fails_everywhere():
    """The last rank passes a 1-D empty tensor to a training SyncBatchNorm; torch raises
    ValueError there, so every rank must raise it (not wait in the collective)."""
    m = tpnorm.SyncBatchNorm(3)
    last = WORLD.rank == WORLD.size - 1
    x = torch.empty(0) if last else full(8, 2, 3)
    ok, lines = raises_everywhere(lambda: m(x), kind=ValueError, needle="2D input")
    assert ok, lines
    report = []
    if int(m.num_batches_tracked) != 0:
        report.append(f"num_batches_tracked {int(m.num_batches_tracked)} after a failed call")
    assert_everywhere(not report, report)


@pytest.mark.parametrize("cls", ["ShardedGroupNorm", "ShardedRMSNormGated", "ShardedLayerNorm"])
def test_full_state_dict_gathers_every_sharded_module(cls):
    P, r = WORLD.size, WORLD.rank
    sizes = [1] * (P - 1) + [12 - (P - 1)]
    if cls == "ShardedGroupNorm":
        m = tpnorm.ShardedGroupNorm(3, 12, local_channels=sizes[r])
    elif cls == "ShardedRMSNormGated":
        m = tpnorm.ShardedRMSNormGated(12, group_size=4, local_size=sizes[r])
    else:
        m = tpnorm.ShardedLayerNorm(12, local_size=sizes[r])
    W = full(9, 12)
    tpnorm.parallel.load_full_state_dict(m, {k: W.clone() if k == "weight" else full(10, 12)
                                             for k in m.state_dict()})
    sd = tpnorm.parallel.full_state_dict(m)
    report = []
    if tuple(sd["weight"].shape) != (12,) or not torch.equal(sd["weight"], W):
        report.append(f"weight {tuple(sd['weight'].shape)}, not the full [12] tensor")
    assert_everywhere(not report, report)


def test_instance_norm_refuses_one_spatial_element_as_torch():
    x = full(11, 2, 3, 1)
    with pytest.raises(ValueError):
        TF.instance_norm(x)
    ok, lines = raises_everywhere(lambda: tpnorm.instance_norm(cols(x, WORLD.rank, WORLD.size,
                                                                    dim=1), num_channels=3),
                                  kind=ValueError, needle="spatial element")
    assert ok, lines


@pytest.mark.parametrize("group", ["mpi4py", "gloo"])
def test_functional_calls_reuse_one_communicator(group):
    """A training loop's functional calls: one communicator for the group, made once, and past
    its strict calls one collective per call."""
    g = WORLD if group == "mpi4py" else dist.group.WORLD
    x = cols(full(12, 4, 16), WORLD.rank, WORLD.size)
    first = tpnorm.as_communicator(g)
    for _ in range(20):  # past the strict calls of a new communicator
        tpnorm.rms_norm(x, (16,), process_group=g)
    comm = tpnorm.as_communicator(g)
    before = comm.calls
    for _ in range(10):
        tpnorm.rms_norm(x, (16,), process_group=g)
    report = []
    if comm is not first:
        report.append("as_communicator made a second communicator for the same group")
    if WORLD.size > 1 and comm.calls - before != 10:
        report.append(f"{comm.calls - before} collectives for 10 calls")
    assert_everywhere(not report, report)
