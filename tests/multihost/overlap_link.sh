#!/usr/bin/env bash
# overlap_link.sh — the split-phase overlap example (examples/overlap) across a link of known
# rate: how much of the statistics exchange finish() still waits for when the ranks sit on two
# hosts (fixture.sh) instead of one. A benchmark: it prints figures and checks only that every
# run produced them, never a duration.
#
#   env MH_LAUNCHER=... MH_OVERLAP=build/examples/overlap/overlap \
#       overlap_link.sh [-n ITERS] [--rows R] [--cols C] [RATE ...]
#
# RATE: "host" (both ranks on host 1: the shared-memory exchange), "link" (one rank per host,
# the link as the fixture makes it) or a number of Mbit/s (a token bucket on both ends of the
# bridge, as in link_rate.sh). Default: host link 1000 200, with -n 15 --rows 4096 --cols 2048
# (the example's documented run). A "+pt" after one (link+pt, 200+pt) runs it with Open MPI's
# TCP progress thread (OMPI_MCA_btl_tcp_progress_thread=1): without it a message that arrives
# while the ranks compute is read only in the next MPI call, i.e. in finish(). For each it prints the example's exposed wait in finish()
# against the library's bare all-reduce of the same payload and against MPI_Allreduce, and the
# blocking / split / matmul-alone times.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
ITERS=15 ROWS=4096 COLS=2048 RATES=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) ITERS="$2"; shift 2 ;;
    --rows) ROWS="$2"; shift 2 ;;
    --cols) COLS="$2"; shift 2 ;;
    *) RATES+=("$1"); shift ;;
  esac
done
[ ${#RATES[@]} -gt 0 ] || RATES=(host link 1000 200)
mh_skip_unless_able
command -v tc >/dev/null || { echo "SKIP: the shaped link needs tc (iproute2)"; exit 0; }
[ -x "${MH_OVERLAP:-}" ] || { echo "FAIL: no overlap example at '${MH_OVERLAP:-}'"; exit 1; }
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
export TPNORM_TIMEOUT=60 OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
log="$(mktemp)"; MH_LOG="$log"; trap 'rm -f "$log"; mh_cleanup' EXIT
shaped=0
# One bucket per direction: each bridge port shapes what it sends to its host.
shape() {
  local i op=add
  [ "$shaped" -eq 0 ] || op=change
  for i in 1 2; do
    ip netns exec "$MH_BR" tc qdisc "$op" dev "h$i" root tbf rate "$1mbit" burst 32kbit latency 50ms ||
      { echo "SKIP: tc tbf is not available on the fixture's veths"; exit 0; }
  done
  shaped=1
}
unshape() {
  local i
  [ "$shaped" -eq 1 ] || return 0
  for i in 1 2; do ip netns exec "$MH_BR" tc qdisc del dev "h$i" root; done
  shaped=0
}
num() { sed -n "$1" "$log" | head -1; }

printf '%-38s %11s %11s %7s %11s %7s %10s %10s %10s  %s\n' "ranks (2)" "exposed us" "bare us" \
  "exp/bare" "MPI_Allred" "exp/MPI" "block ms" "split ms" "matmul ms" "small sums via"
missing=0
for token in "${RATES[@]}"; do
  rate="${token%+pt}" pt=0
  [ "$rate" = "$token" ] || pt=1
  case "$rate" in
    host) unshape; hosts="$H1:2" what="both on host 1" ;;
    link) unshape; hosts="$H1:1,$H2:1" what="one per host, link as is" ;;
    *[!0-9]*) echo "FAIL: rate '$rate' is not host, link or a number of Mbit/s"; exit 2 ;;
    *) shape "$rate"; hosts="$H1:1,$H2:1" what="one per host, $rate Mbit/s" ;;
  esac
  [ "$pt" -eq 0 ] || what="$what, TCP thread"
  OMPI_MCA_btl_tcp_progress_thread="$pt" mh_launch 300 "$H1" -n 2 --hosts "$hosts" "$MH_OVERLAP" --rows "$ROWS" --cols "$COLS" -n "$ITERS"
  exposed="$(num 's/^overlap  exposed communication in finish() \([0-9.]*\) us vs bare all-reduce of the payload \([0-9.]*\) us.*/\1 \2/p')"
  mpi="$(num 's/^overlap  bare MPI_Allreduce of the payload \([0-9.]*\) us.*/\1/p')"
  times="$(num 's/^overlap  P=2 .*: blocking \([0-9.]*\) ms, split \([0-9.]*\) ms (matmul alone \([0-9.]*\) ms)/\1 \2 \3/p')"
  via="$(num 's/.*small sums via \(.*\)$/\1/p')"
  if [ "$rc" -ne 0 ] || [ -z "$exposed" ] || [ -z "$mpi" ] || [ -z "$times" ]; then
    echo "FAIL: $what: exit $rc, no figures"; sed 's/^/  | /' "$log"; missing=$((missing + 1)); continue
  fi
  read -r e b <<<"$exposed"; read -r tb ts tm <<<"$times"
  fmt='%-38s %11.1f %11.1f %6.0f%% %11.1f %6.0f%% %10.1f %10.1f %10.1f  %s\n'
  awk -v f="$fmt" -v w="$what" -v e="$e" -v b="$b" -v m="$mpi" -v tb="$tb" -v ts="$ts" -v tm="$tm" \
    -v via="$via" 'BEGIN { printf f, w, e, b, (b > 0 ? 100 * e / b : 0), m, (m > 0 ? 100 * e / m : 0), tb, ts, tm, via }' ||
    missing=$((missing + 1))
done
echo "(P=2, RMSNorm [$ROWS, $COLS] fp32 per rank under a matmul [$ROWS, $COLS] x [$COLS, 256], median of $ITERS; exposed = the time finish() waited)"
[ "$missing" -eq 0 ] || { echo "$missing run(s) printed no figures"; exit 1; }
echo "PASS: the overlap example ran at ${RATES[*]}"
