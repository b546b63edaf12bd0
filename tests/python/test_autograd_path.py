# test_autograd_path.py — every op's eager autograd: C++ (tpnorm._autograd) where the build made
# it for this torch, else the Python Functions. The suite's ctests say which path they expect
# (TPNORM_EXPECT_CPP_AUTOGRAD), so a build that silently lost the C++ module fails here; one
# ctest runs these and the row-norm tests with TPNORM_PYTHON_AUTOGRAD=1 to keep the fallback
# honest.
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


def _op_call(op, comm):
    """(output, its Python Function's backward name) of `op` on this rank's shard, with
    parameters requiring grad, over `comm`."""
    r, P = WORLD.rank, WORLD.size
    x = cols(full(1, 3, 10), r, P).requires_grad_()
    w = cols(full(2, 10), r, P).requires_grad_()
    if op == "layer_norm":
        return tpnorm.layer_norm(x, (10,), w, process_group=comm), "_RowNormBackward"
    if op == "rms_norm":
        return tpnorm.rms_norm(x, (10,), w, process_group=comm), "_RowNormBackward"
    if op == "fused_add_layer_norm":
        f = cols(full(3, 3, 10), r, P).requires_grad_()
        return (tpnorm.fused_add_layer_norm(x, f, (10,), w, process_group=comm)[1],
                "_FusedAddNormBackward")
    if op == "batched_row_norm":
        return (tpnorm.batched_row_norm([x], [w], hidden_sizes=[10], process_group=comm)[0],
                "_BatchedRowNormBackward")
    if op == "rms_norm_gated":
        z = cols(full(4, 3, 10), r, P).requires_grad_()
        return (tpnorm.rms_norm_gated(x, w, z, group_size=5, hidden_size=10,
                                      process_group=comm), "_RMSNormGatedBackward")
    img = cols(full(5, 2, 8, 3), r, P, dim=1).requires_grad_()
    cw = cols(full(6, 8, shift=1.0), r, P).requires_grad_()
    if op == "group_norm":
        return (tpnorm.group_norm(img, 2, cw, num_channels=8, process_group=comm),
                "_GroupNormBackward")
    if op == "instance_norm":
        return (tpnorm.instance_norm(img, weight=cw, num_channels=8, process_group=comm),
                "_GroupNormBackward")
    bx = full(7, 2 + r, 4, 3).requires_grad_()  # SyncBatchNorm: the batch split, uneven
    return (tpnorm.sync_batch_norm(bx, torch.zeros(4), torch.ones(4), full(8, 4), full(9, 4),
                                   training=True, process_group=comm), "_SyncBatchNormBackward")


OPS = ["layer_norm", "rms_norm", "fused_add_layer_norm", "batched_row_norm", "rms_norm_gated",
       "group_norm", "instance_norm", "sync_batch_norm"]


@pytest.mark.parametrize("op", OPS)
def test_grad_fn_is_the_active_paths_node(comm, op):
    y, python_name = _op_call(op, comm)
    name = y.grad_fn.name()
    ok = "CppNode" in name if F.CPP_AUTOGRAD else name == python_name
    y.backward(torch.ones_like(y))
    assert_everywhere(ok, [f"{op}: grad_fn {name}, CPP_AUTOGRAD {F.CPP_AUTOGRAD}"])


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


@pytest.mark.parametrize("op", OPS)
def test_a_failure_in_backward_is_tpnorm_error_on_every_rank(op):
    """The backward node runs inside autograd's engine: its failure must still reach the
    caller of backward() as tpnorm.Error with its code, the same on every rank, and leave the
    gradients unset."""
    comm, fail = _failing_comm()
    y, _ = _op_call(op, comm)
    leaves = [t for t in _leaves(y)]
    fail[0] = True
    got = outcome(lambda: y.backward(torch.ones_like(y)))
    same_error_everywhere(got, tpnorm._C.COMMUNICATION, "injected failure")
    assert_everywhere(all(t.grad is None for t in leaves),
                      [f"{op}: gradients set after a failed backward"])


def _leaves(y):
    """The leaf tensors y's graph reaches."""
    seen, out, todo = set(), [], [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if hasattr(fn, "variable"):
            out.append(fn.variable)
        todo += [f for f, _ in fn.next_functions]
    return out


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
