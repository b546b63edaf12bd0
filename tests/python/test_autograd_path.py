# test_autograd_path.py — the row norms' eager autograd: C++ (tpnorm._autograd) where the build
# made it for this torch, else the Python Function. The suite's ctests say which path they
# expect (TPNORM_EXPECT_CPP_AUTOGRAD), so a build that silently lost the C++ module fails here;
# one ctest runs the row-norm tests with TPNORM_PYTHON_AUTOGRAD=1 to keep the fallback honest.
# Values are checked by the other test files, which run on whichever path is active.
import os

import pytest
import torch
import torch.distributed as dist

import tpnorm
from tpnorm import functional as F
from support import WORLD, assert_everywhere, cols, full
from test_errors import outcome, same_error_everywhere


def test_the_expected_path_is_active():
    want = os.environ.get("TPNORM_EXPECT_CPP_AUTOGRAD")
    if want is None:
        pytest.skip("TPNORM_EXPECT_CPP_AUTOGRAD is not set (the suite's ctests set it)")
    assert F.CPP_AUTOGRAD == (want == "1"), F.CPP_AUTOGRAD_REASON


@pytest.mark.parametrize("centered", [True, False])
def test_grad_fn_is_the_active_paths_node(comm, centered):
    r, P = WORLD.rank, WORLD.size
    x = cols(full(1, 3, 10), r, P).requires_grad_()
    w = cols(full(2, 10), r, P).requires_grad_()
    y = tpnorm.layer_norm(x, (10,), w, process_group=comm) if centered else \
        tpnorm.rms_norm(x, (10,), w, process_group=comm)
    name = y.grad_fn.name()
    ok = ("RowNorm" in name and "CppNode" in name) if F.CPP_AUTOGRAD else \
        name == "_RowNormBackward"
    assert_everywhere(ok, [f"grad_fn {name}, CPP_AUTOGRAD {F.CPP_AUTOGRAD}"])


def _failing_comm():
    """A communicator over the world group whose all_reduce raises on every rank once
    fail[0] is set, before any rank sums anything (so no rank waits for another)."""
    from torch.utils.dlpack import from_dlpack

    fail = [False]

    def all_reduce(capsule):
        if fail[0]:
            raise ValueError("injected failure of the all_reduce")
        dist.all_reduce(from_dlpack(capsule))

    comm = tpnorm._C.callback_communicator(dist.get_rank(), dist.get_world_size(), all_reduce)
    return comm, fail


@pytest.mark.parametrize("centered", [True, False])
def test_a_failure_in_backward_is_tpnorm_error_on_every_rank(centered):
    """The backward node runs inside autograd's engine: its failure must still reach the
    caller of backward() as tpnorm.Error with its code, the same on every rank, and leave the
    gradients unset."""
    r, P = WORLD.rank, WORLD.size
    comm, fail = _failing_comm()
    x = cols(full(3, 4, 9), r, P).requires_grad_()
    w = cols(full(4, 9), r, P).requires_grad_()
    b = cols(full(5, 9), r, P).requires_grad_()
    y = tpnorm.layer_norm(x, (9,), w, b, process_group=comm) if centered else \
        tpnorm.rms_norm(x, (9,), w, process_group=comm)
    fail[0] = True
    got = outcome(lambda: y.backward(torch.ones_like(y)))
    same_error_everywhere(got, tpnorm._C.COMMUNICATION, "injected failure")
    assert_everywhere(x.grad is None and w.grad is None and b.grad is None,
                      [f"gradients set after a failed backward: x {x.grad is not None}"])


def test_a_failure_in_forward_is_tpnorm_error_on_every_rank():
    r, P = WORLD.rank, WORLD.size
    comm, fail = _failing_comm()
    fail[0] = True
    x = cols(full(6, 2, 7), r, P).requires_grad_()
    got = outcome(lambda: tpnorm.layer_norm(x, (7,), process_group=comm))
    same_error_everywhere(got, tpnorm._C.COMMUNICATION, "injected failure")


def test_saved_input_modified_in_place_is_refused(comm):
    """Autograd's version check on the saved input (both paths save x for backward)."""
    r, P = WORLD.rank, WORLD.size
    x = cols(full(7, 3, 8), r, P).requires_grad_()
    h = x * 1.0
    y = tpnorm.layer_norm(h, (8,), process_group=comm)
    h.add_(1.0)
    got = outcome(lambda: y.sum().backward())
    ok = got is not None and got[0] == "RuntimeError" and "modified by an inplace" in got[2]
    assert_everywhere(ok, [f"outcome {got}"])
