#!/usr/bin/env bash
# run_fault_test.sh — the fault test's driver (a ctest): runs fault_loop at 3 ranks, rank 1
# SIGKILLs itself in the middle of its loop, and checks what actually ends the job.
#
#   run_fault_test.sh MPIEXEC FAULT_LOOP MODE
#
# MODE watchdog: mpirun runs with orte_enable_recovery, so it does NOT tear the job down when a
#   rank dies; the survivors sit in a collective the dead rank never joins, and the communicator
#   watchdog (TPNORM_TIMEOUT=3) must end the job: every survivor prints the watchdog's message
#   naming the op, itself and call KILL_AT+1, and exits non-zero (124 from its own MPI_Abort,
#   or killed by the runtime when another survivor's MPI_Abort got there first).
# MODE mpirun: plain mpirun, which ends the whole job itself when a rank dies; the test checks
#   that the job ends non-zero and reports which mechanism ended it.
# Both: the job must be over within 30 s of the kill (a liveness bound, not a timing).
set -uo pipefail
MPIEXEC="$1"; PROG="$2"; MODE="$3"
NP=3 VICTIM=1 KILL_AT=200 ITERS=1000000000 LIMIT=30
dir="$(mktemp -d)"; trap 'rm -rf "$dir"' EXIT
extra=()
[ "$MODE" = watchdog ] && extra=(--mca orte_enable_recovery 1)

fail() { echo "FAIL: $*"; echo "--- job output ---"; cat "$dir/out"; exit 1; }

# Each rank runs under a small shell that records its exit status and when it ended (a rank
# killed by the runtime records nothing: its status is non-zero by construction).
export TPNORM_TIMEOUT=3 OMPI_MCA_orte_base_help_aggregate=0
timeout -s KILL 60 "$MPIEXEC" --oversubscribe -n "$NP" "${extra[@]}" bash -c \
  '"$0" "$@"; rc=$?; echo "$rc $(date +%s)" > '"$dir"'/rank.$OMPI_COMM_WORLD_RANK; exit $rc' \
  "$PROG" "$VICTIM" "$KILL_AT" "$ITERS" > "$dir/out" 2>&1
job_rc=$?
job_end=$(date +%s)
[ "$job_rc" -eq 137 ] && ! grep -q "kills itself" "$dir/out" && fail "job hung (killed after 60 s)"

grep -q "fault_loop: rank $VICTIM kills itself at iteration $KILL_AT" "$dir/out" ||
  fail "rank $VICTIM never killed itself"
[ -f "$dir/rank.$VICTIM" ] || fail "no record of rank $VICTIM's death"
read -r victim_rc kill_time < "$dir/rank.$VICTIM"
[ "$victim_rc" -eq 137 ] || fail "rank $VICTIM exited $victim_rc, expected 137 (SIGKILL)"
grep -q "finished" "$dir/out" && fail "a survivor finished its loop"
elapsed=$((job_end - kill_time))
[ "$elapsed" -le "$LIMIT" ] || fail "job ended ${elapsed} s after the kill (limit ${LIMIT} s)"

watchdog_lines=0
for ((r = 0; r < NP; ++r)); do
  [ "$r" -eq "$VICTIM" ] && continue
  status="killed by the runtime"
  if [ -f "$dir/rank.$r" ]; then
    read -r rc _ < "$dir/rank.$r"
    [ "$rc" -ne 0 ] || fail "survivor rank $r exited 0"
    status="exit $rc"
  fi
  msg="tpnorm watchdog: rank $r of $NP: layer_norm_forward (call $((KILL_AT + 1)) on this communicator)"
  if grep -qF "$msg" "$dir/out"; then
    watchdog_lines=$((watchdog_lines + 1)); status="$status, watchdog message"
  fi
  echo "rank $r: $status"
done

if [ "$MODE" = watchdog ]; then
  [ "$watchdog_lines" -eq $((NP - 1)) ] || fail "not every survivor printed the watchdog message"
  echo "PASS: the watchdog ended the job ${elapsed} s after rank $VICTIM was killed (mpirun exit $job_rc)"
else
  [ "$job_rc" -ne 0 ] || fail "mpirun exited 0 after a rank was killed"
  by="mpirun (it noticed the dead rank and killed the job)"
  [ "$watchdog_lines" -gt 0 ] && by="the tpnorm watchdog"
  echo "PASS: the job ended non-zero (mpirun exit $job_rc) ${elapsed} s after the kill; ended by $by"
fi
