"""python -m tpnorm: what this tpnorm was built with and what the process runs with.

The report a bug report starts with (as torch's `python -m torch.utils.collect_env`): versions,
the torch built against and the one running, the backends compiled in, the NCCL, CUDA runtime
and MPI libraries actually loaded (path and version), whether the ops' C++ autograd is
active and why not, the communicators usable now, and the TPNORM_* variables set. It starts no
MPI and no process group: it only looks.
"""
import importlib.util
import os
import platform
import sys


def _mapped(stem):
    """The files named stem.so* mapped into this process (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(stem + ".so"))


def _nccl_version(code):
    """NCCL's ncclGetVersion (2.9 and later: major * 10000 + minor * 100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def _cuda_version(code):
    """cudaRuntimeGetVersion's major * 1000 + minor * 10."""
    return f"{code // 1000}.{code % 1000 // 10}"


def report():
    """The report as a list of lines."""
    import torch
    import tpnorm
    from tpnorm import _build, _C
    from tpnorm import functional as F

    b = _build
    lines = [f"tpnorm {tpnorm.__version__} ({os.path.dirname(tpnorm.__file__)})",
             f"python {platform.python_version()} ({sys.executable}), {platform.platform()}",
             f"build: {b.COMPILER}, {b.BUILD_TYPE}, TPNORM_NATIVE={b.NATIVE}, "
             f"{'pip' if b.PIP_BUILD else 'CMake'} build"]
    built = b.TORCH or "none (the build could not import torch)"
    cuda = torch.version.cuda or "none"
    same = "" if b.TORCH in ("", torch.__version__) else "  <- differs: rebuild tpnorm"
    lines.append(f"torch: built against {built}; running {torch.__version__} "
                 f"(CUDA {cuda}, GPUs visible: {torch.cuda.device_count()}){same}")
    if b.CUDA:
        lines.append(f"backends: CPU, CUDA (architectures {b.CUDA_ARCHITECTURES}, nvcc {b.NVCC})")
    else:
        lines.append("backends: CPU only")
    if b.NOTES:
        lines.append(f"build notes: {b.NOTES}")
    nccl = _C.nccl_info()
    if nccl is None:
        lines.append("NCCL: not compiled in")
    else:
        lines.append(f"NCCL: built with {b.NCCL} ({b.NCCL_LIBRARY}); running "
                     f"{_nccl_version(nccl['version'])} ({nccl['path']})")
    mapped = _mapped("libnccl")
    lines.append(f"libnccl mapped in this process: {len(mapped)}"
                 + "".join(f"\n  {p}" for p in mapped))
    cu = _C.cuda_info()
    if cu is not None:
        dev = cu["devices"] if not cu["device_error"] else f"none ({cu['device_error']})"
        lines.append(f"CUDA runtime: {_cuda_version(cu['runtime'])} ({cu['path']}); devices: {dev}")
    mpi = _C.mpi_info()
    lines.append(f"MPI: {mpi['version'].strip().splitlines()[0]} ({mpi['path']})")
    lines.append(f"MPI at build: {b.MPI}")
    if F.CPP_AUTOGRAD:
        lines.append("tpnorm._autograd: active (every op's C++ autograd)")
    else:
        lines.append(f"tpnorm._autograd: not active: {F.CPP_AUTOGRAD_REASON}")
    lines.append("communicators: " + "; ".join(_communicators(torch, nccl is not None)))
    env = sorted(k for k in os.environ if k.startswith("TPNORM_"))
    lines.append("TPNORM_* set: " + (", ".join(f"{k}={os.environ[k]}" for k in env) or "none"))
    return lines


def _communicators(torch, has_nccl):
    """What `process_group=` can be in this process, without starting anything."""
    out = ["one process (tpnorm.single())"]
    if importlib.util.find_spec("mpi4py") is not None:
        import importlib.metadata as md
        out.append(f"mpi4py {md.version('mpi4py')} (under mpirun)")
    else:
        out.append("mpi4py: not installed (pip install mpi4py, for mpirun jobs)")
    dist = torch.distributed
    if dist.is_available():
        kinds = [k for k, ok in (("gloo", dist.is_gloo_available()),
                                 ("nccl", dist.is_nccl_available()),
                                 ("mpi", dist.is_mpi_available())) if ok]
        state = (f"initialized, backend {dist.get_backend()}, world {dist.get_world_size()}"
                 if dist.is_initialized() else "not initialized")
        out.append(f"torch.distributed ({'/'.join(kinds)}; {state})")
    else:
        out.append("torch.distributed: not available in this torch")
    if has_nccl:
        gpus = torch.cuda.device_count()
        out.append(f"tpnorm NCCL over an NCCL group ({gpus} GPU{'s' * (gpus != 1)} visible)")
    return out


if __name__ == "__main__":
    print("\n".join(report()))
