# test_inplace_outputs.py — every output of every public function and module of tpnorm is a
# tensor of its own, as torch.nn's are: an in-place op on it (a ReLU(inplace=True), a residual
# `out += identity`) and the backward through it work, and give the gradients of the same op
# written out of place. The in-place op here is out.mul_(2); out of place, the loss is doubled
# instead, so both gradients are the same bits. An output the backward needs (the fused ops'
# h, the residual stream) is guarded by autograd's version counter instead: modifying it in
# place makes backward() raise autograd's own error on every rank, before any collective.
#
# Shapes: hidden 10 and 6 channels sharded over the ranks, SyncBatchNorm on uneven batches with
# rank 1 empty, NCHW and channels-last (spatial 1x1 included: strides that fit both formats);
# the row norms on DTensors too where torch has them (>= 2.5).
import pytest
import torch

import tpnorm
from support import WORLD, agree, assert_everywhere, cols, full

H, C = 10, 6


def _bn_batch(P):
    return [3, 0, 2, 1][:P] if P <= 4 else [1] * P


def _bn_input(seed, spatial, fmt):
    sizes = _bn_batch(WORLD.size)
    lo = sum(sizes[:WORLD.rank])
    X = full(seed, sum(sizes), C, *spatial, shift=0.5)
    return X[lo:lo + sizes[WORLD.rank]].contiguous().to(memory_format=fmt)


def _row_input(seed):
    return cols(full(seed, 3, H, shift=0.3), WORLD.rank, WORLD.size)


def _chan_input(seed):
    return cols(full(seed, 2, C, 3, 2, shift=0.3), WORLD.rank, WORLD.size, dim=1)


def _cases(comm):
    """name -> (make(): (inputs, a function of them returning the outputs, the module's
    parameters), indices of the outputs the backward saves). The inputs are made leaves that
    require grad; a functional form's parameters are among its inputs."""
    r, P = WORLD.rank, WORLD.size
    lo, hi = tpnorm.shard_range(H, r, P)
    w, b = full(3, H)[lo:hi].clone(), full(4, H)[lo:hi].clone()
    clo, chi = tpnorm.shard_range(C, r, P)
    gw, gb = full(5, C)[clo:chi].clone(), full(6, C)[clo:chi].clone()
    cases = {
        "layer_norm": (lambda: ([_row_input(1), w.clone(), b.clone()],
                                lambda x, w, b: (tpnorm.layer_norm(x, H, w, b, process_group=comm),)),
                       ()),
        "rms_norm": (lambda: ([_row_input(1), w.clone()],
                              lambda x, w: (tpnorm.rms_norm(x, H, w, process_group=comm),)), ()),
        "fused_add_layer_norm": (
            lambda: ([_row_input(1), _row_input(2), w.clone(), b.clone()],
                     lambda x, f, w, b: tpnorm.fused_add_layer_norm(x, f, H, w, b,
                                                                    process_group=comm)), (0,)),
        "fused_add_rms_norm": (
            lambda: ([_row_input(1), _row_input(2), w.clone()],
                     lambda x, f, w: tpnorm.fused_add_rms_norm(x, f, H, w, process_group=comm)),
            (0,)),
        "group_norm": (lambda: ([_chan_input(7), gw.clone(), gb.clone()],
                                lambda x, w, b: (tpnorm.group_norm(
                                    x, 3, w, b, process_group=comm, num_channels=C),)), ()),
        "instance_norm": (lambda: ([_chan_input(7)], lambda x: (tpnorm.instance_norm(
            x, process_group=comm, num_channels=C),)), ()),
    }

    def module(make_module, make_inputs):
        def make():
            m = make_module()
            return make_inputs(), lambda *a: _tuple(m(*a)), list(m.parameters())
        return make

    mods = {
        "ShardedLayerNorm": (lambda: tpnorm.ShardedLayerNorm(H, process_group=comm),
                             lambda: [_row_input(1)], ()),
        "ShardedRMSNorm": (lambda: tpnorm.ShardedRMSNorm(H, process_group=comm),
                           lambda: [_row_input(1)], ()),
        "FusedAddLayerNorm": (lambda: tpnorm.FusedAddLayerNorm(H, process_group=comm),
                              lambda: [_row_input(1), _row_input(2)], (0,)),
        "FusedAddRMSNorm": (lambda: tpnorm.FusedAddRMSNorm(H, process_group=comm),
                            lambda: [_row_input(1), _row_input(2)], (0,)),
        "ShardedGroupNorm": (lambda: tpnorm.ShardedGroupNorm(3, C, process_group=comm),
                             lambda: [_chan_input(7)], ()),
        "ShardedInstanceNorm": (lambda: tpnorm.ShardedInstanceNorm(C, affine=True,
                                                                   process_group=comm),
                                lambda: [_chan_input(7)], ()),
    }
    for spatial in [(3, 2), (1, 1)]:
        for fmt, fname in [(torch.contiguous_format, "nchw"), (torch.channels_last, "cl")]:
            key = f"SyncBatchNorm[{fname},{spatial[0]}x{spatial[1]}]"
            mods[key] = (lambda: tpnorm.SyncBatchNorm(C, process_group=comm),
                         lambda s=spatial, f=fmt: [_bn_input(8, s, f)], ())
            cases[f"sync_batch_norm[{fname},{spatial[0]}x{spatial[1]}]"] = (
                lambda s=spatial, f=fmt: (
                    [_bn_input(8, s, f), full(9, C), full(10, C)],
                    lambda x, w, b: (tpnorm.sync_batch_norm(
                        x, torch.zeros(C), torch.ones(C), w, b, training=True,
                        process_group=comm),)), ())
    for name, (make_module, make_inputs, saved) in mods.items():
        cases[name] = (module(make_module, make_inputs), saved)
    if tpnorm.dtensor.AVAILABLE:  # the same functions on DTensors sharded on the hidden dim
        def dt(t, dim):
            from torch.distributed.tensor import Shard, distribute_tensor
            return distribute_tensor(t, _mesh(), [Shard(dim)])

        cases["layer_norm[DTensor]"] = (lambda: (
            [dt(full(1, 3, H, shift=0.3), 1), dt(full(3, H), 0), dt(full(4, H), 0)],
            lambda x, w, b: (tpnorm.layer_norm(x, H, w, b),)), ())
        cases["fused_add_rms_norm[DTensor]"] = (lambda: (
            [dt(full(1, 3, H, shift=0.3), 1), dt(full(2, 3, H), 1), dt(full(3, H), 0)],
            lambda x, f, w: tpnorm.fused_add_rms_norm(x, f, H, w)), (0,))
    return cases


_meshes = []


def _mesh():
    """A 1-D CPU mesh over the world, made once (making one is collective)."""
    if not _meshes:
        from torch.distributed.device_mesh import init_device_mesh
        _meshes.append(init_device_mesh("cpu", (WORLD.size,)))
    return _meshes[0]


def _local(t):
    """A DTensor's local shard (a plain tensor as it is; None stays None)."""
    return t.to_local() if tpnorm.dtensor.is_dtensor(t) else t


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _run(make):
    """(outputs, the tensors whose gradients are compared: the inputs as leaves, then the
    module's parameters)."""
    made = make()
    inputs, fn, params = made if len(made) == 3 else (*made, [])
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return fn(*leaves), leaves + params


def _grads(make, in_place, report):
    """Gradients of sum(out_i * g_i) over the outputs, doubled: by out.mul_(2) on each output
    before the loss (in_place), or by doubling the loss. None when the in-place op failed on
    some rank (then no rank enters the backward's collective)."""
    outs, leaves = _run(make)
    failed = []
    if in_place:
        for i, o in enumerate(outs):
            try:
                o.mul_(2)
            except RuntimeError as e:
                failed.append(f"output {i}: {e}")
    ok, lines = agree(not failed, failed)
    if not ok:
        report.append(lines)
        return None
    outs = [_local(o) for o in outs]
    loss = sum((o * full(20 + i, *o.shape)).sum() for i, o in enumerate(outs))
    (loss if in_place else 2 * loss).backward()
    return [_local(t.grad) for t in leaves]


@pytest.mark.parametrize("name", sorted(_cases(None)))
def test_in_place_on_every_output_then_backward(comm, name):
    make, saved = _cases(comm)[name]
    report = []
    if saved:  # autograd's version counter guards an output the backward needs
        outs, _ = _run(make)
        for i in saved:
            outs[i].mul_(2)
        try:
            sum(_local(o).sum() for o in outs).backward()
            report.append(f"outputs {saved} modified in place, yet backward() ran")
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                report.append(f"backward() raised {e!r}")
        # the outputs the backward does not need take in-place ops
        outs, _ = _run(make)
        for i, o in enumerate(outs):
            if i not in saved:
                o.mul_(2)
        sum(_local(o).sum() for o in outs).backward()
    else:
        got, want = _grads(make, True, report), _grads(make, False, report)
        for i, (g, wg) in enumerate(zip(got or [], want)):
            if (g is None) != (wg is None) or (g is not None and not torch.equal(g, wg)):
                report.append(f"input {i}: gradient after the in-place op differs")
    assert_everywhere(not report, report)
