#!/bin/sh
# peers_smoke.sh PYTHON PEERS_PY MICRO [TORCH_PYTHON ...] — `./launch/tpnorm perf --peers` at its
# smallest: one row shape and one SyncBatchNorm shape, one thread, one short repetition, under
# each torch named. Checks that the table has its columns, a tpnorm and a peer figure in every
# timed row, and that every peer's output matched tpnorm's (the driver's exit status and its
# "checks: passed" line). Asserts no timing.
set -u
py="$1"; peers="$2"; micro="$3"; shift 3
fail() { echo "FAIL: $*"; exit 1; }
torches=""
for t in "$@"; do [ -n "$t" ] && torches="$torches --torch $t"; done
# shellcheck disable=SC2086
out=$("$py" "$peers" --micro "$micro" --quick --threads 1 --shapes '4096x512|32x64x56x56' \
      $torches 2>&1); rc=$?
echo "$out"
[ "$rc" -eq 0 ] || fail "peers.py exited $rc"
echo "$out" | grep -Eq '^op +pass +shape +layout +thr +tpnorm +oneDNN +torch .* best peer +tpnorm/best$' ||
  fail "no table header with the columns op .. tpnorm oneDNN torch .. best peer tpnorm/best"
# Rows with a peer in every configuration (oneDNN or Debian's torch) end in tpnorm/best; the
# RMSNorm rows have one only with torch >= 2.4, so they need only tpnorm's figure.
for row in 'LayerNorm +forward +4096x512 +rows +1 ' 'LayerNorm +backward +4096x512 +rows +1 ' \
           'SyncBN +forward +32x64x56x56 +NCHW +1 ' 'SyncBN +backward +32x64x56x56 +NCHW +1 '; do
  line=$(echo "$out" | grep -E "^$row") || fail "no row /$row/"
  echo "$line" | grep -Eq '[0-9]\.[0-9]{2}$' || fail "row without tpnorm/best: $line"
done
for row in 'RMSNorm +forward +4096x512 +rows +1 +[0-9]' 'RMSNorm +backward +4096x512 +rows +1 +[0-9]'; do
  echo "$out" | grep -Eq "^$row" || fail "no row /$row/"
done
echo "$out" | grep -q '^checks: passed: all [0-9]* peer outputs matched' || fail "checks did not pass"
echo "$out" | grep -q '^error:' && fail "an error was printed"
echo "peers smoke passed"
