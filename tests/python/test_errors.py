# test_errors.py — tpnorm errors from Python: one exception type (tpnorm.Error, a RuntimeError
# with .code), raised on every rank together with the same message, no hang; the binding's own
# argument checks (contiguity, dtype) name the argument and are agreed the same way.
import pytest
import torch

import tpnorm
from support import WORLD, assert_everywhere, cols, full


def outcome(fn):
    """(exception type name, code, message) of fn(), or None when it returned."""
    try:
        fn()
    except tpnorm.Error as e:
        return ("tpnorm.Error", e.code, str(e))
    except Exception as e:  # noqa: BLE001 - reported, and fails the test below
        return (type(e).__name__, None, str(e))
    return None


def same_error_everywhere(got, code, *words):
    everyone = WORLD.allgather(got)
    ok = all(o is not None and o == everyone[0] for o in everyone)
    ok = ok and everyone[0][0] == "tpnorm.Error" and everyone[0][1] == code
    ok = ok and all(w in everyone[0][2] for w in words)
    assert_everywhere(ok, [] if ok else [f"outcomes: {everyone}"])


def test_error_is_a_runtime_error_with_code():
    assert issubclass(tpnorm.Error, RuntimeError)
    assert tpnorm._C.INVALID_ARGUMENT == 1 and tpnorm._C.MISMATCH == 2


def test_one_rank_with_a_different_shape_fails_everywhere(comm):
    r, P = WORLD.rank, WORLD.size
    rows = 4 + (1 if r == P - 1 else 0)  # the last rank passes one row more
    x = cols(full(90, rows, 8), r, P).requires_grad_()
    code = tpnorm._C.INVALID_ARGUMENT if P == 1 else tpnorm._C.MISMATCH
    got = outcome(lambda: tpnorm.layer_norm(x, (8,), process_group=comm))
    if P == 1:
        assert got is None  # one rank alone has nothing to disagree with
    else:
        same_error_everywhere(got, code, "layer_norm_forward", "rows")
    # The communicator is still usable afterwards (no half-finished collective).
    y = tpnorm.layer_norm(cols(full(91, 2, 8), r, P), (8,), process_group=comm)
    assert y.shape[0] == 2


def test_non_contiguous_input_on_one_rank_names_the_argument(comm):
    r, P = WORLD.rank, WORLD.size
    X = full(92, 6, 10)
    x = cols(X, r, P)
    if r == 0:  # same shape, but a transposed copy's transpose: not row-major
        x = x.t().contiguous().t()
        assert not x.is_contiguous()
    got = outcome(lambda: tpnorm.layer_norm(x, (10,), process_group=comm))
    same_error_everywhere(got, tpnorm._C.INVALID_ARGUMENT, "rank 0", "argument 'x'",
                          "not contiguous")


def test_wrong_dtype_names_the_argument(comm):
    r, P = WORLD.rank, WORLD.size
    x = cols(full(93, 3, 8), r, P)
    w = torch.ones(x.shape[-1], dtype=torch.int32)
    got = outcome(lambda: tpnorm.rms_norm(x, (8,), w, process_group=comm))
    same_error_everywhere(got, tpnorm._C.INVALID_ARGUMENT, "argument 'gamma'", "int32")


def test_failed_batch_norm_leaves_running_stats_untouched(comm):
    m = tpnorm.SyncBatchNorm(3, process_group=comm)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.ones(1, 3, 1, 1) if WORLD.rank == 0 else torch.ones(0, 3, 1, 1)
    got = outcome(lambda: m(x))  # one value per channel over the global batch: an error
    same_error_everywhere(got, tpnorm._C.INVALID_ARGUMENT, "sync_batch_norm_forward")
    ok = all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert_everywhere(ok, [] if ok else ["running statistics changed by a failed call"])
