#!/usr/bin/env bash
# unlike_cpus.sh — ranks on CPUs with different L2 caches (a job across unlike nodes) make the
# same collectives: rank 1 runs in a mount namespace where cpu0's L2 reads 512K, rank 0 reads its
# own (2048K on many servers), and a LayerNorm large enough for the host chunk rule runs in both.
# The chunk plan decides how many collectives a call makes; a plan from each process's own L2
# would chunk on one rank only (one rank aborts on a size mismatch, the other hangs until the
# watchdog). Needs root (unshare -m, mount --bind): skipped (exit 77) otherwise.
#
#   unlike_cpus.sh MPIEXEC TPNORM_BENCH
set -uo pipefail
MPIEXEC="$1"; BENCH="$2"
l2=/sys/devices/system/cpu/cpu0/cache/index2/size
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (unshare -m)"; exit 77; }
[ -r "$l2" ] || { echo "SKIP: no $l2"; exit 77; }
unshare -m true 2>/dev/null || { echo "SKIP: unshare -m is not allowed here"; exit 77; }
dir="$(mktemp -d)"; trap 'rm -rf "$dir"' EXIT
mine=$(cat "$l2")
other=512K; [ "$mine" = 512K ] && other=2048K
echo "$other" > "$dir/l2"
echo "rank 0 reads L2 $mine, rank 1 reads $other"
# 4096 rows x 512 columns per rank of fp32: 8 MiB of re-read input per rank forward, 16 MiB
# backward, in the range where a 512K-L2 rule and a 2048K-L2 rule disagree on chunking.
export TPNORM_TIMEOUT=20 OMPI_MCA_orte_base_help_aggregate=0
timeout -s KILL 120 "$MPIEXEC" --oversubscribe -n 2 bash -c '
  if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then
    exec unshare -m bash -c "mount --bind '"$dir"'/l2 '"$l2"' && exec \"\$0\" \"\$@\"" "$0" "$@"
  fi
  exec "$0" "$@"' "$BENCH" --op layernorm --rows 4096 --hidden 1024 -n 2 -w 1 > "$dir/out" 2>&1
rc=$?
cat "$dir/out"
[ "$rc" -eq 0 ] || { echo "FAIL: the job ended with $rc"; exit 1; }
echo "PASS: ranks with L2 $mine and $other made the same collectives"
