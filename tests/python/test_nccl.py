# test_nccl.py — CUDA tensors over tpnorm's NCCL communicator bootstrapped through a
# torch.distributed NCCL group (ncclUniqueId broadcast over the group), on
# torch.cuda.current_stream(). Needs one GPU per rank and a build with NCCL; skipped otherwise
# with the reason (e.g. on a machine without a GPU).
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as TF

import tpnorm
from support import WORLD, assert_everywhere, cols, full, wrong


def why_not():
    if not tpnorm._C.has_nccl():
        return "this build of tpnorm has no NCCL backend"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if torch.cuda.device_count() < WORLD.size:
        return f"{torch.cuda.device_count()} GPUs for {WORLD.size} ranks (NCCL: one GPU per rank)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL process groups"
    return None


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_sharded_layer_norm_on_gpu_over_an_nccl_group():
    r, P, H = WORLD.rank, WORLD.size, 1000
    torch.cuda.set_device(r)
    group = dist.new_group(list(range(P)), backend="nccl")
    norm = tpnorm.ShardedLayerNorm(H, device="cuda", process_group=group)
    assert norm.comm.device == f"cuda:{r}"
    X, dY = full(1, 8, H), full(2, 8, H)
    x = cols(X, r, P).cuda().requires_grad_()
    y = norm(x)
    y.backward(cols(dY, r, P).cuda())
    torch.cuda.synchronize()
    Xd = X.double().requires_grad_()
    Yd = TF.layer_norm(Xd, (H,))
    Yd.backward(dY.double())
    report = []
    n = wrong("y", y.cpu(), cols(Yd.detach(), r, P), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad.cpu(), cols(Xd.grad, r, P), 1e-4, 1e-4, report)
    assert_everywhere(n == 0, report)


# --- PyTorch's rules for CUDA work (docs/python.md, "CUDA tensors follow PyTorch's rules") -----
def _group():
    r = WORLD.rank
    torch.cuda.set_device(r)
    return dist.new_group(list(range(WORLD.size)), backend="nccl")


def _want_rms(X, H):
    Xd = X.double()
    return Xd * torch.rsqrt(Xd.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_a_call_inside_another_stream_follows_it():
    """x made on a side stream and normalised there: the call must wait for x's producer and
    its output must be ready for the side stream's next op, with no synchronise in between."""
    r, P, H = WORLD.rank, WORLD.size, 4096
    group = _group()
    X = full(3, 64, H)
    side = torch.cuda.Stream()
    report = []
    with torch.cuda.stream(side):
        x = cols(X, r, P).cuda(non_blocking=True) * 1.0  # produced on the side stream
        torch.cuda._sleep(5_000_000)  # a slow producer: a call that does not wait reads early
        y = tpnorm.rms_norm(x, (H,), eps=1e-6, process_group=group)
        z = y * 2.0  # the consumer, on the side stream
    torch.cuda.synchronize()
    wrong("y", (z / 2.0).cpu(), cols(_want_rms(X, H), r, P), 1e-5, 1e-5, report)
    assert_everywhere(not report, report)


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_a_captured_call_replays():
    """A call captured into a CUDA graph (torch.cuda.graph), run once before the capture so
    that nothing is allocated during it: replays with new input give the new output."""
    r, P, H = WORLD.rank, WORLD.size, 1024
    group = _group()
    norm = tpnorm.ShardedRMSNorm(H, eps=1e-6, device="cuda", process_group=group)
    X1, X2 = full(4, 16, H), full(5, 16, H)
    static_x = cols(X1, r, P).cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                norm(static_x)  # warm up: the communicator and its workspace
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = norm(static_x)
        static_x.copy_(cols(X2, r, P).cuda())
        graph.replay()
    torch.cuda.synchronize()
    report = []
    wrong("y", static_y.cpu(), cols(_want_rms(X2, H), r, P), 1e-5, 1e-5, report)
    assert_everywhere(not report, report)


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_a_functional_loop_keeps_memory_and_threads_constant():
    """1000 functional calls of a training loop: one communicator for the group, the GPU memory
    and the process's threads the same after the first calls as after the last."""
    import threading

    r, P, H = WORLD.rank, WORLD.size, 256
    group = _group()
    x = cols(full(6, 8, H), r, P).cuda().requires_grad_()
    w = torch.ones(x.shape[-1], device="cuda", requires_grad=True)

    def step():
        y = tpnorm.layer_norm(x, (H,), w, process_group=group)
        y.backward(torch.ones_like(y))

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    mem0, threads0 = torch.cuda.memory_allocated(), threading.active_count()
    procs0 = len(os.listdir("/proc/self/task"))
    for _ in range(1000):
        step()
    torch.cuda.synchronize()
    report = []
    if torch.cuda.memory_allocated() != mem0:
        report.append(f"GPU memory {mem0} -> {torch.cuda.memory_allocated()} bytes")
    if threading.active_count() != threads0 or len(os.listdir("/proc/self/task")) != procs0:
        report.append(f"threads {procs0} -> {len(os.listdir('/proc/self/task'))}")
    assert_everywhere(not report, report)


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_a_call_the_device_rejects_raises():
    """Slices that do not add up to the hidden size (every rank says H + 1): the device rejects
    the call; it raises tpnorm.Error on every rank and leaves y unwritten."""
    r, P, H = WORLD.rank, WORLD.size, 64
    group = _group()
    comm = tpnorm.as_communicator(group)
    comm.set_strict_calls(0)  # past the host checks: the device's own check
    x = cols(full(7, 4, H), r, P).cuda()
    got = None
    try:
        tpnorm.rms_norm(x, (H + 1,), process_group=group)
    except tpnorm.Error as e:
        got = e
    assert_everywhere(got is not None, [f"rank {r}: no error"])


@pytest.mark.skipif(why_not() is not None or not tpnorm.dtensor.AVAILABLE,
                    reason=str(why_not() or "needs torch.distributed.tensor"))
def test_hidden_sharded_norm_on_a_cuda_mesh():
    """tpnorm.parallel.HiddenShardedNorm on an NCCL mesh: a LayerNorm's DTensor plan, as on
    gloo, against the unsharded layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    r, P, H = WORLD.rank, WORLD.size, 96
    torch.cuda.set_device(r)
    mesh = init_device_mesh("cuda", (P,))
    ref = torch.nn.LayerNorm(H).cuda()
    tp = torch.nn.LayerNorm(H).cuda()
    tp.load_state_dict(ref.state_dict())
    parallelize_module(tp, mesh, tpnorm.parallel.HiddenShardedNorm(input_layouts=Shard(1),
                                                                   output_layouts=Shard(1)))
    X = full(8, 5, H).cuda()
    y = tp(distribute_tensor(X, mesh, [Shard(1)])).full_tensor()
    report = []
    wrong("y", y.cpu(), ref(X).detach().cpu().double(), 1e-5, 1e-5, report)
    assert_everywhere(not report, report)
