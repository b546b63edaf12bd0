#!/usr/bin/env bash
# link_rate.sh — the benchmark's cost-model fit against a link of known rate: two hosts
# (fixture.sh), one rank on each, `./launch/tpnorm bench --hosts ...` over TCP started on the
# first host.
#
#   env MH_LAUNCHER=... link_rate.sh
#
# 1. No limit on the link: the bandwidth-bound beta of the bench is the hosts' own per-byte
#    cost (copies, the TCP stack), which a limited link adds to rather than overlaps.
# 2. A token bucket of 200 Mbit/s on both ends of the bridge (each direction limited): the same
#    bench given that cost as --host-beta must report the link's beta within 25 % of
#    1/R = 40 ns/B, and a rate within 25 % of 200 Mbit/s (MH_RATE_MBIT=1000 checks 1 Gbit/s).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
mh_skip_unless_able
command -v tc >/dev/null || { echo "SKIP: the link-rate test needs tc (iproute2)"; exit 0; }
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
RATE_MBIT="${MH_RATE_MBIT:-200}"
export TPNORM_TIMEOUT=30 OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
log="$(mktemp)"; trap 'rm -f "$log"; mh_cleanup' EXIT

# bench ARGS...: the benchmark at 2 ranks, one per host; output in $log, status in $rc.
bench() {
  timeout -s KILL 40 nsenter --uts="$MH_RUN/$H1.uts" -- ip netns exec "$H1" \
    env OMPI_MCA_plm_rsh_agent="$MH_AGENT" OMPI_MCA_plm_rsh_no_tree_spawn=1 \
    "$MH_LAUNCHER" bench --hosts "$H1:1,$H2:1" --world 2 --transport tcp \
    --op rmsnorm -n 7 -w 2 "$@" >"$log" 2>&1
  rc=$?
  [ "$rc" -ne 137 ] || mh_kill_all
}
field() { sed -n "$1" "$log" | head -1; }
die() { echo "FAIL: $*"; sed 's/^/  | /' "$log"; exit 1; }

# 1. The hosts' own per-byte cost.
bench
[ "$rc" -eq 0 ] || die "bench without a limit: status $rc"
host="$(field 's/^# bandwidth-bound at 2 ranks.*: beta \([0-9.e+-]*\) ns\/B.*/\1/p')"
[ -n "$host" ] || die "no bandwidth-bound beta printed"
echo "no limit: bandwidth-bound beta $host ns/B (the hosts' own)"

# 2. The limited link.
for i in 1 2; do
  ip netns exec "$MH_BR" tc qdisc add dev "h$i" root tbf rate "${RATE_MBIT}mbit" burst "${MH_TBF_BURST:-32kbit}" \
    latency 50ms || { echo "SKIP: tc tbf is not available on the fixture's veths"; exit 0; }
done
bench --host-beta "$host"
[ "$rc" -eq 0 ] || die "bench across the ${RATE_MBIT} Mbit/s link: status $rc"
line="$(field '/^# link: /p')"
echo "${RATE_MBIT} Mbit/s: $(field '/^# bandwidth-bound/p')"
echo "${RATE_MBIT} Mbit/s: $line"
beta="$(sed -n 's/^# link: beta \([0-9.e+-]*\) ns\/B.*/\1/p' <<<"$line")"
mbit="$(sed -n 's/.*: ~\([0-9]*\) Mbit\/s$/\1/p' <<<"$line")"
[ -n "$beta" ] && [ -n "$mbit" ] || die "no link beta and rate printed"
awk -v b="$beta" -v m="$mbit" -v r="$RATE_MBIT" 'BEGIN {
  want = 8e3 / r
  exit !(b >= 0.75 * want && b <= 1.25 * want && m >= 0.75 * r && m <= 1.25 * r) }' ||
  die "link beta $beta ns/B (~$mbit Mbit/s) is not within 25 % of 1/R = $(awk -v r=$RATE_MBIT 'BEGIN{print 8e3/r}') ns/B"
echo "PASS: the bench recovers the ${RATE_MBIT} Mbit/s link: beta $beta ns/B (1/R = $(awk -v r=$RATE_MBIT 'BEGIN{print 8e3/r}') ns/B), ~$mbit Mbit/s"
