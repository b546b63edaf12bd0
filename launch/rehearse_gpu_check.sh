#!/usr/bin/env bash
# rehearse_gpu_check.sh — the GPU check's two commands on a machine WITHOUT a GPU, to see
# before a device run that everything up to the first CUDA call works within the commands'
# budgets: the plan (first within 480 s, second within 210 s), then `first` (set-up with the
# environment report, configure and build of the GPU targets, the host tests) and `second`
# (its check for first's binaries, set-up); every GPU item is reported SKIP with its reason.
# Passes when both commands exit 0, each within its budget, and the --out directory holds at
# most 3 files (summary.txt, gpu-check-logs.tar.gz, gpu-bench.json; a device run may fetch 8).
#
#   launch/rehearse_gpu_check.sh [--out DIR] [--build-dir DIR] [--hide-system]
#
# --hide-system (root; unshare -m): hides the system's OpenMPI, PMIx, GoogleTest and nccl.h
# behind empty directories in a private mount namespace and puts a fake PyTorch NCCL wheel on
# PYTHONPATH, as on a GPU machine that lacks them; gpu-check must then use the fetched packages
# (build-gpu-deps/, from `gpu-check fetch`). This rebuilds everything against them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=/tmp/tpnorm-rehearse-out
BUILD="$ROOT/build-gpu"
HIDE=0
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) [ $# -ge 2 ] || { echo "rehearse: --out needs a value" >&2; exit 2; }; OUT="$2"; shift ;;
    --build-dir) [ $# -ge 2 ] || { echo "rehearse: --build-dir needs a value" >&2; exit 2; }; BUILD="$2"; shift ;;
    --hide-system) HIDE=1 ;;
    *) echo "rehearse: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
rm -rf "$OUT"
mkdir -p "$OUT"

run_all() {
  "$ROOT/launch/gpu-check" plan
  local c rc=0 t0 took budget
  for c in first second; do
    echo "--- gpu-check $c"
    budget=480; [ "$c" = second ] && budget=210
    t0=$(date +%s)
    "$ROOT/launch/gpu-check" "$c" --out "$OUT" --build-dir "$BUILD" || { echo "rehearse: $c failed"; rc=1; }
    took=$(( $(date +%s) - t0 ))
    echo "rehearse: $c took $took s (budget $budget s)"
    [ "$took" -le "$budget" ] || { echo "rehearse: $c overran its budget"; rc=1; }
  done
  local files; files=$(ls -A "$OUT" | wc -l)
  echo "--- summary ($OUT/summary.txt; $files files in $OUT: $(ls -A "$OUT" | tr '\n' ' '))"
  grep -E '^\[(PASS|FAIL|SKIP)' "$OUT/summary.txt"
  [ "$files" -le 3 ] || { echo "rehearse: $OUT holds $files files (at most 3)"; rc=1; }
  [ "$rc" = 0 ] && echo "rehearse: PASS" || echo "rehearse: FAIL"
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
export ROOT OUT BUILD
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
