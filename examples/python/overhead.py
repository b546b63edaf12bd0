"""What the Python layer costs per call: LayerNorm on CPU (one process, the single-process
communicator, one thread) from Python vs the same call made from C++ on the same tensors
(tpnorm._tpnorm.bench_layer_norm_loop), and vs torch's own nn.LayerNorm in the same process.
A measurement, not a test.

    PYTHONPATH=build/python OMP_NUM_THREADS=1 /usr/bin/python3 examples/python/overhead.py
    OMP_NUM_THREADS=1 .venv-torch/bin/python examples/python/overhead.py   # the PyPI torch

At large shapes the module's forward and backward write fresh tensors (autograd needs new
outputs) while the C++ loop reuses its own: under glibc's default malloc a large tensor is
often mapped afresh (and unmapped when freed), so each of its pages faults on first touch. A
setting that keeps freed memory for reuse shows the Python layer's own cost (torch on CPU is
often run with jemalloc or tcmalloc for the same reason):

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296 \
        OMP_NUM_THREADS=1 .venv-torch/bin/python examples/python/overhead.py

For each shape (default 4x64 and 4096x1024) prints the median of 5 blocks of calls,
microseconds per call, for:
  C++ loop              layer_norm_forward (and _backward) called from C++ on the same outputs
  binding, fresh        forward and backward through the binding on outputs allocated afresh
                        each call, as autograd's are (no autograd, no Python layer)
  binding               tpnorm._tpnorm.layer_norm_forward from Python (DLPack + pybind11)
  functional, no grad   tpnorm.layer_norm under torch.no_grad() (allocates y, mean, rstd)
  module fwd+bwd        y = ShardedLayerNorm(x); y.backward(dy) through torch.autograd (the
                        C++ autograd function of tpnorm._autograd, or the Python Function
                        where it is not built: the header says which)
  nn.LayerNorm fwd+bwd  the same through torch.nn.LayerNorm
  empty Function        a Python torch.autograd.Function that only allocates its outputs:
                        the fixed cost of autograd written in Python, the fallback's floor
Each fwd+bwd clears the gradients first (set to None, as optimizer.zero_grad() does).
and the two ratios: module / nn.LayerNorm and module / C++ loop (forward + backward).
"""
import argparse
import statistics
import time

import torch

import tpnorm
from tpnorm import _tpnorm as _C


def per_call(fn, iters):
    for _ in range(max(1, iters // 10)):  # warm up: allocator, autograd graph caches
        fn()
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        blocks.append((time.perf_counter() - t0) / iters)
    return statistics.median(blocks)


def measure(rows, hidden, iters):
    comm = tpnorm.single()
    comm.set_strict_calls(0)  # the steady state: no header pre-check collective
    opt = tpnorm.functional.norm_options(1e-5, hidden_size=hidden, num_threads=1)
    x = torch.randn(rows, hidden)
    w, b = torch.randn(hidden), torch.randn(hidden)
    y, dx, dy = torch.empty_like(x), torch.empty_like(x), torch.randn_like(x)
    mean, rstd = torch.empty(rows), torch.empty(rows)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    cpp_f = _C.bench_layer_norm_loop(comm, x, w, b, y, mean, rstd, dy, dx, dw, db, opt, iters,
                                     False)
    cpp_fb = _C.bench_layer_norm_loop(comm, x, w, b, y, mean, rstd, dy, dx, dw, db, opt, iters,
                                      True)
    binding = per_call(lambda: _C.layer_norm_forward(comm, x, w, b, y, mean, rstd, opt), iters)

    def fresh():
        # The binding's forward and backward on outputs allocated afresh, as autograd's are:
        # what the module costs without autograd and without its Python layer.
        yf, mf, rf = torch.empty_like(x), torch.empty(rows), torch.empty(rows)
        _C.layer_norm_forward(comm, x, w, b, yf, mf, rf, opt)
        dxf, dwf, dbf = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
        _C.layer_norm_backward(comm, dy, x, w, mf, rf, dxf, dwf, dbf, opt)

    def functional():
        with torch.no_grad():
            tpnorm.layer_norm(x, hidden, w, b, process_group=comm)

    ours = tpnorm.ShardedLayerNorm(hidden, process_group=comm)
    theirs = torch.nn.LayerNorm(hidden)
    with torch.no_grad():
        for m in (ours, theirs):
            m.weight.copy_(w)
            m.bias.copy_(b)
    xg = x.clone().requires_grad_()

    def step(m):
        # As a training step: gradients cleared the way optimizer.zero_grad() does (set to
        # None), so backward hands dx to x.grad rather than adding it to the last step's.
        def run():
            xg.grad = m.weight.grad = m.bias.grad = None
            m(xg).backward(dy)
        return run

    class Empty(torch.autograd.Function):
        """A Python autograd Function that only allocates its outputs: the floor of any op
        whose autograd is written in Python, as tpnorm's fallback is."""

        @staticmethod
        def forward(ctx, x, w, b):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty_like(w), torch.empty_like(b)

    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()

    def floor():
        xg.grad = wg.grad = bg.grad = None
        Empty.apply(xg, wg, bg).backward(dy)

    module_fb = per_call(step(ours), iters)
    torch_fb = per_call(step(theirs), iters)
    floor_fb = per_call(floor, iters)
    rows_out = [("C++ loop, forward", cpp_f), ("binding, forward", binding),
                ("functional, no grad", per_call(functional, iters)),
                ("C++ loop, fwd+bwd", cpp_fb), ("binding, fresh, fwd+bwd", per_call(fresh, iters)),
                ("module fwd+bwd", module_fb),
                ("nn.LayerNorm fwd+bwd", torch_fb), ("empty Function fwd+bwd", floor_fb)]
    path = "C++ autograd (tpnorm._autograd)" if tpnorm.functional.CPP_AUTOGRAD else \
        f"Python autograd Function ({tpnorm.functional.CPP_AUTOGRAD_REASON})"
    print(f"# LayerNorm [{rows}, {hidden}] fp32, 1 process, 1 thread, torch {torch.__version__}, "
          f"{path}; median of 5 blocks of {iters} calls (us per call)")
    for name, t in rows_out:
        print(f"{name:24s} {t * 1e6:10.2f}")
    print(f"# module fwd+bwd / nn.LayerNorm fwd+bwd = {module_fb / torch_fb:.2f}x, "
          f"module fwd+bwd / C++ loop fwd+bwd = {module_fb / cpp_fb:.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x64,4096x1024", help="ROWSxHIDDEN,...")
    ap.add_argument("--iters", type=int, default=2000, help="calls per block at 4x64; larger "
                    "shapes scale it down to about the same work")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for shape in a.shapes.split(","):
        rows, hidden = (int(v) for v in shape.split("x"))
        iters = max(10, a.iters * 256 // max(256, rows * hidden))
        measure(rows, hidden, iters)


if __name__ == "__main__":
    main()
