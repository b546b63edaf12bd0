"""PyTorch's CPU normalization ops on the problems of the peers table (bench/cpu/peers.h), timed
for bench/cpu/peers.py. Run by each torch the table has; it imports torch and calls nothing else.

  python peers_torch.py --ref DIR --threads 1,2 --repetitions R --min-time S --out FILE.json

DIR is what `tpnorm_micro --peers_ref=DIR` wrote: tpnorm's result on each problem (manifest.txt).
Inputs are made here as tpnorm_micro makes them (peers.h), so both libraries see the same floats.
The ops (torch's own kernels, the ones its nn modules call on CPU):
  LayerNorm  aten.native_layer_norm / aten.native_layer_norm_backward
  RMSNorm    torch.rms_norm (torch >= 2.4; on CPU a composite of several ops, no fused kernel),
             its backward by autograd on the recorded graph (retain_graph), as training runs it;
             aten._fused_rms_norm_backward is used instead where it has a CPU kernel
  SyncBN     aten.native_batch_norm (training=True, running statistics on) /
             aten.native_batch_norm_backward; NHWC: the same tensor as channels_last
An op's out= overload is used where it has a CPU kernel of its own (not the generated one that
computes into a new tensor and copies); otherwise each call allocates its outputs (noted in the
JSON). Before an op is timed at a thread count, its outputs are checked against tpnorm's (the
sampled runs and the per-row / per-channel outputs in full): max |torch - tpnorm| <=
tol * max(1, max |tpnorm|), tol from the manifest. Clocks as tpnorm_micro's: one thread by the
thread's CPU time, more by the wall clock. The JSON holds, per benchmark named as
tpnorm_micro's peers ("peer/LIB/OP/PASS/SHAPE/threads:T"), the GB/s of each repetition (bytes =
the op's minimum traffic), or why it was not timed, and the check's error if any.
"""
import argparse
import json
import os
import random
import sys
import time

import torch

aten = torch.ops.aten


def parse_manifest(ref):
    problems, tol, eps = {}, 4e-3, 1e-5
    with open(os.path.join(ref, "manifest.txt")) as f:
        for line in f:
            if line.startswith("#"):
                for w in line.split():
                    if w.startswith("eps="):
                        eps = float(w[4:])
                    if w.startswith("tol="):
                        tol = float(w[4:])
                continue
            key, layout, name, fname, n, sampled = line.split()
            op, pas, shape = key.split("/")
            p = problems.setdefault(key, {"op": op, "pass": pas, "shape": shape, "layout": layout,
                                          "dims": [int(d) for d in shape.split("x")], "ref": {}})
            runs, length = (int(v) for v in sampled.split(",")) if sampled != "0" else (0, 0)
            p["ref"][name] = (os.path.join(ref, fname), int(n), runs, length)
    return list(problems.values()), tol, eps


def load_ref(entry):
    path, n, runs, length = entry
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    return data, n, runs, length


def sample(t, n, runs, length):
    """The values of t (flat, memory order) that tpnorm_micro wrote for an output of n values."""
    flat = t.reshape(-1)
    assert flat.numel() == n, (flat.numel(), n)
    if runs == 0:
        return flat
    return torch.cat([flat[i * (n - length) // (runs - 1):][:length] for i in range(runs)])


def compare(name, got, entry, tol):
    ref, n, runs, length = load_ref(entry)
    g = sample(got.detach().float(), n, runs, length)
    scale = max(1.0, float(ref.abs().max()))
    d = (g - ref).abs()
    d[torch.isnan(d)] = float("inf")
    worst = float(d.max())
    if worst <= tol * scale:
        return ""
    at = int(d.argmax())
    return "%s: max |peer - tpnorm| = %.3g at sample [%d] (peer %.6g, tpnorm %.6g), tolerance %.3g" % (
        name, worst, at, float(g[at]), float(ref[at]), tol * scale)


def inputs(p):
    n = 1
    for d in p["dims"]:
        n *= d
    # fill_inputs (micro.h): x[i] = 3 + ((37 i) & 1023) * 1e-3, dy[i] = ((11 i) & 511) * 1e-3 - 1/4
    # in float32; both repeat every 1024 values (every shape here is a multiple of 1024).
    assert n % 1024 == 0
    i = torch.arange(1024, dtype=torch.int64)
    x = (3.0 + ((i * 37) & 1023).to(torch.float32) * 1e-3).repeat(n // 1024)
    dy = (((i * 11) & 511).to(torch.float32) * 1e-3 - 0.25).repeat(n // 1024)
    c = p["dims"][-1] if p["layout"] != "NCHW" else p["dims"][1]
    j = torch.arange(c, dtype=torch.int64)
    gamma = 1.0 + ((j * 7) & 15).to(torch.float32) / 32.0
    beta = ((j * 5) & 7).to(torch.float32) / 8.0 - 0.5
    x, dy = x.reshape(p["dims"]), dy.reshape(p["dims"])
    if p["op"] == "SyncBN" and p["layout"] == "NHWC":  # logical NCHW over NHWC memory
        x, dy = x.permute(0, 3, 1, 2), dy.permute(0, 3, 1, 2)
        assert x.is_contiguous(memory_format=torch.channels_last)
    return x, dy, gamma, beta


def has_cpu_kernel(name):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    except Exception:
        return False


def memory_order(t, layout):
    """t's values in memory order (NHWC for channels_last), as tpnorm's buffers hold them."""
    return t.permute(0, 2, 3, 1) if layout == "NHWC" and t.dim() == 4 else t


class Case:
    """One problem's tensors and its call; `check()` compares one call's outputs with tpnorm's."""

    def __init__(self, p, tol, eps):
        self.p, self.tol, self.eps = p, tol, eps
        self.note = ""
        op, bwd = p["op"], p["pass"] == "backward"
        x, dy, w, b = inputs(p)
        ref = p["ref"]
        if op == "LayerNorm":
            h = [p["dims"][1]]
            if not bwd:
                self.note = "allocates its outputs per call (no out= CPU kernel)"
                self.call = lambda: aten.native_layer_norm(x, h, w, b, eps)
                self.names = ["y", "mean", "rstd"]
            else:
                mean = load_ref(ref["mean"])[0].reshape(-1, 1)
                rstd = load_ref(ref["rstd"])[0].reshape(-1, 1)
                self.note = "allocates its outputs per call (no out= CPU kernel)"
                self.call = lambda: aten.native_layer_norm_backward(
                    dy, x, h, mean, rstd, w, b, [True, True, True])
                self.names = ["dx", "dgamma", "dbeta"]
        elif op == "RMSNorm":
            if not hasattr(torch, "rms_norm"):
                raise NotImplementedError("n/a: torch %s has no rms_norm (torch >= 2.4)"
                                          % torch.__version__.split("+")[0])
            h = [p["dims"][1]]
            if not bwd:
                self.note = "torch.rms_norm: a composite of several ops on CPU, allocates per call"
                self.call = lambda: (torch.rms_norm(x, h, w, eps),)
                self.names = ["y"]
            elif has_cpu_kernel("aten::_fused_rms_norm_backward"):
                rstd = load_ref(ref["rstd"])[0].reshape(-1, 1)
                self.note = "aten._fused_rms_norm_backward"
                self.call = lambda: aten._fused_rms_norm_backward(dy, x, h, rstd, w, [True, True])
                self.names = ["dx", "dgamma"]
            else:
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = torch.rms_norm(xg, h, wg, eps)
                self.note = ("autograd of torch.rms_norm (no fused CPU backward), allocates per "
                             "call")
                self.call = lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
                self.names = ["dx", "dgamma"]
        else:
            c = w.numel()
            rm, rv = torch.zeros(c), torch.ones(c)
            if not bwd:
                if has_cpu_kernel("aten::native_batch_norm.out"):
                    out = torch.empty_like(x)  # channels_last when x is
                    sm, si = torch.empty(c), torch.empty(c)
                    self.note = "out= (preallocated outputs)"
                    self.call = lambda: aten.native_batch_norm.out(
                        x, w, b, rm, rv, True, 0.1, eps, out=out, save_mean=sm, save_invstd=si)
                else:
                    self.note = "allocates its outputs per call (no out= CPU kernel)"
                    self.call = lambda: aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, eps)
                self.names = ["y", "mean", "invstd"]
            else:
                sm = load_ref(ref["mean"])[0].clone()
                si = load_ref(ref["invstd"])[0].clone()
                self.note = "allocates its outputs per call (no out= CPU kernel)"
                self.call = lambda: aten.native_batch_norm_backward(
                    dy, x, w, rm, rv, sm, si, True, eps, [True, True, True])
                self.names = ["dx", "dgamma", "dbeta"]

    def check(self):
        outs = self.call()
        errs = []
        for name, t in zip(self.names, outs):
            e = compare(name, memory_order(t, self.p["layout"]), self.p["ref"][name], self.tol)
            if e:
                errs.append(e)
        return "; ".join(errs)


def bench_name(lib, p, t):
    return "peer/%s/%s/%s/%s/threads:%d" % (lib, p["op"], p["pass"], p["shape"], t)


def nbytes(p):
    n = 1
    for d in p["dims"]:
        n *= d
    return (3 if p["pass"] == "backward" else 2) * n * 4


def time_once(call, threads, min_time):
    clock = time.thread_time if threads == 1 else time.perf_counter
    iters, t0 = 0, clock()
    while True:
        call()
        iters += 1
        el = clock() - t0
        if el >= min_time:
            return el / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--lib", default="torch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    problems, tol, eps = parse_manifest(a.ref)
    torch.set_num_interop_threads(1)
    res = {"lib": a.lib, "torch": torch.__version__, "results": {}}
    cells = res["results"]
    # Every problem once per repetition at each thread count, problems in a random order per
    # repetition (and the thread counts in a random order), so that load from other processes
    # spreads over all of them; a problem's tensors are made once per repetition.
    rng = random.Random(a.seed)
    for rep in range(a.repetitions):
        order = problems[:]
        rng.shuffle(order)
        for p in order:
            case = None
            ts = threads[:]
            rng.shuffle(ts)
            for t in ts:
                name = bench_name(a.lib, p, t)
                cell = cells.setdefault(name, {"gbps": []})
                if "skipped" in cell:
                    continue
                torch.set_num_threads(t)
                if case is None:
                    try:
                        case = Case(p, tol, eps)
                    except NotImplementedError as e:
                        for u in threads:
                            cells.setdefault(bench_name(a.lib, p, u), {})["skipped"] = str(e)
                        break
                cell["note"] = case.note
                if "checked" not in cell:
                    err = case.check()  # also the warm-up
                    cell["checked"] = True
                    if err:
                        cell["mismatch"] = "torch's output differs from tpnorm's: " + err
                        print("error: %s: %s" % (name, cell["mismatch"]), file=sys.stderr)
                else:
                    case.call()  # warm-up
                s = time_once(case.call, t, a.min_time)
                cell["gbps"].append(nbytes(p) / s / 1e9)
            del case
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
