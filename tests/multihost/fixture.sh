# fixture.sh — test hosts on one machine, sourced by the multi-host tests (needs root).
#
# Each host is a network namespace ($MH_PREFIX-h1, $MH_PREFIX-h2, ...) with its own hostname (a
# UTS namespace kept in $MH_RUN/HOST.uts), one interface eth0 with the address $MH_NET.I/24 and
# an /etc/hosts (ip netns exec's /etc/netns/HOST/hosts) naming only localhost and the
# fixture's hosts. The hosts' eth0 are veth pairs whose other ends (h1, h2, ...) sit on a
# bridge inside a namespace of its own ($MH_PREFIX-br). No namespace has a route anywhere else,
# and the root namespace gets no interface, so nothing a test sends can leave the fixture (and
# two fixtures up at once share no link, so they may use the same addresses).
#
# Names are per run: MH_PREFIX is tpmh-ID, ID this script's process id in hex, so two suites
# (or two tests) on one machine at the same time build separate hosts with separate hostnames,
# and Open MPI's per-host files, named after the hostname, do not collide either. The run's
# owner (its pid and that process's start time) is recorded in $MH_RUN/$MH_PREFIX.owner.
#
# Processes reach a host through mh_exec, and mpirun reaches it through agent.sh, its remote
# agent (--mca plm_rsh_agent): the path of a cluster's ssh, entering the host's namespaces
# instead of logging in. Whatever a run made is removed by mh_cleanup on every exit, also on
# failure and on a signal, and only what that run made; a run killed before its clean-up
# (SIGKILL, a lost machine) is cleaned up by the next run's mh_up, once its owner is gone.

MH_RUN=/run/tpnorm-multihost
MH_ID="$(printf '%x' "$$")"
MH_PREFIX="tpmh-$MH_ID"
MH_NET=10.213.7
MH_BR="$MH_PREFIX-br"
MH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MH_AGENT="$MH_DIR/agent.sh"
MH_HOSTS=()

# mh_start_time PID: the process's start time (field 22 of /proc/PID/stat, after the command's
# parenthesised name), which tells a live owner from a later process given the same pid.
mh_start_time() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  set -- $stat
  echo "${20}"
}

# mh_skip_unless_able: exits 0 with "SKIP: reason" when the fixture cannot be built here.
mh_skip_unless_able() {
  local t
  [ "$(id -u)" -eq 0 ] || { echo "SKIP: the multi-host fixture needs root (network namespaces)"; exit 0; }
  for t in ip unshare nsenter mpirun; do
    command -v "$t" >/dev/null || { echo "SKIP: the multi-host fixture needs $t"; exit 0; }
  done
  ip netns add "$MH_PREFIX-probe" 2>/dev/null ||
    { echo "SKIP: cannot create a network namespace here (ip netns add failed)"; exit 0; }
  ip netns del "$MH_PREFIX-probe"
}

# mh_cleanup [PREFIX]: every process inside the namespaces of run PREFIX (default: this run)
# killed, its namespaces, UTS namespace files, /etc/netns entries and owner record removed.
# Names are matched up to the dash after the run's id, so no other run's objects are touched.
# Safe to run when nothing is there.
mh_cleanup() {
  local p="${1:-$MH_PREFIX}" ns pids f
  for ns in $(ip netns list 2>/dev/null | awk -v p="$p-" 'index($1, p) == 1 {print $1}'); do
    pids="$(ip netns pids "$ns" 2>/dev/null)"
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
  done
  for ns in $(ip netns list 2>/dev/null | awk -v p="$p-" 'index($1, p) == 1 {print $1}'); do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  for f in "$MH_RUN/$p"-*.uts; do
    [ -e "$f" ] || continue
    umount "$f" 2>/dev/null; rm -f "$f"
  done
  rm -f "$MH_RUN/$p.owner" "$MH_RUN/$p-agent.sh"
  # /etc/netns goes when empty (as before any run); $MH_RUN stays: another run may be about to
  # create its files there.
  rmdir /etc/netns 2>/dev/null
  return 0
}

# mh_reap_stale: the leftovers of runs whose owner is gone (killed before their clean-up),
# removed; the objects of runs still going are left alone.
mh_reap_stale() {
  local f pid start
  for f in "$MH_RUN"/tpmh-*.owner; do
    [ -e "$f" ] || continue
    read -r pid start <"$f" 2>/dev/null || continue
    [ "$(mh_start_time "$pid")" = "$start" ] && continue
    mh_cleanup "$(basename "$f" .owner)"
  done
}

# mh_up N: hosts $MH_PREFIX-h1 .. -hN on the bridge; mh_cleanup runs on exit and on signals.
mh_up() {
  local n="$1" i h hosts_file
  mh_reap_stale
  mh_cleanup
  trap 'mh_cleanup' EXIT
  trap 'exit 143' TERM INT HUP
  mkdir -p "$MH_RUN"
  echo "$$ $(mh_start_time $$)" >"$MH_RUN/$MH_PREFIX.owner"
  # mpirun splits its agent's value at spaces (it is a command line: "ssh -x"), so a checkout
  # under a directory with a space gives mpirun a copy of the agent at a path without one.
  cp "$MH_DIR/agent.sh" "$MH_RUN/$MH_PREFIX-agent.sh"
  MH_AGENT="$MH_RUN/$MH_PREFIX-agent.sh"
  ip netns add "$MH_BR"
  ip -n "$MH_BR" link add br0 type bridge
  ip -n "$MH_BR" link set br0 up
  ip -n "$MH_BR" link set lo up
  hosts_file="$(mktemp)"
  # localhost as every node names it (torch < 2.0's torchrun binds a free port on "localhost").
  echo "127.0.0.1 localhost" >"$hosts_file"
  for ((i = 1; i <= n; ++i)); do echo "$MH_NET.$i $MH_PREFIX-h$i" >>"$hosts_file"; done
  for ((i = 1; i <= n; ++i)); do
    h="$MH_PREFIX-h$i"
    ip netns add "$h"
    ip -n "$h" link add eth0 type veth peer name "h$i" netns "$MH_BR"
    ip -n "$h" addr add "$MH_NET.$i/24" dev eth0
    ip -n "$h" link set lo up
    ip -n "$h" link set eth0 up
    ip -n "$MH_BR" link set "h$i" master br0 up
    touch "$MH_RUN/$h.uts"
    unshare --uts="$MH_RUN/$h.uts" hostname "$h"
    mkdir -p "/etc/netns/$h"
    cp "$hosts_file" "/etc/netns/$h/hosts"
    MH_HOSTS+=("$h")
  done
  rm -f "$hosts_file"
  # Nothing routed out: the hosts' only route is their own /24 on the bridge.
  for h in "${MH_HOSTS[@]}"; do
    [ "$(ip -n "$h" route show | grep -vc "^$MH_NET.0/24 dev eth0")" -eq 0 ] ||
      { echo "FAIL: $h has a route off the fixture"; exit 1; }
  done
}

# mh_exec HOST CMD...: CMD inside HOST's namespaces (its hostname, its network, its /etc/hosts).
mh_exec() {
  local h="$1"; shift
  nsenter --uts="$MH_RUN/$h.uts" -- ip netns exec "$h" "$@"
}

# mh_link_bytes I: bytes through host I's link (received + sent at the bridge's end).
mh_link_bytes() {
  local s=/sys/class/net/h$1/statistics
  ip netns exec "$MH_BR" sh -c "echo \$((\$(cat $s/rx_bytes) + \$(cat $s/tx_bytes)))"
}

# mh_link I up|down: host I's link at the bridge.
mh_link() { ip -n "$MH_BR" link set "h$1" "$2"; }

# mh_pids HOST: the processes running inside HOST's network namespace.
mh_pids() { ip netns pids "$1" 2>/dev/null; }

# mh_launch LIMIT HOST ARGS...: `./launch/tpnorm run ARGS...` started on HOST, with the
# fixture's remote agent for the other hosts (what a cluster's ssh does) and without orted's
# tree spawn (each host's daemon started from HOST). Output in $MH_LOG, status in $rc. Past
# LIMIT seconds the job is killed, and so is whatever it left on any host (status 137).
mh_launch() {
  local limit="$1" h="$2"; shift 2
  timeout -s KILL "$limit" nsenter --uts="$MH_RUN/$h.uts" -- ip netns exec "$h" \
    env OMPI_MCA_plm_rsh_agent="$MH_AGENT" OMPI_MCA_plm_rsh_no_tree_spawn=1 \
    "$MH_LAUNCHER" run "$@" >"$MH_LOG" 2>&1
  rc=$?
  [ "$rc" -ne 137 ] || mh_kill_all
}

# mh_kill_all: every process on every host of the fixture killed.
mh_kill_all() {
  local h pids
  for h in "${MH_HOSTS[@]}"; do
    pids="$(mh_pids "$h")"
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
  done
  return 0
}
