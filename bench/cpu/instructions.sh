#!/usr/bin/env bash
# instructions.sh — instructions per element of the LayerNorm forward and backward, tpnorm's and
# oneDNN's, counted by valgrind's callgrind: a figure that the load of a shared machine does not
# move, where timings of in-cache shapes do.
#
#   bench/cpu/instructions.sh [BUILD_DIR] [SHAPE]     (defaults: build-callgrind, 4096x512)
#
# valgrind 3.19 cannot run AVX-512 code, so BUILD_DIR is configured for AVX2 (x86-64-v3, no
# -march=native; oneDNN picks its AVX2 kernels under valgrind too) and only tpnorm_micro is
# built there. One thread; each op's instructions per call are its inclusive count over the
# calls the run made (the benchmark's and the peers check's).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD="${1:-$ROOT/build-callgrind}"
SHAPE="${2:-4096x512}"
command -v valgrind >/dev/null || { echo "instructions.sh: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPNORM_NATIVE=OFF \
    -DCMAKE_CXX_FLAGS="-march=x86-64-v3" -DTPNORM_CUDA=OFF -DTPNORM_PYTHON=OFF >/dev/null
fi
cmake --build "$BUILD" --target tpnorm_micro >/dev/null
elements=$(( ${SHAPE%x*} * ${SHAPE#*x} ))
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# per_call FILE FUNCTION: the function's inclusive instructions over the calls its callers made.
per_call() {
  callgrind_annotate --tree=caller --inclusive=yes "$1" 2>/dev/null | tr -d ',' |
    awk -v f="$2" '
      /^$/ { calls = 0; next }
      / < / { n = 1; if (match($0, /\(([0-9]+)x\)/)) n = substr($0, RSTART + 1, RLENGTH - 3); calls += n }
      / \* / && index($0, f) && !found { if (calls) v = sprintf("%.0f", $1 / calls); found = 1 }
      END { print (v == "" ? "?" : v) }'
}
printf '%-9s %-8s %14s %14s %9s\n' pass library "instr/call" "instr/element" "ratio"
for pass in forward backward; do
  OMP_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$out/$pass" \
    "$BUILD/bench/cpu/tpnorm_micro" --peers --benchmark_min_time=0.01 \
    --benchmark_filter="^(peer/oneDNN/)?LayerNorm/$pass/$SHAPE/threads:1\$" >/dev/null 2>&1
  t=$(per_call "$out/$pass" "tpnorm::layer_norm_$pass(")
  o=$(per_call "$out/$pass" "dnnl_primitive_execute")
  awk -v p="$pass" -v t="$t" -v o="$o" -v e="$elements" 'BEGIN {
    printf "%-9s %-8s %14d %14.2f %9s\n", p, "tpnorm", t, t / e, "";
    if (o != "?") printf "%-9s %-8s %14d %14.2f %8.2fx\n", p, "oneDNN", o, o / e, t / o;
    else printf "%-9s %-8s %14s (no oneDNN in this build)\n", p, "oneDNN", "-" }'
done
