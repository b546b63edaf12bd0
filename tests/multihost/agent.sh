#!/bin/sh
# agent.sh HOST COMMAND... — mpirun's remote agent (--mca plm_rsh_agent) for the fixture's
# hosts (fixture.sh): ssh's calling convention, COMMAND run by a shell inside HOST's
# namespaces (its hostname, network and /etc/hosts) instead of on a remote machine. As with
# ssh, the command runs detached (setsid) on that host and this agent is only its local
# client: killing the agent (or mpirun with it) does not reach the host's processes.
host="$1"; shift
nsenter --uts="/run/tpnorm-multihost/$host.uts" -- ip netns exec "$host" setsid sh -c "$*" &
wait $!
