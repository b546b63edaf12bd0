#!/usr/bin/env bash
# slurm.sh — a real two-node Slurm cluster on the fixture's hosts (fixture.sh): one munged,
# slurmctld on the first host and one slurmd per host, their configuration, state and logs in
# a temporary directory; everything killed and removed at the end.
#
#   env MH_LAUNCHER=... MH_ROW=... MH_BENCH=... slurm.sh
#
# 1. sbatch of the job script of docs/multi-node.md (2 nodes, 2 tasks each) runs
#    `./launch/tpnorm run`, which inside the allocation launches with srun --mpi=pmix when
#    Slurm has PMIx (else mpirun): the sharded LayerNorm/RMSNorm test against the float64
#    reference passes on 4 ranks across the two nodes. Then the mpirun fallback: `salloc -N 2
#    -n 4` of `run --launcher mpirun` puts 2 ranks on each node and passes the same test.
# 2. The trap: `srun --mpi=none -n 4` of the benchmark. Each task either initialises MPI alone
#    (a singleton; the benchmark then stops at start, exit 3) or, with an Open MPI that sees it
#    is under Slurm without PMI, fails in MPI_Init. Either way every task must end with an
#    error, never a measurement of a world of 1.
# Needs root; installs Debian's slurmd, slurmctld, slurm-client and munge with apt-get when
# they are missing (as ./launch/tpnorm does for its own dependencies), or skips with the reason.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/fixture.sh"
mh_skip_unless_able
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
   ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmd slurmctld \
      slurm-client munge; } >/dev/null 2>&1 ||
    { echo "SKIP: Slurm and munge are not installed and apt-get could not install them"; exit 0; }
fi
mh_up 2
H1=$MH_PREFIX-h1 H2=$MH_PREFIX-h2
# Outside /tmp: each node gets a /tmp of its own below (Slurm's PMIx plugin and MPI keep
# per-node files there under names that do not include the node).
D="$(mktemp -d -p /run tpnorm-slurm.XXXXXX)" && chmod 755 "$D"  # munged: socket dir searchable
munged_pid=""
stop_all() {
  [ -z "$munged_pid" ] || kill "$munged_pid" 2>/dev/null
  mh_cleanup
  rm -rf "$D"
}
trap stop_all EXIT
fail() {
  echo "FAIL: $*"
  for f in "$D"/*.log "$D"/*.out; do
    [ -f "$f" ] && tail -15 "$f" | sed "s|^|  $(basename "$f") |"
  done
  exit 1
}

# munge: one daemon (in the foreground of its own background job, so that its pid is ours to
# end) with its own key and socket; every host reaches it through the file system.
dd if=/dev/urandom of="$D/munge.key" bs=1024 count=1 status=none && chmod 400 "$D/munge.key"
munged -F --force --socket="$D/munge.sock" --key-file="$D/munge.key" --pid-file="$D/munged.pid" \
  --seed-file="$D/munge.seed" --log-file="$D/munged.log" >/dev/null 2>&1 &
munged_pid=$!

cat >"$D/slurm.conf" <<EOF
ClusterName=tpmh
SlurmctldHost=$H1($MH_NET.1)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$D/munge.sock
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool-%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
NodeName=$H1 NodeAddr=$MH_NET.1 CPUs=2 State=UNKNOWN
NodeName=$H2 NodeAddr=$MH_NET.2 CPUs=2 State=UNKNOWN
PartitionName=tp Nodes=$H1,$H2 Default=YES MaxTime=5 State=UP
EOF
# No cgroup enforcement (proctrack/linuxproc, task/none); slurmd still loads a cgroup plugin,
# and the autodetection does not find this machine's v1 hierarchies under a tmpfs.
printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n' >"$D/cgroup.conf"
mkdir -p "$D/state" "$D/spool-$H1" "$D/spool-$H2"
export SLURM_CONF="$D/slurm.conf"
for ((i = 0; i < 50; ++i)); do [ -S "$D/munge.sock" ] && break; sleep 0.1; done
[ -S "$D/munge.sock" ] || fail "munged did not start"
mh_exec "$H1" slurmctld -D -f "$SLURM_CONF" >/dev/null 2>&1 &
on_h1() { mh_exec "$H1" env SLURM_CONF="$SLURM_CONF" "$@"; }
# The nodes register once the controller answers (a slurmd that finds none retries late).
for ((i = 0; i < 100; ++i)); do on_h1 scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
on_h1 scontrol ping 2>/dev/null | grep -q UP || fail "slurmctld does not answer"
# ip netns exec gives each command a mount namespace of its own (not propagated back), so the
# tmpfs on /tmp is the node's alone and goes with its last process. What the jobs need from
# this machine's /tmp stays visible through it, as a cluster's shared file system would show
# it: a tree under /tmp (the launcher, the programs, the job's directory: a clone or a build
# under /tmp) is bound back at the same path from the /tmp underneath.
keep=()
for p in "$MH_LAUNCHER" "$MH_ROW" "$MH_BENCH" "$PWD"; do
  case "$p" in
    /tmp/*) top="${p#/tmp/}"; top="/tmp/${top%%/*}"
            [[ " ${keep[*]-} " == *" $top "* ]] || keep+=("$top") ;;
  esac
done
[ "${#keep[@]}" -eq 0 ] || echo "kept visible under each node's /tmp: ${keep[*]}"
for h in "$H1" "$H2"; do
  mkdir -p "$D/under-$h"
  mh_exec "$h" sh -c '
    h="$1" conf="$2" under="$3"; shift 3
    mount --bind /tmp "$under" && mount -t tmpfs -o size=256m tpmh-tmp /tmp || exit 1
    for p in "$@"; do
      mkdir -p "$p" && mount --bind "$under/${p#/tmp/}" "$p" || exit 1
    done
    exec slurmd -D -N "$h" -f "$conf"' sh "$h" "$SLURM_CONF" "$D/under-$h" "${keep[@]}" \
    >"$D/slurmd-start-$h.log" 2>&1 &
done
for ((i = 0; i < 120; ++i)); do
  [ "$(on_h1 sinfo -h -t idle -o '%D' 2>/dev/null)" = 2 ] && break
  sleep 0.5
done
[ "$(on_h1 sinfo -h -t idle -o '%D' 2>/dev/null)" = 2 ] ||
  fail "the two nodes are not idle: $(on_h1 sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')"
echo "cluster: $(on_h1 sinfo -h -o '%P %D %T %N')"
pmix=no; on_h1 srun --mpi=list 2>&1 | grep -q pmix && pmix=yes
echo "srun has PMIx: $pmix"

# 1. The job script of docs/multi-node.md, 2 tasks per node (each node has 2 CPUs here).
launcher_q="$(printf '%q' "$MH_LAUNCHER")" row_q="$(printf '%q' "$MH_ROW")"
cat >"$D/job.sh" <<EOF
#!/bin/bash
#SBATCH -N 2
#SBATCH --ntasks-per-node=2
#SBATCH -t 00:02:00
cd "\$SLURM_SUBMIT_DIR"
export TPNORM_TIMEOUT=60
$launcher_q run -n "\$SLURM_NTASKS" $row_q
EOF
on_h1 timeout -s KILL 100 sbatch --wait -D "$(pwd)" -o "$D/job.out" "$D/job.sh" >"$D/sbatch.out" 2>&1
rc=$?
[ "$rc" -eq 0 ] || fail "the sbatch job ended with status $rc"
grep -h "^\[tpnorm\] srun\|^\[tpnorm\] mpirun" "$D/job.out" | head -2
if [ "$pmix" = yes ]; then
  grep -q "srun --mpi=pmix -n 4" "$D/job.out" || fail "the launcher did not use srun --mpi=pmix"
fi
grep -q "^\[  PASSED  \]" "$D/job.out" || fail "the equivalence test did not pass under Slurm"
echo "job: $(grep -m1 "^\[  PASSED  \]" "$D/job.out")"

# 1b. The fallback: salloc -N2 -n4 with `run --launcher mpirun`, mpirun reading the allocation
#     (2 ranks on each node), then the equivalence test the same way.
on_h1 timeout -s KILL 60 salloc -N 2 -n 4 "$MH_LAUNCHER" run --launcher mpirun -n 4 hostname \
  >"$D/placement.out" 2>&1
for h in "$H1" "$H2"; do
  [ "$(grep -cx "$h" "$D/placement.out")" -eq 2 ] ||
    fail "salloc + mpirun: $h runs $(grep -cx "$h" "$D/placement.out") of the 4 ranks, not 2"
done
on_h1 timeout -s KILL 100 salloc -N 2 -n 4 "$MH_LAUNCHER" run --launcher mpirun -n 4 "$MH_ROW" \
  >"$D/salloc.out" 2>&1
rc=$?
[ "$rc" -eq 0 ] || fail "salloc with mpirun ended with status $rc"
grep -h "^\[tpnorm\] mpirun" "$D/salloc.out" | head -1
grep -q "\[  PASSED  \]" "$D/salloc.out" || fail "the equivalence test did not pass with mpirun"
echo "salloc + mpirun: $(grep -m1 -o "\[  PASSED  \].*" "$D/salloc.out" | sed "s/\x1b\[[0-9;]*m//g")"

# 2. The trap: srun without PMIx.
on_h1 timeout -s KILL 60 srun -N 2 -n 4 --mpi=none "$MH_BENCH" -n 1 -w 0 >"$D/trap.out" 2>&1
rc=$?
trap_seen=""
if grep -q "MPI world size is 1 but srun started 4 tasks" "$D/trap.out"; then
  trap_seen="singletons, refused by the benchmark"
elif grep -q "An error occurred in MPI_Init" "$D/trap.out" &&
     grep -q "Exited with exit code [1-9]" "$D/trap.out"; then
  trap_seen="Open MPI fails in MPI_Init on every task"
  grep -m2 -i "PMI" "$D/trap.out" | sed 's/^/  | /'
fi
[ "$rc" -ne 0 ] && [ -n "$trap_seen" ] || fail "srun --mpi=none was not refused (status $rc)"
! grep -q "rmsnorm" "$D/trap.out" || fail "srun --mpi=none measured a world"
echo "srun --mpi=none -n 4: status $rc, $trap_seen"
echo "PASS: sbatch across 2 Slurm nodes passes the equivalence test (srun PMIx: $pmix); srun without PMIx ends with an error on every task ($trap_seen)"
