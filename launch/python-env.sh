#!/usr/bin/env bash
# The second Python environment of the test suite: the current torch from PyPI, as users run it,
# next to Debian's python3-torch. A venv of /usr/bin/python3 (made once, reused) holding the
# pinned torch, the model libraries (torchvision, timm, mmengine, transformers, accelerate,
# OLMo-core), mpi4py, pytest and the package's build requirements; tpnorm goes into it with
# `pip install`, the user's route.
#
#   launch/python-env.sh ensure              make the venv if it is missing or holds another
#                                            torch; prints its python
#   launch/python-env.sh python              prints its python (empty when there is none)
#   launch/python-env.sh install BUILD_DIR   pip install . into it (CMake's build kept in
#                                            BUILD_DIR/torch-wheel-cpu, so a rebuild is incremental)
#
# Environment: TPNORM_TORCH_VENV (default: .venv-torch at the repository root).
set -euo pipefail

# The one place the PyPI torch is pinned, with the model libraries the suite runs tpnorm
# inside (their releases that go with this torch; mmengine for its registry; transformers for
# HF's own modeling code of OLMo 2, OLMoE, FlexOlmo and MiniMax-M2, and accelerate, which its
# from_pretrained needs for a tensor-parallel plan).
TORCH_VERSION=2.15.0
MODEL_LIBS=(torchvision==0.29.2 timm==1.0.31 mmengine==0.10.7 transformers==5.25.0
            accelerate==1.16.0)
# OLMo-core (AllenAI's training stack) declares torch < 2.14, so pip would replace the torch
# above; its code runs under this one, so it goes in without its declared dependencies and
# they follow, pinned, torch left out. cached-path (its file reader) goes in the same way: it
# declares huggingface-hub < 2, which transformers above outgrows, and imports boto3 and
# google-cloud-storage at import time, which come with theirs (docs/install.md).
OLMO_CORE=(ai2-olmo-core==3.0.0 cached-path==1.8.10)
OLMO_CORE_DEPS=(dataclass-extensions==0.5.0 importlib-resources==7.1.0 bettermap==1.3.1
                pandas==3.1.1 requests==2.34.2 boto3==1.44.5 google-cloud-storage==3.17.1)
PINS="torch==$TORCH_VERSION ${MODEL_LIBS[*]} ${OLMO_CORE[*]}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TPNORM_TORCH_VENV:-$ROOT/.venv-torch}"
VPY="$VENV/bin/python"
STAMP="$VENV/tpnorm-torch-version"

log() { printf '[python-env] %s\n' "$*" >&2; }
die() { printf '[python-env] error: %s\n' "$*" >&2; exit 1; }

# The pinned torch and the model libraries (OLMo-core as said above).
model_libs() {
  local pip=("$VPY" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "torch==$TORCH_VERSION" "${MODEL_LIBS[@]}" >&2
  "${pip[@]}" install --no-deps "${OLMO_CORE[@]}" >&2
  "${pip[@]}" install "${OLMO_CORE_DEPS[@]}" >&2
}

ensure() {
  local stamp
  stamp="$(cat "$STAMP" 2>/dev/null || true)"
  if [ -x "$VPY" ] && [ "$stamp" = "$PINS" ]; then
    echo "$VPY"
    return 0
  fi
  if [ -x "$VPY" ] && { [ "${stamp%% *}" = "torch==$TORCH_VERSION" ] ||
                        [ "$stamp" = "$TORCH_VERSION" ]; }; then
    # the pinned torch, other model libraries: add (or change) those
    log "adding ${MODEL_LIBS[*]} ${OLMO_CORE[*]} to $VENV"
    model_libs
    echo "$PINS" >"$STAMP"
    echo "$VPY"
    return 0
  fi
  [ -x /usr/bin/python3 ] || die "/usr/bin/python3 is missing"
  if ! /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
    [ "$(id -u)" -eq 0 ] || die "the venv needs python3-venv (e.g. sudo apt-get install python3-venv)"
    log "installing: python3-venv"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  log "making $VENV with torch==$TORCH_VERSION from PyPI (a download of about 3 GB the first time)"
  rm -rf "$VENV"
  /usr/bin/python3 -m venv "$VENV"
  local pip=("$VPY" -m pip --disable-pip-version-check -q)
  model_libs
  # mpi4py builds against the system MPI (libopenmpi-dev) when PyPI has no wheel for it.
  "${pip[@]}" install mpi4py pytest numpy "scikit-build-core>=0.8" "pybind11>=2.10" >&2
  echo "$PINS" >"$STAMP"
  echo "$VPY"
}

install_package() {
  local build_dir="${1:?usage: python-env.sh install BUILD_DIR}"
  [ -x "$VPY" ] || die "no venv at $VENV (run: launch/python-env.sh ensure)"
  # Its own CMake directory: the suite's pip route (tests/python/pip_route.sh) keeps
  # BUILD_DIR/torch-wheel with CUDA on where nvcc is, and a cached TPNORM_CUDA=OFF would leak.
  local defs=(--config-settings="build-dir=$build_dir/torch-wheel-cpu"
              --config-settings=cmake.define.TPNORM_CUDA=OFF)
  if command -v ccache >/dev/null; then
    defs+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
           --config-settings=cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache)
  fi
  # The build requirements are in the venv already: no network for a rebuild.
  "$VPY" -m pip --disable-pip-version-check -q install --no-build-isolation --no-deps \
    "${defs[@]}" "$ROOT"
}

case "${1:-}" in
  ensure) ensure ;;
  python) [ -x "$VPY" ] && echo "$VPY" || true ;;
  install) shift; install_package "$@" ;;
  -h|--help|help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
  *) die "usage: python-env.sh ensure | python | install BUILD_DIR" ;;
esac
