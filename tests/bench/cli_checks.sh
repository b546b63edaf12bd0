#!/bin/sh
# cli_checks.sh BENCH — the benchmark's command line as a new user meets it, without mpirun:
# --help prints the flags and exits 0; a bad flag is exactly one line naming it, exit 2; a
# process that MPI thinks is alone while srun says it started 2 tasks (the srun-without-PMIx
# trap) stops at start with a message that says so, exit 3.
set -u
bench="$1"
fail() { echo "FAIL: $*"; exit 1; }

out=$("$bench" --help 2>&1); rc=$?
[ "$rc" -eq 0 ] || fail "--help exited $rc"
echo "$out" | grep -q -- '--strategies LIST' || fail "--help does not list --strategies: $out"

out=$("$bench" --bogus 2>&1); rc=$?
[ "$rc" -eq 2 ] || fail "--bogus exited $rc"
[ "$out" = "tpnorm_bench: unknown flag --bogus (see --help)" ] || fail "--bogus printed: $out"

out=$("$bench" --strategies all,nope 2>&1); rc=$?
[ "$rc" -eq 2 ] && [ "$(echo "$out" | wc -l)" -eq 1 ] || fail "--strategies nope: $rc: $out"

out=$(env -u OMPI_COMM_WORLD_SIZE -u TPNORM_WORLD_SIZE SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0 \
      "$bench" -n 1 -w 0 2>&1); rc=$?
[ "$rc" -eq 3 ] || fail "singleton trap exited $rc: $out"
echo "$out" | grep -q 'MPI world size is 1 but srun started 2 tasks.*singleton' ||
  fail "singleton trap printed: $out"
echo "cli checks passed"
