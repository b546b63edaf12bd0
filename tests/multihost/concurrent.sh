#!/usr/bin/env bash
# concurrent.sh — the fixture (fixture.sh) twice at once on one machine, as when two test
# suites run side by side (two clones, two CI jobs):
#
#   env MH_LAUNCHER=... MH_ROW=... concurrent.sh
#
# 1. Two runs A and B, each a process of its own with two hosts, come up together: their
#    names differ, and each runs the sharded LayerNorm/RMSNorm test on 2 hosts x 2 ranks at
#    the same time as the other; every rank of each job runs on that run's own hosts.
# 2. A ends while B is still up: A's clean-up removes A's namespaces and nothing of B's, and
#    B's hosts still run a job across their link afterwards.
# 3. A run C killed with SIGKILL (no clean-up) leaves its hosts behind; the next run to come
#    up (D) removes them, since C's owner is gone, and again leaves B's alone.
# 4. After B ends, nothing of any of them is left.
# Needs root (skips with the reason otherwise).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/fixture.sh"

# child NAME HOSTS DIR: one run of the fixture (its own process, so its own names), driven by
# files in DIR: it writes DIR/NAME.prefix once its hosts are up, then runs the job each
# DIR/NAME.jobK file asks for (writing DIR/NAME.doneK with the status and the ranks'
# hostnames), and ends (cleaning up) when DIR/NAME.end appears.
if [ "${1:-}" = child ]; then
  name="$2" n="$3" dir="$4"
  mh_up "$n"
  export TPNORM_TIMEOUT=30 OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
  echo "$MH_PREFIX" >"$dir/$name.prefix"
  k=1
  while [ ! -e "$dir/$name.end" ]; do
    if [ -e "$dir/$name.job$k" ]; then
      MH_LOG="$dir/$name.log$k"
      H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
      mh_launch 120 "$H1" -n 4 --hosts "$H1:2,$H2:2" "$MH_ROW" --gtest_color=no
      job_rc=$rc
      MH_LOG="$dir/$name.hosts$k"
      mh_launch 60 "$H1" -n 4 --hosts "$H1:2,$H2:2" hostname
      echo "$job_rc $rc $(grep -E "^$MH_PREFIX-h[0-9]+$" "$MH_LOG" | sort | uniq -c | tr -s ' \n' '  ')" >"$dir/$name.done$k"
      k=$((k + 1))
    fi
    sleep 0.2
  done
  exit 0
fi

mh_skip_unless_able
[ -x "${MH_ROW:-}" ] || { echo "FAIL: no test program at '${MH_ROW:-}'"; exit 1; }
dir="$(mktemp -d)"
children=()
finish() {
  local p
  touch "$dir"/{A,B,C,D}.end
  for p in "${children[@]}"; do kill "$p" 2>/dev/null; done
  wait
  # A child killed before its clean-up (C on purpose, any on a failure) is reaped here.
  mh_reap_stale
  rm -rf "$dir"
}
trap finish EXIT
trap 'exit 143' TERM INT HUP
fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.log* "$dir"/*.done*; do [ -f "$f" ] && tail -5 "$f" | sed "s|^|  $(basename "$f") |"; done
  exit 1
}
start() { bash "$HERE/concurrent.sh" child "$1" "$2" "$dir" >"$dir/$1.out" 2>&1 & children+=($!); eval "pid_$1=$!"; }
wait_file() {  # wait_file FILE SECONDS
  local i
  for ((i = 0; i < $2 * 5; ++i)); do [ -e "$1" ] && return 0; sleep 0.2; done
  return 1
}
namespaces() { ip netns list 2>/dev/null | awk -v p="$1-" 'index($1, p) == 1 {print $1}' | sort | tr '\n' ' '; }

# 1. A and B together.
start A 2; start B 2
wait_file "$dir/A.prefix" 60 && wait_file "$dir/B.prefix" 60 ||
  fail "the two runs did not come up: $(cat "$dir"/*.out)"
PA="$(cat "$dir/A.prefix")" PB="$(cat "$dir/B.prefix")"
[ "$PA" != "$PB" ] || fail "both runs named their hosts $PA"
for p in "$PA" "$PB"; do
  [ "$(namespaces "$p")" = "$p-br $p-h1 $p-h2 " ] || fail "run $p has namespaces '$(namespaces "$p")'"
done
echo "runs: A = $PA, B = $PB, both up: $(namespaces "$PA")$(namespaces "$PB")"
touch "$dir/A.job1" "$dir/B.job1"
wait_file "$dir/A.done1" 200 && wait_file "$dir/B.done1" 200 || fail "the jobs did not end"
for r in A B; do
  read -r job_rc host_rc hosts <"$dir/$r.done1"
  p="$PA"; [ "$r" = B ] && p="$PB"
  [ "$job_rc" -eq 0 ] && grep -q "^\[  PASSED  \]" "$dir/$r.log1" ||
    fail "run $r: the equivalence test ended with status $job_rc"
  [ "$host_rc" -eq 0 ] && [ "$hosts" = "2 $p-h1 2 $p-h2" ] ||
    fail "run $r: the ranks ran on '$hosts' (status $host_rc), not 2 on each of $p-h1, $p-h2"
  echo "run $r: $(grep -m1 "^\[  PASSED  \]" "$dir/$r.log1"), ranks on: $hosts"
done

# 2. A ends; B stays up and whole.
touch "$dir/A.end"; wait "$pid_A"
[ -z "$(namespaces "$PA")" ] || fail "A's namespaces left after its clean-up: $(namespaces "$PA")"
[ ! -e "$MH_RUN/$PA.owner" ] || fail "A's owner record left"
[ "$(namespaces "$PB")" = "$PB-br $PB-h1 $PB-h2 " ] ||
  fail "A's clean-up touched B: B has '$(namespaces "$PB")'"
touch "$dir/B.job2"
wait_file "$dir/B.done2" 200 || fail "B's second job did not end"
read -r job_rc host_rc hosts <"$dir/B.done2"
[ "$job_rc" -eq 0 ] && [ "$host_rc" -eq 0 ] || fail "B's job after A's clean-up: status $job_rc/$host_rc"
echo "A ended: its namespaces removed, B's kept; B's job after it: $(grep -m1 "^\[  PASSED  \]" "$dir/B.log2")"

# 3. C killed without clean-up, then D reaps it and not B.
start C 1
wait_file "$dir/C.prefix" 60 || fail "C did not come up"
PC="$(cat "$dir/C.prefix")"
kill -KILL "$pid_C"; wait "$pid_C" 2>/dev/null
left_c="$(namespaces "$PC")"
[ -n "$left_c" ] || fail "C's namespaces went with SIGKILL (nothing to reap)"
start D 1
wait_file "$dir/D.prefix" 60 || fail "D did not come up"
PD="$(cat "$dir/D.prefix")"
[ -z "$(namespaces "$PC")" ] || fail "D's start did not remove killed C's namespaces: $(namespaces "$PC")"
[ "$(namespaces "$PB")" = "$PB-br $PB-h1 $PB-h2 " ] || fail "D's start touched B: '$(namespaces "$PB")'"
touch "$dir/D.end"; wait "$pid_D"
echo "C ($PC) killed with SIGKILL left ${left_c% } behind; D ($PD) removed them at its start, B untouched"

# 4. B ends: nothing left of any run.
touch "$dir/B.end"; wait "$pid_B"
for p in "$PA" "$PB" "$PC" "$PD"; do
  [ -z "$(namespaces "$p")" ] || fail "namespaces of $p left: $(namespaces "$p")"
  [ -z "$(ls -d /etc/netns/"$p"-* "$MH_RUN/$p"* 2>/dev/null)" ] || fail "files of $p left"
done
echo "PASS: two fixtures up at once ($PA, $PB) each ran a 4-rank job across its own 2 hosts; each clean-up removed only its own run's objects; a killed run's leftovers were removed by the next run"
