"""import_check.py PYTHON [--expect-cuda]: `import tpnorm` as the first import of a fresh
interpreter, and the libraries the process then maps, under the torch of PYTHON.

Each case is a fresh PYTHON process (what was imported before decides which libnccl.so.2 wins
its soname, so nothing may be imported first by accident):
  - `import torch` alone: the NCCL and CUDA runtime torch loads (none for a CPU torch);
  - `import tpnorm` first, then torch; and torch first, then tpnorm: both import, and the
    process maps at most one libnccl and one libcudart, torch's own when torch loads one;
    tpnorm alone maps exactly one libnccl when it has NCCL compiled in;
  - a copy of the package without tpnorm._autograd: the one-time word on stderr;
  - `python -m tpnorm`: the report, consistent with the process (its libnccl count, the
    TPNORM_* variable set here, the C++ autograd when TPNORM_EXPECT_CPP_AUTOGRAD=1).
--expect-cuda: the package must have the CUDA backend when torch is a CUDA build (a pip build
on a machine with nvcc).
"""
import os
import subprocess
import sys

PROBE = """
import json, os, sys
def mapped(stem):
    paths = {l.split()[-1] for l in open('/proc/self/maps') if '/' in l}
    return sorted(os.path.realpath(p) for p in paths if os.path.basename(p).startswith(stem + '.so'))
out = {}
for name in sys.argv[1:]:
    __import__(name)
    out[name] = {'nccl': mapped('libnccl'), 'cudart': mapped('libcudart')}
if 'tpnorm' in sys.modules:
    import tpnorm, torch
    out['tpnorm_nccl'] = tpnorm._C.nccl_info() is not None
    out['tpnorm_cuda'] = tpnorm._C.cuda_info() is not None
    out['torch_cuda'] = torch.version.cuda
    out['cpp_autograd'] = tpnorm.functional.CPP_AUTOGRAD
print(json.dumps(out))
"""

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def run(python, *args, env=None):
    r = subprocess.run([python, *args], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
    return r


def probe(python, *modules):
    import json
    r = run(python, "-c", PROBE, *modules)
    check(r.returncode == 0, f"import {', '.join(modules)} in a fresh interpreter")
    if r.stderr.strip():
        print(f"  stderr: {r.stderr.strip()}")
    return json.loads(r.stdout) if r.returncode == 0 else None, r.stderr


def slow_path_word(python):
    """A copy of the installed package without tpnorm._autograd's stamp (what an isolated
    build installs): the first import says once, on stderr, that the row norms take the Python
    path and how to rebuild; not on a rank other than 0, not when TPNORM_PYTHON_AUTOGRAD=1."""
    import shutil
    import tempfile
    r = run(python, "-c", "import os, tpnorm; print(os.path.dirname(tpnorm.__file__))")
    if r.returncode != 0:
        return check(False, "import tpnorm to find the package")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(r.stdout.strip(), os.path.join(tmp, "tpnorm"),
                        ignore=shutil.ignore_patterns("_autograd*", "__pycache__"))
        base = {k: v for k, v in os.environ.items()
                if k not in ("TPNORM_PYTHON_AUTOGRAD", "RANK", "OMPI_COMM_WORLD_RANK")}
        base["PYTHONPATH"] = tmp
        code = "import tpnorm, tpnorm.functional as F; assert not F.CPP_AUTOGRAD; print(F.__file__)"
        for extra, want in (({}, 1), ({"OMPI_COMM_WORLD_RANK": "1"}, 0),
                            ({"TPNORM_PYTHON_AUTOGRAD": "1"}, 0)):
            r = run(python, "-c", code, env=dict(base, **extra))
            said = r.stderr.count("slower Python autograd path")
            ok = (r.returncode == 0 and said == want and r.stdout.startswith(tmp)
                  and (want == 0 or "--no-build-isolation" in r.stderr))
            check(ok, f"without tpnorm._autograd, env {extra or 'plain'}: the word said {said} "
                      f"time(s), want {want}")
            if not ok:
                print(r.stdout + r.stderr)


def main():
    python = sys.argv[1]
    expect_cuda = "--expect-cuda" in sys.argv[2:]
    expect_autograd = os.environ.get("TPNORM_EXPECT_CPP_AUTOGRAD") == "1"
    torch_only, _ = probe(python, "torch")
    if torch_only is None:
        sys.exit(f"{python} cannot import torch")
    want = torch_only["torch"]
    print(f"torch alone maps: {want}")

    first, stderr = probe(python, "tpnorm", "torch")
    if first is not None:
        print(f"tpnorm first maps: {first['tpnorm']}, then with torch: {first['torch']}")
        for lib in ("nccl", "cudart"):
            got = first["torch"][lib]
            check(len(got) <= 1, f"tpnorm first, then torch: one lib{lib} at most ({got})")
            if want[lib]:
                check(got == want[lib], f"tpnorm first: lib{lib} is torch's own ({want[lib]})")
        if first["tpnorm_nccl"]:
            check(len(first["tpnorm"]["nccl"]) == 1,
                  f"tpnorm alone maps its one libnccl ({first['tpnorm']['nccl']})")
        if expect_cuda and first["torch_cuda"]:
            check(first["tpnorm_cuda"] and first["tpnorm_nccl"],
                  f"CUDA torch ({first['torch_cuda']}) and nvcc: the package has CUDA and NCCL")
        if expect_autograd:
            check(first["cpp_autograd"], "tpnorm._autograd active")
            check("slower Python autograd" not in stderr, "no slow-path message on import")
    after, _ = probe(python, "torch", "tpnorm")
    if after is not None:
        got = after["tpnorm"]
        for lib in ("nccl", "cudart"):
            check(len(got[lib]) <= 1 and (not want[lib] or got[lib] == want[lib]),
                  f"torch first, then tpnorm: lib{lib} {got[lib]}")

    slow_path_word(python)
    env = dict(os.environ, TPNORM_TIMEOUT="77")
    r = run(python, "-m", "tpnorm", env=env)
    check(r.returncode == 0, "python -m tpnorm")
    print(r.stdout)
    lines = r.stdout.splitlines()
    for head in ("tpnorm ", "torch: built against", "backends:", "MPI:", "tpnorm._autograd:",
                 "communicators:", "libnccl mapped in this process:"):
        check(any(line.startswith(head) for line in lines), f"the report has '{head}'")
    check("TPNORM_TIMEOUT=77" in r.stdout, "the report lists the TPNORM_* variables set")
    if first is not None:
        n = len(first["torch"]["nccl"])
        check(f"libnccl mapped in this process: {n}" in r.stdout,
              f"the report's libnccl count is the process's ({n})")
    if expect_autograd:
        check("tpnorm._autograd: active" in r.stdout, "the report says _autograd is active")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
