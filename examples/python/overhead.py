"""What the Python layer costs per call: a small LayerNorm on CPU (one process, the
single-process communicator, one thread) from Python vs the same call made from C++ on the
same tensors (tpnorm._tpnorm.bench_layer_norm_loop). A measurement, not a test.

    PYTHONPATH=build/python OMP_NUM_THREADS=1 /usr/bin/python3 examples/python/overhead.py

Prints the median of 5 blocks of --iters calls, microseconds per call, for:
  C++ loop              layer_norm_forward (and _backward) called from C++
  binding               tpnorm._tpnorm.layer_norm_forward from Python (DLPack + pybind11)
  functional, no grad   tpnorm.layer_norm under torch.no_grad() (allocates y, mean, rstd)
  autograd fwd+bwd      y = tpnorm.layer_norm(x, w, b); y.backward(dy) through torch.autograd
  torch F.layer_norm    the same through PyTorch's own layer, for scale
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as TF

import tpnorm
from tpnorm import _tpnorm as _C


def per_call(fn, iters):
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        blocks.append((time.perf_counter() - t0) / iters)
    return statistics.median(blocks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    comm = tpnorm.single()
    comm.set_strict_calls(0)  # the steady state: no header pre-check collective
    opt = tpnorm.functional.norm_options(1e-5, num_threads=1)
    x = torch.randn(a.rows, a.hidden)
    w, b = torch.randn(a.hidden), torch.randn(a.hidden)
    y, dx, dy = torch.empty_like(x), torch.empty_like(x), torch.randn_like(x)
    mean, rstd = torch.empty(a.rows), torch.empty(a.rows)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    cpp_f = _C.bench_layer_norm_loop(comm, x, w, b, y, mean, rstd, dy, dx, dw, db, opt, a.iters,
                                     False)
    cpp_fb = _C.bench_layer_norm_loop(comm, x, w, b, y, mean, rstd, dy, dx, dw, db, opt,
                                      a.iters, True)
    binding = per_call(lambda: _C.layer_norm_forward(comm, x, w, b, y, mean, rstd, opt), a.iters)

    def functional():
        with torch.no_grad():
            tpnorm.layer_norm(x, a.hidden, w, b, process_group=comm)

    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()

    def autograd():
        tpnorm.layer_norm(xg, a.hidden, wg, bg, process_group=comm).backward(dy)

    def torch_fb():
        TF.layer_norm(xg, (a.hidden,), wg, bg).backward(dy)

    rows = [("C++ loop, forward", cpp_f), ("binding, forward", binding),
            ("functional, no grad", per_call(functional, a.iters)),
            ("C++ loop, fwd+bwd", cpp_fb), ("autograd fwd+bwd", per_call(autograd, a.iters)),
            ("torch F.layer_norm fwd+bwd", per_call(torch_fb, a.iters))]
    print(f"# LayerNorm [{a.rows}, {a.hidden}] fp32, 1 process, 1 thread; median of 5 blocks "
          f"of {a.iters} calls (us per call)")
    for name, t in rows:
        print(f"{name:28s} {t * 1e6:8.2f}")
    print(f"# Python overhead per call: binding {(binding - cpp_f) * 1e6:.2f} us, functional "
          f"{(rows[2][1] - cpp_f) * 1e6:.2f} us, autograd fwd+bwd "
          f"{(rows[4][1] - cpp_fb) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
