#!/usr/bin/env bash
# torchrun.sh — docs/multi-node.md's torchrun-across-nodes recipe, run as written on two hosts
# (fixture.sh): one torchrun started on each host, as a user starts it on each node, the c10d
# rendezvous on host 1, 2 workers per host, the Python example (tpnorm.ShardedLayerNorm over a
# gloo group of 4 against torch.nn.LayerNorm on the gathered rows) as the program.
#
#   env MH_TORCH_PYTHON=VENV/bin/python MH_EXAMPLE=examples/python/sharded_layer_norm.py \
#       [MH_DEBIAN_PYTHONPATH=build/python] torchrun.sh
#
# 1. The venv's torch (PyPI), tpnorm pip-installed into it: both torchruns exit 0, the example
#    reports a world of 4 and its error against nn.LayerNorm within float32 rounding (it exits
#    non-zero past 1e-5); host 2's link carried the rendezvous and gloo's traffic (its workers
#    have no other way to their peers: the hosts share no network); nothing is left running
#    on either host when the torchruns have exited.
# 2. Debian's torch (1.13, /usr/bin/python3) with the module built here (MH_DEBIAN_PYTHONPATH),
#    the same recipe in its spelling (torch < 2.0 has only --nproc_per_node, --rdzv_backend, ...)
#    plus --redirects 1 --tee 1 (below: without them that torch's torchrun fails on Python 3.11).
#    Left out, with a note, when that module was not built.
# 3. After the fixture's clean-up no namespace, /etc/netns entry or worker of this test is left.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
mh_skip_unless_able
[ -n "${MH_TORCH_PYTHON:-}" ] && [ -x "$MH_TORCH_PYTHON" ] ||
  { echo "SKIP: no torch venv (configure with -DTPNORM_TORCH_PYTHON=VENV/bin/python; launch/python-env.sh ensure)"; exit 0; }
"$MH_TORCH_PYTHON" -c 'import torch, tpnorm' 2>/dev/null ||
  { echo "SKIP: tpnorm is not installed in $MH_TORCH_PYTHON's venv (launch/python-env.sh install BUILD_DIR)"; exit 0; }
[ -f "${MH_EXAMPLE:-}" ] || { echo "FAIL: no example at '${MH_EXAMPLE:-}'"; exit 1; }
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
PORT=29400
RDZV_ID=tpnorm-example
log="$(mktemp -d)"; trap 'rm -rf "$log"; mh_cleanup' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# across NAME PYTHON SPELLING [ENV...]: the recipe on both hosts at once (host 2 first: its
# agent waits for host 1's rendezvous store, as a node started early does); each torchrun's
# output in $log/NAME.HOST, status in rc_HOST. Past 150 s everything on both hosts is killed.
across() {
  local name="$1" py="$2" spelling="$3" h pids=() i=0
  shift 3
  local args
  if [ "$spelling" = dash ]; then
    args=(--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "$H1:$PORT"
          --rdzv-id "$RDZV_ID")
  else
    # Debian's torch 1.13 on Python 3.11: its default --redirects/--tee "0" parse to None
    # (3.11 no longer lists a Flag's zero member) and the agent fails before starting a worker,
    # on one node too; 1 (stdout) parses, so the workers' stdout goes to --log_dir and, teed,
    # to torchrun's with a "[default0]:" prefix.
    args=(--nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint "$H1:$PORT"
          --rdzv_id "$RDZV_ID" --redirects 1 --tee 1)
  fi
  for h in "$H2" "$H1"; do
    local extra=()
    [ "$spelling" = dash ] || extra=(--log_dir "$log/$name-logs.$h")
    timeout -s KILL 150 nsenter --uts="$MH_RUN/$h.uts" -- ip netns exec "$h" \
      env OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 "$@" \
      "$py" -m torch.distributed.run "${args[@]}" "${extra[@]}" "$MH_EXAMPLE" >"$log/$name.$h" 2>&1 &
    pids+=($!)
  done
  wait "${pids[0]}"; rc_h2=$?
  wait "${pids[1]}"; rc_h1=$?
  [ "$rc_h1" -ne 137 ] && [ "$rc_h2" -ne 137 ] || mh_kill_all
}

# check NAME: both exited 0, the example's line (printed by global rank 0, on either host)
# names a world of 4 and an error within float32 rounding; nothing left on the hosts.
check() {
  local name="$1" line err h left
  line="$(sed -n 's/^\(\[default[0-9]*\]:\)\{0,1\}\(ShardedLayerNorm over\)/\2/p' \
           "$log/$name.$H1" "$log/$name.$H2" | head -1)"
  echo "$name: torchrun on $H1 exit $rc_h1, on $H2 exit $rc_h2: ${line:-no result line}"
  [ "$rc_h1" -eq 0 ] && [ "$rc_h2" -eq 0 ] ||
    fail "$name: $(for h in "$H1" "$H2"; do echo "--- $h"; tail -30 "$log/$name.$h"; done)"
  grep -q '^ShardedLayerNorm over 4 ranks (gloo)' <<<"$line" || fail "$name: no world of 4 reported"
  err="$(sed -n 's/.*gathered)| = \([0-9.e+-]*\);.*/\1/p' <<<"$line")"
  awk -v e="${err:-x}" 'BEGIN { exit !(e + 0 == e && e <= 1e-5) }' ||
    fail "$name: error '${err}' against nn.LayerNorm is not within 1e-5"
  for h in "$H1" "$H2"; do
    left="$(mh_pids "$h")"
    [ -z "$left" ] || fail "$name: processes left on $h after torchrun exited: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
  done
}

# 1. PyPI torch, tpnorm pip-installed in the venv.
b0="$(mh_link_bytes 2)"
across pypi "$MH_TORCH_PYTHON" dash
b1="$(mh_link_bytes 2)"
check pypi
link=$((b1 - b0))
echo "pypi: torch $("$MH_TORCH_PYTHON" -c 'import torch; print(torch.__version__)'), host 2's link carried $link bytes"
# The rendezvous (a TCPStore on host 1) and gloo's connections between the workers of the two
# hosts are several KB at least; a job that never left host 2 would show almost nothing.
[ "$link" -ge 10000 ] || fail "host 2's link carried only $link bytes"

# 2. Debian's torch 1.13 with the module built against /usr/bin/python3.
if [ -n "${MH_DEBIAN_PYTHONPATH:-}" ] && [ -d "$MH_DEBIAN_PYTHONPATH/tpnorm" ] &&
   /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  b0="$(mh_link_bytes 2)"
  across debian /usr/bin/python3 underscore PYTHONPATH="$MH_DEBIAN_PYTHONPATH"
  b1="$(mh_link_bytes 2)"
  check debian
  echo "debian: torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)'), host 2's link carried $((b1 - b0)) bytes"
  [ $((b1 - b0)) -ge 10000 ] || fail "debian: host 2's link carried only $((b1 - b0)) bytes"
else
  echo "debian: left out (no Debian torch, or the module was not built here)"
fi

# 3. Clean-up.
mh_cleanup
trap 'rm -rf "$log"' EXIT
[ -z "$(ip netns list | awk -v p="$MH_PREFIX-" 'index($1, p) == 1')" ] || fail "namespaces left: $(ip netns list)"
[ -z "$(ls -d /etc/netns/"$MH_PREFIX"-* 2>/dev/null)" ] || fail "/etc/netns entries left"
! pgrep -f -- "--rdzv.id $RDZV_ID" >/dev/null || fail "torchrun processes left: $(pgrep -af -- "--rdzv.id $RDZV_ID")"
echo "clean-up: no namespace, /etc/netns entry or torchrun left"

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "PASS: torchrun across two hosts"
