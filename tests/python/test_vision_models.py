# test_vision_models.py — tpnorm.SyncBatchNorm inside other people's vision models, trained
# data-parallel as their users train them: torchvision's ResNet-18 and timm's MobileNetV3 (whose
# norms are timm's BatchNormAct2d), built from their code with random weights (nothing is
# downloaded), converted with tpnorm.SyncBatchNorm.convert_sync_batchnorm, wrapped in
# DistributedDataParallel over gloo, on uneven per-rank batches (one rank empty at 3 ranks),
# against the unconverted model run in one process on the whole batch:
#
# - float64, free trajectories: the loss of every step of SGD with momentum and weight decay,
#   the parameters and running statistics after it, num_batches_tracked, the eval outputs, and
#   the trained state_dict loaded into the unconverted model (1e-9 relative);
# - float32, each step started from the reference's parameters and buffers (ReLU and max-pool
#   kinks make free float32 trajectories of any two implementations drift apart): gradients and
#   running statistics of every step (2e-4 of each tensor's largest value);
# - bf16 autocast against the reference under the same autocast: loss, logits, the first
#   norm's running statistics (bf16's rounding dominates the gradients of a fresh model);
# - torch.compile: no graph break in the converted model, and a compiled step as the eager one;
# - MMEngine's registry building tpnorm's layer for an MMDetection "SyncBN" config.
#
# At 32x32 the last stage's activations are [N, 512, 1, 1], whose strides fit both memory
# formats; under channels-last a convolution leaves the empty rank's batch NCHW.
# Runs at 2 and 3 ranks; needs torchvision, timm and mmengine (the PyPI-torch venv of the suite
# has them: TPNORM_EXPECT_VISION=1 makes their absence a failure instead of a skip).
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tpnorm
from support import WORLD, agree, full

_EXPECT = os.environ.get("TPNORM_EXPECT_VISION") == "1"
try:
    import mmengine  # noqa: F401
    import timm
    import torchvision
except ImportError as e:  # Debian's torch has none of them
    if _EXPECT:
        raise
    pytest.skip(f"needs torchvision, timm and mmengine ({e})", allow_module_level=True)

if WORLD.size not in (2, 3):
    pytest.skip("runs at 2 and 3 ranks", allow_module_level=True)

SIZES = {2: [4, 1], 3: [3, 0, 2]}[WORLD.size]
N = sum(SIZES)
CLASSES = 10


def resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=CLASSES)


def mobilenetv3():
    torch.manual_seed(0)
    return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=CLASSES)


def mine(t):
    lo = sum(SIZES[:WORLD.rank])
    return t[lo:lo + SIZES[WORLD.rank]]


def rel(got, want, floor=0.0):
    """max |got - want| / max(max |want|, floor) over the tensor (0 when both are empty). The
    floor keeps a tensor that is zero in exact arithmetic (the bias gradient of a BatchNorm
    whose output feeds another BatchNorm, the running mean of a convolution of a normalised
    input) from being judged by its rounding noise alone."""
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(max(floor, 1e-30)))


def largest(tensors):
    return max(float(t.detach().abs().max()) for t in tensors if t.numel())


def converted(model, fmt):
    net = tpnorm.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model), dist.group.WORLD)
    return net.to(memory_format=fmt)


def ddp(net):
    # DDP averages gradients over the ranks: the local losses below are scaled by P so that the
    # averaged gradient is the whole batch's.
    return DDP(net, process_group=dist.group.WORLD, broadcast_buffers=False)


def batch(step, size, dtype, fmt):
    X = full(300 + step, N, 3, size, size, dtype=dtype)
    labels = torch.arange(N).add(step) % CLASSES
    return X.to(memory_format=fmt), labels


def local_loss(model, X, labels, fmt):
    out = model(mine(X).contiguous(memory_format=fmt))
    return torch.nn.functional.cross_entropy(out, mine(labels), reduction="sum") / N * WORLD.size


def whole_loss(model, X, labels):
    return torch.nn.functional.cross_entropy(model(X), labels, reduction="sum") / N


def verdict(report):
    ok, lines = agree(not report, report)
    assert ok, lines


FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("model_fn,size,norms", [(resnet18, 32, 20), (resnet18, 64, 20),
                                                 (mobilenetv3, 32, 34)],
                         ids=["resnet18-32", "resnet18-64", "mobilenetv3-32"])
def test_float64_training_matches_the_whole_batch(model_fn, size, norms, fmt):
    fmt = FORMATS[fmt]
    ref = model_fn().double().to(memory_format=fmt)
    net = converted(ref, fmt)
    kinds = [m for m in net.modules() if isinstance(m, tpnorm.SyncBatchNorm)]
    report = [] if len(kinds) == norms else [f"{len(kinds)} layers converted, want {norms}"]
    model = ddp(net)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    for step in range(3):
        X, labels = batch(step, size, torch.float64, fmt)
        opt_ref.zero_grad()
        loss_ref = whole_loss(ref, X, labels)
        loss_ref.backward()
        opt_ref.step()
        opt.zero_grad()
        loss = local_loss(model, X, labels, fmt)
        loss.backward()
        opt.step()
        total = loss.detach() / WORLD.size
        dist.all_reduce(total)
        if rel(total, loss_ref) > 1e-9:
            report.append(f"step {step}: loss {float(total)!r} vs {float(loss_ref)!r}")
    sd, sd_ref = net.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        tol = 0 if k.endswith("num_batches_tracked") else 1e-9
        if rel(sd[k], v, 1.0) > tol:  # parameters and statistics of order 1
            report.append(f"{k}: {rel(sd[k], v, 1.0):.3g} relative")
    net.eval(), ref.eval()
    X, _ = batch(9, size, torch.float64, fmt)
    with torch.no_grad():
        if rel(net(X), ref(X)) > 1e-8:  # the parameters' differences, amplified by the net
            report.append(f"eval outputs: {rel(net(X), ref(X)):.3g} relative")
        plain = model_fn().double().to(memory_format=fmt)
        plain.load_state_dict(sd)
        d = rel(plain.eval()(X), net(X))
        if d > 1e-12:
            report.append(f"the trained state_dict in the unconverted model: eval outputs "
                          f"{d:.3g} relative from the converted model's")
    verdict(report)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("model_fn", [resnet18, mobilenetv3], ids=["resnet18", "mobilenetv3"])
def test_float32_steps_from_the_reference_parameters(model_fn, fmt):
    fmt = FORMATS[fmt]
    ref = model_fn().to(memory_format=fmt)
    net = converted(ref, fmt)
    model = ddp(net)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    report = []
    for step in range(3):
        net.load_state_dict(ref.state_dict())
        X, labels = batch(step, 32, torch.float32, fmt)
        opt_ref.zero_grad()
        whole_loss(ref, X, labels).backward()
        model.zero_grad()
        local_loss(model, X, labels, fmt).backward()
        grads = dict(net.named_parameters())
        floor = 1e-2 * largest(p.grad for p in ref.parameters())
        for k, p in ref.named_parameters():
            if rel(grads[k].grad, p.grad, floor) > 2e-4:
                report.append(f"step {step}: grad {k}: {rel(grads[k].grad, p.grad, floor):.3g}")
        bufs = dict(net.named_buffers())
        for k, b in ref.named_buffers():
            if rel(bufs[k], b, 1.0) > 2e-4 * (0 if k.endswith("num_batches_tracked") else 1):
                report.append(f"step {step}: buffer {k}: {rel(bufs[k], b, 1.0):.3g}")
        opt_ref.step()
    verdict(report[:20])


def test_bf16_autocast_matches_the_reference_under_autocast():
    """Under bf16 autocast the gradients of a freshly initialised ResNet-18 are dominated by
    bf16's rounding (the reference under autocast is 0.47 from itself in float32, 2-norm
    relative), so what is compared is what bf16 leaves comparable: the loss, the logits, and the
    first BatchNorm's running statistics (whose input, conv1's bf16 output, is the same bits in
    both); plus the dtypes autocast gives and finite gradients."""
    ref = resnet18().to(memory_format=torch.channels_last)
    net = converted(ref, torch.channels_last)
    model = ddp(net)
    dtypes = []
    net.bn1.register_forward_hook(lambda m, i, o: dtypes.append((i[0].dtype, o.dtype)))
    X, labels = batch(0, 32, torch.float32, torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(X)
        loss_ref = torch.nn.functional.cross_entropy(out_ref, labels, reduction="sum") / N
        out = model(mine(X).contiguous(memory_format=torch.channels_last))
        loss = torch.nn.functional.cross_entropy(out, mine(labels), reduction="sum") / N
    (loss * WORLD.size).backward()
    loss_ref.backward()
    total = loss.detach().float()
    dist.all_reduce(total)
    report = []
    if rel(total, loss_ref) > 1e-2:
        report.append(f"loss {float(total)} vs {float(loss_ref)}")
    if rel(out, mine(out_ref)) > 0.15:  # bf16 logits: 0.07 measured
        report.append(f"logits {rel(out, mine(out_ref)):.3g} relative")
    if dtypes != [(torch.bfloat16, torch.bfloat16)] or net.bn1.weight.grad.dtype != torch.float32:
        report.append(f"dtypes: bn1 (in, out) {dtypes}, weight grad {net.bn1.weight.grad.dtype}")
    if not all(bool(p.grad.isfinite().all()) for p in net.parameters()):
        report.append("a gradient is not finite")
    for k in ("running_mean", "running_var"):
        d = rel(getattr(net.bn1, k), getattr(ref.bn1, k), 1.0)
        if d > 1e-4:
            report.append(f"bn1.{k}: {d:.3g}")
    verdict(report)


def test_compiled_model_has_no_graph_break_and_steps_as_eager():
    torch._dynamo.reset()
    ref = resnet18()
    net = converted(ref, torch.contiguous_format)
    X, labels = batch(0, 32, torch.float32, torch.contiguous_format)
    x = mine(X).contiguous()
    eager, compiled = copy.deepcopy(net), copy.deepcopy(net)
    explained = torch._dynamo.explain(net)(x)
    report = [] if explained.graph_break_count == 0 else [
        f"{explained.graph_break_count} graph breaks: "
        f"{[str(b.reason)[:200] for b in explained.break_reasons]}"]
    fn = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for m, f in ((eager, eager), (compiled, fn)):
        loss = torch.nn.functional.cross_entropy(f(x), mine(labels), reduction="sum")
        loss.backward()
    for (k, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if rel(q.grad, p.grad) > 1e-5:
            report.append(f"compiled grad {k}: {rel(q.grad, p.grad):.3g}")
    for (k, b), c in zip(eager.named_buffers(), compiled.buffers()):
        if rel(c, b) > 1e-6:
            report.append(f"compiled buffer {k}: {rel(c, b):.3g}")
    verdict(report[:20])


def test_mmengine_registry_builds_tpnorm_for_syncbn_configs():
    """An MMDetection config's norm_cfg=dict(type='SyncBN') is built from MMEngine's MODELS
    registry: registered there, tpnorm's layer is what such a config builds (with the arguments
    MMCV passes), and it normalises over the whole batch."""
    from mmengine.registry import MODELS

    MODELS.register_module("SyncBN", module=tpnorm.SyncBatchNorm, force=True)
    layer = MODELS.build(dict(type="SyncBN", num_features=8, eps=1e-3, momentum=0.03))
    report = [] if type(layer) is tpnorm.SyncBatchNorm else [f"built {type(layer)}"]
    ref = torch.nn.BatchNorm2d(8, eps=1e-3, momentum=0.03, dtype=torch.float64)
    layer = layer.double()
    X = full(310, N, 8, 3, 3, shift=0.5, dtype=torch.float64)
    y = layer(mine(X))
    want = mine(ref(X))
    if rel(y, want) > 1e-12 or rel(layer.running_var, ref.running_var) > 1e-12:
        report.append(f"y {rel(y, want):.3g}, running_var "
                      f"{rel(layer.running_var, ref.running_var):.3g} relative")
    verdict(report)
