#!/usr/bin/env bash
# rehearse_gpu_check.sh — the GPU check's three commands on a machine WITHOUT a GPU, to see
# before a device run that everything up to the first CUDA call works: the plan (the items'
# time limits add up to each command's budget), the set-up, configure and build of the GPU
# targets, the host tests; every GPU item is then reported SKIP with its reason, and the
# summary and logs land in the --out directory as on the device.
#
#   launch/rehearse_gpu_check.sh [--out DIR] [--build-dir DIR] [--budget S] [--hide-system]
#
# --hide-system (root; unshare -m): hides the system's OpenMPI, PMIx, GoogleTest and nccl.h
# behind empty directories in a private mount namespace and puts a fake PyTorch NCCL wheel on
# PYTHONPATH, as on a GPU machine that lacks them; gpu-check must then use the fetched packages
# (build-gpu-deps/, from `gpu-check fetch`). This rebuilds everything against them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=/tmp/tpnorm-rehearse-out
BUILD="$ROOT/build-gpu"
BUDGET=480
HIDE=0
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) [ $# -ge 2 ] || { echo "rehearse: --out needs a value" >&2; exit 2; }; OUT="$2"; shift ;;
    --build-dir) [ $# -ge 2 ] || { echo "rehearse: --build-dir needs a value" >&2; exit 2; }; BUILD="$2"; shift ;;
    --budget) [ $# -ge 2 ] || { echo "rehearse: --budget needs a value" >&2; exit 2; }; BUDGET="$2"; shift ;;
    --hide-system) HIDE=1 ;;
    *) echo "rehearse: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
rm -rf "$OUT"
mkdir -p "$OUT"

run_all() {
  "$ROOT/launch/gpu-check" plan --budget "$BUDGET"
  local c rc=0
  for c in core sanitize extended; do
    echo "--- gpu-check $c"
    "$ROOT/launch/gpu-check" "$c" --out "$OUT" --build-dir "$BUILD" --budget "$BUDGET" || rc=1
  done
  echo "--- summary ($OUT/summary.txt; logs in $OUT/logs)"
  grep -E '^\[(PASS|FAIL|SKIP)' "$OUT/summary.txt"
  return $rc
}

if [ "$HIDE" = 0 ]; then run_all; exit $?; fi

WORK="/tmp/tpnorm-rehearse-$$"
mkdir -p "$WORK/empty" "$WORK/wheel/nvidia/nccl/lib" "$WORK/cuda-include"
touch "$WORK/wheel/nvidia/nccl/__init__.py"
printf '#!/bin/sh\nexit 127\n' > "$WORK/broken" && chmod +x "$WORK/broken"
cp -L /usr/local/cuda/lib64/libnccl.so.2 "$WORK/wheel/nvidia/nccl/lib/"
cp -a /usr/local/cuda/include/. "$WORK/cuda-include/"
rm -f "$WORK/cuda-include/nccl.h"
MA=/usr/lib/x86_64-linux-gnu
export -f run_all
export ROOT OUT BUILD BUDGET
exec unshare -m --propagation private bash -c "
  set -e
  for d in $MA/openmpi $MA/pmix2 /etc/openmpi /usr/include/gtest /usr/include/gmock \
           /usr/src/googletest /usr/src/gtest $MA/cmake/GTest; do
    [ -d \"\$d\" ] && mount --bind '$WORK/empty' \"\$d\"
  done
  mount --bind '$WORK/cuda-include' /usr/local/cuda/include
  for f in /usr/bin/opal_wrapper /usr/bin/orterun; do
    [ -f \"\$f\" ] && mount --bind '$WORK/broken' \"\$f\"
  done
  echo '[rehearse] hidden: system OpenMPI, PMIx, GoogleTest, nccl.h; fake NCCL wheel on PYTHONPATH'
  export PYTHONPATH='$WORK/wheel'
  run_all
"
