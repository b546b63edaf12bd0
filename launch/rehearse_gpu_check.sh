#!/usr/bin/env bash
# rehearse_gpu_check.sh — runs ./launch/tpnorm gpu-check on THIS machine as if it were the GPU
# machine without OpenMPI, GoogleTest or NCCL headers: in a private mount namespace (root,
# unshare -m; nothing outside this process tree sees it) the system's OpenMPI, PMIx,
# GoogleTest and nccl.h are hidden behind empty directories, its mpicc / mpirun made to fail, and a fake "PyTorch NCCL wheel"
# (a python package nvidia.nccl holding only lib/libnccl.so.2, like the real wheel) is put on
# PYTHONPATH. gpu-check must then build against the carried prefix and run its items with the
# carried mpirun: the host tests run, every GPU step is reported SKIP with its reason (no GPU
# here). Arguments go to gpu-check (--full: also the whole CPU suite, multi-rank tests included).
#
#   launch/rehearse_gpu_check.sh [--full]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${REHEARSE_DIR:-/tmp/tpnorm-rehearse-$$}"
mkdir -p "$WORK/empty" "$WORK/wheel/nvidia/nccl/lib" "$WORK/cuda-include"
touch "$WORK/wheel/nvidia/nccl/__init__.py"
printf '#!/bin/sh\nexit 127\n' > "$WORK/broken" && chmod +x "$WORK/broken"
cp -L /usr/local/cuda/lib64/libnccl.so.2 "$WORK/wheel/nvidia/nccl/lib/"
cp -a /usr/local/cuda/include/. "$WORK/cuda-include/"
rm -f "$WORK/cuda-include/nccl.h"
MA=/usr/lib/x86_64-linux-gnu
exec unshare -m --propagation private bash -c "
  set -e
  for d in $MA/openmpi $MA/pmix2 /etc/openmpi /usr/include/gtest /usr/include/gmock \
           /usr/src/googletest /usr/src/gtest $MA/cmake/GTest; do
    [ -d \"\$d\" ] && mount --bind '$WORK/empty' \"\$d\"
  done
  mount --bind '$WORK/cuda-include' /usr/local/cuda/include
  for f in /usr/bin/opal_wrapper /usr/bin/orterun; do  # the system mpicc / mpirun fail too
    [ -f \"\$f\" ] && mount --bind '$WORK/broken' \"\$f\"
  done
  echo '[rehearse] hidden: system OpenMPI, PMIx, GoogleTest, nccl.h; fake NCCL wheel on PYTHONPATH'
  command -v mpirun >/dev/null && { mpirun --version >/dev/null 2>&1 && echo '[rehearse] system mpirun still works?!' || echo '[rehearse] system mpirun: broken (as intended)'; }
  export PYTHONPATH='$WORK/wheel'
  export TPNORM_BUILD_DIR='${TPNORM_BUILD_DIR:-$ROOT/build-rehearse}'
  exec '$ROOT/launch/tpnorm' gpu-check $*
"
