# test_nn_conventions.py — calls written as for torch.nn / torch.nn.functional either behave
# like them or raise a clear error on every rank: the argument order, eps defaults, tuple
# normalized_shape, the attributes and reset_parameters() of nn.LayerNorm, one
# `process_group` keyword, and the hidden-size tiling check (the ranks' slices must add up to
# normalized_shape[-1], checked by the op on every rank).
import inspect

import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import WORLD, assert_everywhere, cols, full, wrong


def outcome(fn):
    try:
        fn()
    except tpnorm.Error as e:
        return ("tpnorm.Error", e.code, str(e))
    except Exception as e:  # noqa: BLE001 - reported below
        return (type(e).__name__, None, str(e))
    return None


def assert_same_error(got, *words):
    everyone = WORLD.allgather(got)
    ok = all(o is not None and o == everyone[0] for o in everyone)
    ok = ok and everyone[0][0] == "tpnorm.Error" and everyone[0][1] == tpnorm._C.INVALID_ARGUMENT
    ok = ok and all(w in everyone[0][2] for w in words)
    assert_everywhere(ok, [] if ok else [f"outcomes: {everyone}"])


def test_positional_arguments_are_torch_nn_order(comm):
    ln = tpnorm.ShardedLayerNorm(8, 1e-6, False, process_group=comm)
    assert ln.eps == 1e-6 and ln.elementwise_affine is False and ln.weight is None
    ln = tpnorm.ShardedLayerNorm((2, 8), 1e-3, True, False, process_group=comm)
    assert ln.normalized_shape == (2, 8) and ln.bias is None
    assert ln.weight.shape == (2, ln.local_size)
    rms = tpnorm.ShardedRMSNorm([8], process_group=comm)
    assert rms.eps is None and rms.normalized_shape == (8,)
    gn = tpnorm.ShardedGroupNorm(2, 4, 1e-3, False, process_group=comm)
    assert gn.eps == 1e-3 and gn.affine is False and gn.weight is None
    inn = tpnorm.ShardedInstanceNorm(4, 1e-3, 0.1, True, process_group=comm)
    assert inn.eps == 1e-3 and inn.affine is True
    with pytest.raises(ValueError, match="running statistics"):
        tpnorm.ShardedInstanceNorm(4, track_running_stats=True, process_group=comm)


def test_one_group_keyword_everywhere():
    callables = [tpnorm.ShardedLayerNorm, tpnorm.ShardedRMSNorm, tpnorm.FusedAddLayerNorm,
                 tpnorm.FusedAddRMSNorm, tpnorm.ShardedGroupNorm, tpnorm.ShardedInstanceNorm,
                 tpnorm.SyncBatchNorm, tpnorm.layer_norm, tpnorm.rms_norm,
                 tpnorm.fused_add_layer_norm, tpnorm.fused_add_rms_norm, tpnorm.group_norm,
                 tpnorm.instance_norm, tpnorm.sync_batch_norm]
    for c in callables:
        params = inspect.signature(c).parameters
        assert "process_group" in params, c
        assert "group" not in params and "comm" not in params, c


def test_attributes_reset_parameters_and_repr(comm):
    m = tpnorm.ShardedLayerNorm(10, process_group=comm)
    with torch.no_grad():
        m.weight.fill_(3.0)
        m.bias.fill_(2.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones_like(m.weight))
    assert torch.equal(m.bias, torch.zeros_like(m.bias))
    text = repr(m)
    assert "(10,)" in text and "eps=1e-05" in text and "elementwise_affine=True" in text
    assert m.hidden_size == 10


@pytest.mark.parametrize("shape", [(3, 8), (2, 1, 5)])
def test_tuple_normalized_shape_matches_torch(comm, shape):
    r, P, eps = WORLD.rank, WORLD.size, 1e-5
    X, dY = full(70, 4, *shape, shift=0.5), full(71, 4, *shape)
    W, B = full(72, *shape, shift=1.0), full(73, *shape)
    m = tpnorm.ShardedLayerNorm(shape, process_group=comm)
    with torch.no_grad():
        m.weight.copy_(cols(W, r, P))
        m.bias.copy_(cols(B, r, P))
    x = cols(X, r, P).requires_grad_()
    y = m(x)
    y.backward(cols(dY, r, P))
    Xd, Wd, Bd = (t.double().requires_grad_() for t in (X, W, B))
    Yd = TF.layer_norm(Xd, shape, Wd, Bd, eps)
    Yd.backward(dY.double())
    report = []
    n = wrong("y", y, cols(Yd.detach(), r, P), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad, cols(Xd.grad, r, P), 1e-4, 1e-4, report)
    n += wrong("dweight", m.weight.grad, cols(Wd.grad, r, P), 1e-4, 1e-4, report)
    n += wrong("dbias", m.bias.grad, cols(Bd.grad, r, P), 1e-4, 1e-4, report)
    assert_everywhere(n == 0, report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_eps_none_is_the_dtype_eps(comm, dtype):
    r, P, H = WORLD.rank, WORLD.size, 9
    X = full(74, 3, H, scale=1e-3, dtype=dtype)  # small rows: eps matters
    m = tpnorm.ShardedRMSNorm(H, dtype=dtype, process_group=comm)
    y = m(cols(X, r, P))
    Xd, e = X.double(), torch.finfo(torch.float32).eps  # torch's: its float32 compute type
    ref = Xd * torch.rsqrt(Xd.pow(2).mean(-1, keepdim=True) + e)
    report = []
    rt = 1e-5 if dtype == torch.float32 else 8e-3
    n = wrong("y", y, cols(ref, r, P), rt, rt, report)
    if hasattr(torch.nn, "RMSNorm"):  # torch >= 2.4: torch's own module (its eps too) agrees
        with torch.no_grad():
            theirs = torch.nn.RMSNorm(H, dtype=dtype)(X)
        n += wrong("y vs nn.RMSNorm", y, cols(theirs, r, P), 2 * rt, 2 * rt, report)
    assert_everywhere(n == 0, report)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "fused"])
def test_slices_that_do_not_tile_the_hidden_size_fail_on_every_rank(comm, kind):
    """Each rank builds its module with a local_size; their sum is H + 1."""
    r, P, H = WORLD.rank, WORLD.size, 7
    k = tpnorm.shard_range(H, r, P)
    k = k[1] - k[0] + (1 if r == P - 1 else 0)
    x = full(75, 3, k)
    if kind == "layer_norm":
        m = tpnorm.ShardedLayerNorm(H, local_size=k, process_group=comm)
        got = outcome(lambda: m(x))
    elif kind == "rms_norm":
        m = tpnorm.ShardedRMSNorm(H, local_size=k, process_group=comm)
        got = outcome(lambda: m(x.requires_grad_()))
    else:
        m = tpnorm.FusedAddLayerNorm(H, local_size=k, process_group=comm)
        got = outcome(lambda: m(x, x))
    assert_same_error(got, "add up to " + str(H + 1), "hidden size is " + str(H))


def test_functional_call_on_unsharded_rows_is_torchs_or_an_error():
    """tpnorm.layer_norm(x, (H,)) with the default group, every rank holding whole rows: at 1
    rank it is F.layer_norm; at more the slices add up to P*H and every rank says so."""
    P, H = WORLD.size, 6
    x = full(76 + WORLD.rank, 4, H)
    got = outcome(lambda: tpnorm.layer_norm(x, (H,)))
    if P == 1:
        report = []
        n = wrong("y", tpnorm.layer_norm(x, (H,)), TF.layer_norm(x.double(), (H,)), 1e-5, 1e-5,
                  report)
        assert got is None and n == 0, report
    else:
        assert_same_error(got, "add up to " + str(P * H))


def test_instance_norm_running_statistics_are_an_error(comm):
    x = full(77, 2, 3, 4)
    with pytest.raises(ValueError, match="running statistics"):
        tpnorm.instance_norm(x, torch.zeros(3), torch.ones(3), process_group=comm)
