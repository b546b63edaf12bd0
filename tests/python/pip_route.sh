#!/usr/bin/env bash
# pip_route.sh — the README's pip route as a user runs it, in the suite's venv with the PyPI
# torch (launch/python-env.sh), and the wheel of docs/install.md installed on a "compute node"
# (a fresh venv, no source tree). The commands are taken out of README.md (its docs-test
# blocks), not restated here.
#
#   pip_route.sh install  SRC VENV BUILD WORK   README's install block in VENV, from SRC
#   pip_route.sh run      SRC VENV WORK         README's quick start under mpirun and torchrun
#   pip_route.sh wheel    SRC VENV BUILD WORK   pip wheel . -w dist/, a fresh venv, the wheel
#                                               into it, import tpnorm first, quick start at 2
#
# BUILD is CMake's build directory for pip (SKBUILD_BUILD_DIR): install and wheel share it, so
# the wheel is an incremental rebuild of the install's build. TPNORM_PIP_CUDA_ARCHS (the suite's
# CMAKE_CUDA_ARCHITECTURES, space-separated; CI: one) reaches the build through scikit-build-core's
# CMAKE_ARGS, as a user would pass it. The MPI settings of the suite's environment
# (run as root, oversubscribe) are removed: the README's own flags must be enough.
set -euo pipefail
mode="${1:?usage: pip_route.sh install|run|wheel ...}"; shift
unset OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM OMPI_MCA_rmaps_base_oversubscribe
unset PYTHONPATH
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
t0=$SECONDS
say() { printf '[pip_route %s +%ds] %s\n' "$mode" "$((SECONDS - t0))" "$*"; }
fail() { printf '[pip_route %s] FAIL: %s\n' "$mode" "$*"; exit 1; }

# extract SRC DIR: README's docs-test blocks into DIR (fresh).
extract() {
  rm -rf "$2"
  /usr/bin/python3 "$1/tests/docs/check_docs.py" "$1" --extract "$2" >/dev/null
}

# build_env BUILD: what makes the pip build fast here without changing the user's command.
build_env() {
  export SKBUILD_BUILD_DIR="$1"
  export CMAKE_ARGS=""
  [ -z "${TPNORM_PIP_CUDA_ARCHS:-}" ] ||
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=${TPNORM_PIP_CUDA_ARCHS// /;}"
  if command -v ccache >/dev/null; then
    export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache
    export CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  fi
}

# run_block FILE: each command line of an extracted sh block, echoed, stopping at a failure.
run_block() {
  local line
  while IFS= read -r line; do
    line="${line%%#*}"
    [ -n "${line// /}" ] || continue
    say "\$ $line"
    bash -c "$line" </dev/null || fail "exit $?: $line"   # mpirun would read the rest
  done <"$1"
}

case "$mode" in
  install)
    src="$1" venv="$2" build="$3" work="$4"
    extract "$src" "$work"
    [ -f "$work/pip/install.sh" ] || fail "README.md has no <!-- docs-test: pip/install.sh --> block"
    build_env "$build"
    export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"   # an activated venv
    cd "$src"
    run_block "$work/pip/install.sh" 2>&1 | tee "$work/install.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    # Progress: one line per compiled file, and the one line that says whether CUDA is on.
    n=$(grep -cE '^ *\[[0-9]+/[0-9]+\] ' "$work/install.log" || true)
    [ "$n" -gt 0 ] || fail "the install printed no build progress ([n/N] lines)"
    grep -qE 'tpnorm: CUDA backend (on|off)' "$work/install.log" ||
      fail "the install did not say whether the CUDA backend is on"
    ! grep -E '^ *\[[0-9]+/[0-9]+\] .*(tests|bench|examples)/' "$work/install.log" ||
      fail "the install built tests, benchmarks or examples"
    say "ok: $n build steps, $(grep -oE 'tpnorm: CUDA backend (on|off)[^)]*\)?' "$work/install.log" | head -1)"
    ;;
  run)
    src="$1" venv="$2" work="$3"
    extract "$src" "$work"
    [ -f "$work/quickstart/run.sh" ] || fail "README.md has no <!-- docs-test: quickstart/run.sh --> block"
    export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" OMP_NUM_THREADS=1
    cd "$work/quickstart"
    # The README's lines for this user: as root the mpirun line with its root flag, else the
    # plain one; the torchrun line always.
    if [ "$(id -u)" -eq 0 ]; then
      grep -E '^(mpirun .*--allow-run-as-root|torchrun )' run.sh >lines.sh
    else
      grep -E '^(mpirun |torchrun )' run.sh | grep -v -- --allow-run-as-root >lines.sh
    fi
    [ "$(grep -c '^mpirun' lines.sh)" -ge 1 ] && [ "$(grep -c '^torchrun' lines.sh)" -ge 1 ] ||
      fail "the README's run block lacks an mpirun or a torchrun line for this user"
    run_block lines.sh
    say "ok"
    ;;
  wheel)
    src="$1" venv="$2" build="$3" work="$4"
    rm -rf "$work"; mkdir -p "$work"
    extract "$src" "$work/readme"
    build_env "$build"
    cd "$src"
    say "pip wheel . -w dist/ (the install's build directory: incremental)"
    "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps . -w "$work/dist"
    whl=$(ls "$work"/dist/tpnorm-*.whl)
    say "built $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB)"
    unset SKBUILD_BUILD_DIR CMAKE_ARGS
    # The compute node: a fresh venv and the torch the wheel was built against, from the index
    # (pip's cache after the first time), then the wheel; run from a directory with no sources.
    torch_v=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
    /usr/bin/python3 -m venv "$work/node"
    # --no-compile: torch's thousands of .pyc would cost the test more than the rest of it; the
    # interpreter compiles what it imports.
    "$work/node/bin/pip" --disable-pip-version-check -q install --no-compile "torch==$torch_v" \
      mpi4py "$whl"
    say "installed torch $torch_v, mpi4py and the wheel into a fresh venv"
    mkdir -p "$work/run"
    cp "$here/import_check.py" "$work/readme/quickstart/quickstart.py" "$work/run/"
    cd "$work/run"
    "$work/node/bin/python" import_check.py "$work/node/bin/python" ${WHEEL_EXPECT_CUDA:-} ||
      fail "import check of the installed wheel"
    "$work/node/bin/python" - <<'EOF' || fail "tpnorm was imported from outside the fresh venv"
import os, sys, tpnorm
assert tpnorm.__file__.startswith(sys.prefix), tpnorm.__file__
print("tpnorm from", os.path.dirname(tpnorm.__file__))
EOF
    root=(); [ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
    OMP_NUM_THREADS=1 mpirun "${root[@]}" -n 2 "$work/node/bin/python" quickstart.py ||
      fail "the quick start at 2 ranks from the wheel"
    rm -rf "$work/node"   # 5 GB of torch: made afresh each run
    say "ok"
    ;;
  *) fail "unknown mode $mode" ;;
esac
