#!/usr/bin/env bash
# run_gpu_fault_test.sh — driver of gpu_fault_inject (a ctest, and a step of gpu-check):
#   run_gpu_fault_test.sh MPIEXEC PROG MODE
# Checks, under `timeout` (a hang fails the test instead of hanging it):
#   bad-arg       2 ranks: the job exits 0 and BOTH ranks report an error at call 20;
#   stall-rank    2 ranks: the job ends non-zero within the limit and rank 0 printed
#                 "tpnorm watchdog: rank 0 of 2";
#   stall-stream  1 rank: exit 124 and "tpnorm watchdog: rank 0 of 1" (NCCL watchdog thread);
#   stall-borrowed 1 rank, borrowed NCCL communicator: the same, from the host-side check;
#   init-fail     2 ranks, rank 1 fails inside ncclCommInitRank: the job exits 0 and BOTH
#                 ranks report the factory's error (rank 0 waited at most TPNORM_TIMEOUT=5).
# Prints PASS: / FAIL: (ctest matches them), or the GPU tests' skip marker.
set -uo pipefail
MPIEXEC="$1"; PROG="$2"; MODE="$3"
LIMIT="${TPNORM_FAULT_LIMIT:-90}"  # gpu-check gives each mode its share of its budget
out="$(mktemp)"; trap 'rm -f "$out"' EXIT
np=2; case "$MODE" in stall-stream|stall-borrowed) np=1 ;; esac
export TPNORM_TIMEOUT=10 OMPI_MCA_orte_base_help_aggregate=0
[ "$MODE" = init-fail ] && export TPNORM_TIMEOUT=5
timeout -s KILL "$LIMIT" "$MPIEXEC" --oversubscribe -n "$np" "$PROG" "$MODE" > "$out" 2>&1
rc=$?
fail() { echo "FAIL: $MODE: $* (exit $rc)"; echo "--- job output ---"; cat "$out"; exit 1; }
if grep -q "tpnorm-gpu: no CUDA device" "$out"; then cat "$out"; exit 0; fi
grep -q "PASS-SKIP" "$out" && { grep PASS-SKIP "$out"; echo "PASS: $MODE skipped"; exit 0; }
[ "$rc" -eq 137 ] && fail "the job hung: killed after $LIMIT s"
case "$MODE" in
  bad-arg)
    [ "$rc" -eq 0 ] || fail "the job did not exit 0"
    for r in 0 1; do
      grep -q "rank $r: call 20: error" "$out" || fail "rank $r did not error at call 20"
    done ;;
  init-fail)
    [ "$rc" -eq 0 ] || fail "the job did not exit 0"
    for r in 0 1; do
      grep -q "rank $r: init: error: .*ncclCommInitRank" "$out" ||
        fail "rank $r did not throw the factory's error"
    done ;;
  stall-rank)
    [ "$rc" -ne 0 ] || fail "the job exited 0"
    grep -q "tpnorm watchdog: rank 0 of 2" "$out" || fail "no watchdog message from rank 0" ;;
  stall-stream|stall-borrowed)
    [ "$rc" -eq 124 ] || fail "expected exit 124 from the NCCL watchdog"
    grep -q "tpnorm watchdog: rank 0 of 1" "$out" || fail "no watchdog message" ;;
  *) fail "unknown mode" ;;
esac
grep -E "tpnorm watchdog|error:" "$out" | head -4
echo "PASS: $MODE"
