# test_sync_batch_norm.py — tpnorm.SyncBatchNorm (and the functional form) on uneven per-rank
# batches with one rank empty, against torch.nn.functional.batch_norm in float64 on the
# concatenated batch: outputs, dx, dgamma/dbeta (summed over ranks), running statistics over
# several training steps (momentum 0.1 and None), eval; NCHW and channels-last; state_dict
# round trip with torch.nn.BatchNorm2d; mixed precision (bf16/fp16 x with float32 parameters, as
# autocast runs BatchNorm), whose parameter gradients must come out at float32's tolerance.
import pytest
import torch
import torch.nn.functional as TF

import tpnorm
from support import RTOL, WORLD, assert_everywhere, full, wrong


def batch_sizes(P):
    """Per-rank batch sizes: uneven, rank 1 empty when there are 2 or more ranks."""
    return [3, 0, 2, 1][:P] if P <= 4 else [1] * P


def my_rows(t, sizes, rank):
    lo = sum(sizes[:rank])
    return t[lo:lo + sizes[rank]].contiguous()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sync_batch_norm_matches_torch(comm, momentum, channels_last, dtype):
    r, P, C = WORLD.rank, WORLD.size, 4
    sizes = batch_sizes(P)
    N = sum(sizes)
    m = tpnorm.SyncBatchNorm(C, momentum=momentum, process_group=comm, dtype=dtype)
    ref = torch.nn.BatchNorm2d(C, momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        w, b = full(51, C, shift=1.0, dtype=dtype), full(52, C, dtype=dtype)
        m.weight.copy_(w), m.bias.copy_(b)
        ref.weight.copy_(w.double()), ref.bias.copy_(b.double())
    m.running_mean, m.running_var = m.running_mean.float(), m.running_var.float()
    rt, report, n = RTOL[dtype], [], 0
    for step in range(4):
        train = step < 3
        m.train(train), ref.train(train)
        X = full(60 + step, N, C, 3, 5, scale=1.5, shift=0.5 * step, dtype=dtype)
        dY = full(70 + step, N, C, 3, 5, dtype=dtype)
        x = my_rows(X, sizes, r)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        m.zero_grad()
        y = m(x)
        y.backward(my_rows(dY, sizes, r))
        Xd = X.double().requires_grad_()
        ref.zero_grad()
        Yd = ref(Xd)
        Yd.backward(dY.double())
        dw = m.weight.grad.double().clone()
        db = m.bias.grad.double().clone()
        WORLD.Allreduce(dw.numpy().copy(), dw.numpy())
        WORLD.Allreduce(db.numpy().copy(), db.numpy())
        rstd_max = float(torch.rsqrt(Xd.detach().var((0, 2, 3), unbiased=False) + 1e-5).max())
        s = f"step {step}: "
        n += wrong(s + "y", y, my_rows(Yd.detach(), sizes, r), rt, rt, report)
        n += wrong(s + "dx", x.grad, my_rows(Xd.grad, sizes, r), rt * max(1, rstd_max), 10 * rt,
                   report)
        n += wrong(s + "dgamma (sum over ranks)", dw, ref.weight.grad, rt * N * 15, rt, report)
        n += wrong(s + "dbeta (sum over ranks)", db, ref.bias.grad, rt * N * 15, rt, report)
        n += wrong(s + "running_mean", m.running_mean, ref.running_mean, 1e-6, 1e-5, report)
        n += wrong(s + "running_var", m.running_var, ref.running_var, 1e-6, 1e-5, report)
        n += int(m.num_batches_tracked) != int(ref.num_batches_tracked)
        if channels_last:
            n += not y.is_contiguous(memory_format=torch.channels_last)
    assert_everywhere(n == 0, report)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sync_batch_norm_half_input_fp32_params(comm, channels_last, dtype):
    r, P, C = WORLD.rank, WORLD.size, 4
    sizes = batch_sizes(P)
    N = sum(sizes)
    m = tpnorm.SyncBatchNorm(C, process_group=comm)  # float32 parameters and buffers
    ref = torch.nn.BatchNorm2d(C, dtype=torch.float64)
    with torch.no_grad():
        w, b = full(53, C, shift=1.0), full(54, C)
        m.weight.copy_(w), m.bias.copy_(b)
        ref.weight.copy_(w.double()), ref.bias.copy_(b.double())
    rt, rp, report, n = RTOL[dtype], RTOL[torch.float32], [], 0
    for step in range(3):
        train = step < 2
        m.train(train), ref.train(train)
        X = full(90 + step, N, C, 3, 5, scale=1.5, shift=0.5 * step, dtype=dtype)
        dY = full(95 + step, N, C, 3, 5, dtype=dtype)
        x = my_rows(X, sizes, r)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        m.zero_grad()
        y = m(x)
        y.backward(my_rows(dY, sizes, r))
        Xd = X.double().requires_grad_()
        ref.zero_grad()
        Yd = ref(Xd)
        Yd.backward(dY.double())
        n += y.dtype != dtype or x.grad.dtype != dtype
        n += m.weight.grad.dtype != torch.float32 or m.bias.grad.dtype != torch.float32
        dw = m.weight.grad.double().clone()
        db = m.bias.grad.double().clone()
        WORLD.Allreduce(dw.numpy().copy(), dw.numpy())
        WORLD.Allreduce(db.numpy().copy(), db.numpy())
        rstd_max = float(torch.rsqrt(Xd.detach().var((0, 2, 3), unbiased=False) + 1e-5).max())
        s = f"{dtype} step {step}: "
        n += wrong(s + "y", y, my_rows(Yd.detach(), sizes, r), rt, rt, report)
        n += wrong(s + "dx", x.grad, my_rows(Xd.grad, sizes, r), rt * max(1, rstd_max), 10 * rt,
                   report)
        n += wrong(s + "dgamma (sum over ranks)", dw, ref.weight.grad, rp * N * 15, rp, report)
        n += wrong(s + "dbeta (sum over ranks)", db, ref.bias.grad, rp * N * 15, rp, report)
        n += wrong(s + "running_mean", m.running_mean, ref.running_mean, 1e-6, 1e-5, report)
        n += wrong(s + "running_var", m.running_var, ref.running_var, 1e-6, 1e-5, report)
    assert_everywhere(n == 0, report)


def test_state_dict_round_trips_with_batchnorm2d(comm):
    bn = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.uniform_(), bn.bias.uniform_()
        bn.running_mean.uniform_(), bn.running_var.uniform_(1, 2)
        bn.num_batches_tracked.fill_(7)
    net = tpnorm.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(bn), comm)
    assert isinstance(net[0], tpnorm.SyncBatchNorm)
    sd = net.state_dict()
    assert set(sd) == {f"0.{k}" for k in bn.state_dict()}
    back = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    back.load_state_dict(sd)
    fresh = tpnorm.SyncBatchNorm(3, process_group=comm)
    fresh.load_state_dict(bn.state_dict())
    ok = all(torch.equal(back[0].state_dict()[k], v) for k, v in bn.state_dict().items())
    ok &= all(torch.equal(fresh.state_dict()[k], v) for k, v in bn.state_dict().items())
    assert_everywhere(ok, [] if ok else ["state_dict differs"])


def test_eval_makes_no_collective(comm):
    m = tpnorm.SyncBatchNorm(2, process_group=comm).eval()
    calls = comm.calls
    m(full(80, 2, 2, 3))
    assert comm.calls == calls


@pytest.mark.parametrize("spatial", [(3, 5), (1, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_layouts_as_a_convolution_makes_them(comm, spatial, channels_last):
    """A convolution's output into SyncBatchNorm, then ResNet's in-place residual add and ReLU
    on y, against BatchNorm2d in float64. A convolution leaves an empty batch NCHW while the
    other ranks' batches are channels-last, and [N, C, 1, 1] has strides that fit both formats:
    the ranks' layouts differ, y must be a tensor of its own (in-place ops refuse a view made
    inside an autograd Function) in the input's memory format."""
    r, P, C = WORLD.rank, WORLD.size, 6
    sizes = batch_sizes(P)
    N = sum(sizes)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv = torch.nn.Conv2d(3, C, 1).to(memory_format=fmt)
    conv_ref = torch.nn.Conv2d(3, C, 1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(full(55, C, 3, 1, 1)), conv.bias.copy_(full(56, C))
        conv_ref.weight.copy_(conv.weight.double()), conv_ref.bias.copy_(conv.bias.double())
    m = tpnorm.SyncBatchNorm(C, process_group=comm)
    ref = torch.nn.BatchNorm2d(C, dtype=torch.float64)
    X = full(57, N, 3, *spatial, scale=1.5, shift=0.5)
    x = my_rows(X, sizes, r).to(memory_format=fmt).requires_grad_()
    h = conv(x)
    y = m(h)
    try:
        y += h  # a BasicBlock's residual add, then its ReLU(inplace=True)
        out = torch.relu_(y)
        failed = []
    except RuntimeError as e:
        failed = [f"in-place ops on y: {e}"]
    assert_everywhere(not failed, failed)  # else no rank enters the backward's collective
    (out * out).sum().backward()
    Xd = X.double().requires_grad_()
    hd = conv_ref(Xd)
    outd = torch.relu(ref(hd) + hd)
    (outd * outd).sum().backward()
    report, n = [], 0
    n += wrong("out", out, my_rows(outd.detach(), sizes, r), 1e-5, 1e-5, report)
    n += wrong("dx", x.grad, my_rows(Xd.grad, sizes, r), 1e-4, 1e-4, report)
    dw = conv.weight.grad.double().clone()
    WORLD.Allreduce(dw.numpy().copy(), dw.numpy())
    n += wrong("conv dweight (sum over ranks)", dw, conv_ref.weight.grad, 1e-4 * N, 1e-4, report)
    if channels_last and x.shape[0] > 0 and not y.is_contiguous(memory_format=torch.channels_last):
        n += 1
        report.append(f"y has strides {y.stride()}, not channels-last")
    n += wrong("running_mean", m.running_mean, ref.running_mean, 1e-6, 1e-5, report)
    n += wrong("running_var", m.running_var, ref.running_var, 1e-6, 1e-5, report)
    assert_everywhere(n == 0, report)
