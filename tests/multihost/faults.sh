#!/usr/bin/env bash
# faults.sh MODE — a fault across two hosts (fixture.sh) in the middle of a job started by
# `./launch/tpnorm run --hosts tpmh-h1:2,tpmh-h2:2` on host 1, TPNORM_TIMEOUT=5:
#
#   cut    host 2's link goes down (`ip link set ... down`) and stays down, while every rank
#          loops on LayerNorm calls (fault_loop): every rank on both hosts must end within
#          TPNORM_TIMEOUT + 15 s, non-zero, on each host the watchdog's message (the ranks
#          that the runtime has not ended first print it); the launcher exits non-zero; no
#          process is left on any host.
#   kill   host 2's ranks are SIGKILLed: the ranks of host 1 end the same way.
#   flap   host 2's link goes down for 2 s and comes back while the multi-rank tests of sharded
#          LayerNorm/RMSNorm run against their float64 references (40 times over, some 10 s
#          on an idle machine, so the flap falls inside; checked): the job either passes every check, or ends non-zero on
#          every rank without a failed check (a wrong value); never a hang: everything is gone
#          within the job's own length (FLAP_JOB s at most) plus the same bound.
#
#   env MH_LAUNCHER=... MH_LOOP=fault_loop MH_ROW=mpi_test_row_norm_equiv faults.sh MODE
#
# Each rank runs under a small shell that records its exit status and keeps a copy of its
# stderr (the ranks of a host cut off from mpirun cannot send their output to it).
set -uo pipefail
MODE="$1"
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
mh_skip_unless_able
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
export TPNORM_TIMEOUT=5 OMP_NUM_THREADS=1 OMPI_MCA_orte_base_help_aggregate=0
# The fixture's hosts share this machine's cores: a rank waiting for its peers yields its core
# (as ./launch/tpnorm bench does) instead of spinning while they need it.
export OMPI_MCA_mpi_yield_when_idle=1
BOUND=$((TPNORM_TIMEOUT + 15))
rec="$(mktemp -d)"; MH_LOG="$rec/job.out"
trap 'mh_cleanup; rm -rf "$rec"' EXIT
fail() { echo "FAIL: $*"; echo "--- job output ---"; tail -60 "$MH_LOG"; exit 1; }

case "$MODE" in
  cut|kill) prog=("$MH_LOOP" -1 0 1000000000) ;;
  flap) prog=("$MH_ROW" --gtest_repeat=40 --gtest_brief=1 --gtest_color=no)
        FLAP_JOB=120; BOUND=$((BOUND + FLAP_JOB)) ;;
  *) echo "usage: faults.sh cut|kill|flap"; exit 2 ;;
esac
wrap='"$0" "$@" 2> >(tee '"$rec"'/err.$OMPI_COMM_WORLD_RANK >&2); rc=$?
echo "$rc $(hostname)" >'"$rec"'/rank.$OMPI_COMM_WORLD_RANK; exit $rc'
( mh_launch $((BOUND + 30)) "$H1" -n 4 --hosts "$H1:2,$H2:2" bash -c "$wrap" "${prog[@]}"
  echo "$rc" >"$rec/launcher.rc" ) &
job=$!

# ranks_on HOST: how many of the job's ranks run on HOST.
ranks_on() {
  local p n=0 name
  name="$(basename "${prog[0]}" | cut -c1-15)"
  for p in $(mh_pids "$1"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$name" ] && n=$((n + 1))
  done
  echo "$n"
}
for ((i = 0; i < 120; ++i)); do
  [ "$(ranks_on "$H1")" -eq 2 ] && [ "$(ranks_on "$H2")" -eq 2 ] && break
  sleep 0.5
done
[ "$(ranks_on "$H2")" -eq 2 ] || fail "the job's 4 ranks never ran"
sleep 2  # in the middle of their calls

t0=$(date +%s)
case "$MODE" in
  cut) mh_link 2 down; echo "host 2's link down" ;;
  kill) for p in $(mh_pids "$H2"); do
          [ "$(cat "/proc/$p/comm" 2>/dev/null)" = fault_loop ] && kill -KILL "$p"
        done; echo "host 2's ranks killed" ;;
  flap) mh_link 2 down; sleep 2
        # Still running as the link comes back: the flap fell inside the job.
        [ "$(ranks_on "$H2")" -eq 2 ] || fail "the job had ended before the link came back"
        mh_link 2 up; echo "host 2's link down for 2 s, then up, with the job running" ;;
esac

# Every process of the job gone from both hosts (the launcher included) within the bound.
left=""
while :; do
  left="$(mh_pids "$H1") $(mh_pids "$H2")"
  [ -z "${left// /}" ] && break
  [ $(($(date +%s) - t0)) -le "$BOUND" ] || break
  sleep 0.5
done
elapsed=$(($(date +%s) - t0))
if [ -n "${left// /}" ]; then
  fail "processes left ${elapsed} s after the fault: $(ps -o pid,ppid,args -p "$(echo $left | tr ' ' ,)" | tail -n +2)"
fi
wait "$job"
job_rc="$(cat "$rec/launcher.rc" 2>/dev/null || echo none)"
echo "every process on both hosts ended ${elapsed} s after the fault (bound ${BOUND} s); launcher exit $job_rc"

# Per rank: how it ended, and whether it said why.
watchdog=0
for r in 0 1 2 3; do
  status="killed (no exit recorded)"
  [ -f "$rec/rank.$r" ] && status="exit $(cut -d' ' -f1 "$rec/rank.$r") on $(cut -d' ' -f2 "$rec/rank.$r")"
  said=""
  if grep -q "tpnorm watchdog: rank $r of 4" "$rec/err.$r" 2>/dev/null; then
    said=", watchdog message"; watchdog=$((watchdog + 1))
  fi
  echo "rank $r: $status$said"
done

case "$MODE" in
  cut|kill)
    [ "$job_rc" != 0 ] || fail "the launcher exited 0 after the fault"
    grep -q "finished" "$MH_LOG" && fail "a rank finished its loop"
    for r in 0 1 2 3; do
      [ -f "$rec/rank.$r" ] && [ "$(cut -d' ' -f1 "$rec/rank.$r")" = 0 ] && fail "rank $r exited 0"
    done
    if [ "$MODE" = cut ]; then
      # Both sides lose their peers, so each host's ranks must see it on their own: on each
      # host a watchdog names the op and the timeout, and every rank there either printed it
      # or was ended by the runtime for its host's abort.
      # mpirun places ranks by slot: 0 and 1 on host 1, 2 and 3 on host 2.
      for side in "$H1 0 1" "$H2 2 3"; do
        read -r h ranks <<<"$side"
        said=0
        for r in $ranks; do
          [ ! -f "$rec/rank.$r" ] || [ "$(cut -d' ' -f2 "$rec/rank.$r")" = "$h" ] ||
            fail "rank $r ran on $(cut -d' ' -f2 "$rec/rank.$r"), not $h"
          grep -q "tpnorm watchdog: rank $r of 4" "$rec/err.$r" 2>/dev/null && said=$((said + 1))
        done
        [ "$said" -ge 1 ] || fail "no rank on $h printed the watchdog's message"
      done
    else
      grep -qE "tpnorm watchdog|unexpectedly disconnected|exited with non-zero status|exited on signal" \
        "$MH_LOG" || fail "no message names the lost ranks"
    fi ;;
  flap)
    if [ "$job_rc" = 0 ]; then
      grep -q '\[  FAILED  \]' "$MH_LOG" && fail "exit 0 with a failed check"
      echo "the job completed and every check passed"
    else
      grep -q '\[  FAILED  \]' "$MH_LOG" && fail "a check failed (a wrong value) after the flap"
      grep -qE "tpnorm watchdog|MPI_ABORT|disconnected|lost" "$MH_LOG" "$rec"/err.* ||
        fail "the job failed without a message naming the timeout or the lost peer"
      echo "the job failed cleanly on every rank"
    fi ;;
esac
echo "PASS: $MODE across hosts"
