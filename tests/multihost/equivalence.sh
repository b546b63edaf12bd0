#!/usr/bin/env bash
# equivalence.sh — the numerics across two hosts (fixture.sh: network namespaces with their own
# hostnames on a private bridge), every job started by `./launch/tpnorm run --hosts ...` on the
# first host, mpirun reaching the second through the fixture's remote agent.
#
#   env MH_LAUNCHER=... MH_DEMO=... MH_ROW=... MH_FUSED=... MH_BN=... MH_EXACT=... MH_BLOCK=...
#       equivalence.sh
#
# 1. Placement: 4 ranks on tpmh-h1:2,tpmh-h2:2 (--hosts, and the same as a --hostfile) report
#    2 of each hostname.
# 2. The traffic crosses the link: the demo at 2 ranks, one per host, and the bytes through
#    host 2's veth must be at least the payload its rank all-reduces (the demo's bytes/rank/call
#    times the calls made). The same job with both ranks on host 1 moves (almost) nothing
#    through host 2's link: the counter measures the link, and ranks on different hosts talk
#    over it, not over shared memory.
# 3. 2 hosts x 2 ranks against the float64 references: the multi-rank tests of sharded
#    LayerNorm/RMSNorm (started with the hostfile), fused residual add + norm and SyncBatchNorm
#    (tests/mpi).
# 4. Stats::kExact: bitwise equal to one process across the hosts (test_exact_invariance's
#    random cases of small-valued inputs, every op, at world sizes 1-4 inside the 4-rank job,
#    and its exact-variance cases; its 360 general cases run on one host in tests/reliability,
#    for time), and the transformer block example's losses with
#    --stats exact equal to the bit at 1 rank, at 4 ranks on one host and at 2 x 2 across hosts.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
mh_skip_unless_able
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
ACROSS=(--hosts "$H1:2,$H2:2")
export TPNORM_TIMEOUT=30 OMP_NUM_THREADS=1
# The fixture's hosts share this machine's cores: a rank waiting for its peers yields its core
# (as ./launch/tpnorm bench does) instead of spinning while they need it.
export OMPI_MCA_mpi_yield_when_idle=1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
log="$(mktemp)"; MH_LOG="$log"; trap 'rm -f "$log" "$log".*; mh_cleanup' EXIT
on_hosts() { mh_launch "$1" "$H1" "${@:2}"; }

# 1. Placement.
printf '%s slots=2\n' "$H1" "$H2" >"$log.hostfile"
HOSTFILE=(--hostfile "$log.hostfile")
for hosts in ACROSS HOSTFILE; do
  declare -n h="$hosts"
  on_hosts 60 -n 4 "${h[@]}" hostname
  [ "$rc" -eq 0 ] && [ "$(grep -cx "$H1" "$log")" -eq 2 ] && [ "$(grep -cx "$H2" "$log")" -eq 2 ] ||
    fail "placement with ${h[*]}: exit $rc: $(cat "$log")"
  unset -n h
done
echo "placement: 2 ranks on each host with --hosts and with --hostfile"

# 2. Traffic: the payload the demo all-reduces (LayerNorm and RMSNorm, forward and backward,
# 1 counted + ITERS timed calls each; its SyncBatchNorm part is extra and not counted).
ITERS=10
demo_bytes() {  # the link's bytes during one demo job on the given hosts, payload in $payload
  local b0 b1
  b0="$(mh_link_bytes 2)"
  on_hosts 120 -n 2 --hosts "$1" "$MH_DEMO" --tokens 256 --hidden 1024 --iters "$ITERS"
  b1="$(mh_link_bytes 2)"
  [ "$rc" -eq 0 ] || fail "demo on $1: exit $rc: $(cat "$log")"
  payload="$(awk -v k="$ITERS" '$2 == "forward" || $2 == "backward" {s += $4 * (k + 1)}
                                END {printf "%d", s}' "$log")"
  link=$((b1 - b0))
}
demo_bytes "$H1:1,$H2:1"
echo "one rank per host: demo payload $payload bytes per rank, host 2's link carried $link bytes"
[ "${payload:-0}" -gt 0 ] || fail "no payload read from the demo: $(cat "$log")"
[ "$link" -ge "$payload" ] || fail "host 2's link carried $link bytes < the payload $payload"
demo_bytes "$H1:2"
echo "both ranks on host 1: host 2's link carried $link bytes"
[ "$link" -lt $((payload / 10)) ] || fail "ranks on one host: host 2's link carried $link bytes"

# 3. Against the float64 references, 2 hosts x 2 ranks.
for t in "$MH_ROW" "$MH_FUSED" "$MH_BN"; do
  if [ "$t" = "$MH_ROW" ]; then hosts=("${HOSTFILE[@]}"); else hosts=("${ACROSS[@]}"); fi
  on_hosts 200 -n 4 "${hosts[@]}" "$t" --gtest_color=no
  summary="$(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
  echo "$(basename "$t") across hosts: exit $rc: $summary"
  [ "$rc" -eq 0 ] || fail "$(basename "$t") across hosts: $(tail -40 "$log")"
done

# 4. Stats::kExact across hosts.
on_hosts 200 -n 4 "${ACROSS[@]}" "$MH_EXACT" --gtest_color=no \
  --gtest_filter='ExactInvariance.TinyValuesBitwiseEqualToOneProcess:ExactInvariance.VarianceExact*'
echo "$(basename "$MH_EXACT") across hosts: exit $rc: $(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
[ "$rc" -eq 0 ] || fail "exact invariance across hosts: $(tail -40 "$log")"
block=(--arch pre --norm layernorm --stats exact)
on_hosts 120 -n 1 --hosts "$H1:1" "$MH_BLOCK" "${block[@]}" --write "$log.losses"
[ "$rc" -eq 0 ] || fail "transformer block at 1 rank: $(tail -20 "$log")"
on_hosts 120 -n 4 --hosts "$H1:4" "$MH_BLOCK" "${block[@]}" --check "$log.losses" --tol 0
[ "$rc" -eq 0 ] || fail "transformer block, 4 ranks on one host, not bitwise equal to 1 rank: $(tail -20 "$log")"
on_hosts 120 -n 4 "${ACROSS[@]}" "$MH_BLOCK" "${block[@]}" --check "$log.losses" --tol 0
[ "$rc" -eq 0 ] || fail "transformer block, 2 x 2 across hosts, not bitwise equal to 1 rank: $(tail -20 "$log")"
echo "transformer block --stats exact: losses at 1 rank, 4 on one host and 2 x 2 across hosts bitwise equal: $([ "$rc" -eq 0 ] && echo yes || echo no)"

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "PASS: equivalence across hosts"
