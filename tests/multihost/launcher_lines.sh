#!/usr/bin/env bash
# launcher_lines.sh — what `./launch/tpnorm run` executes, checked without a cluster: an
# mpirun and an srun on PATH that only write down the argument vector and the environment
# they were started with, so every check reads the exact command the launcher would run.
#
#   launcher_lines.sh LAUNCHER
#
# Covers: what run adds only when needed (oversubscription past the cores, no binding for
# several threads per rank, run-as-root only as root); -np as -n; -H/--host, -N, -x passed through; --mpirun-args keeping quoted values;
# inside Slurm, srun for the flags it honours and an error naming each flag it cannot honour;
# mpirun inside Slurm when srun has no PMIx; bench's --hosts / --hostfile; the same flags
# spelled for MPICH's Hydra mpiexec (TPNORM_MPIEXEC), with none of Open MPI's options.
set -uo pipefail
LAUNCHER="$1"
dir="$(mktemp -d)"; trap 'rm -rf "$dir"' EXIT
mkdir "$dir/bin"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The recorders: argv one word per line in $dir/argv, the variables the ranks would see in
# $dir/env. srun --mpi=list answers with pmix only when FAKE_SRUN_PMIX=1; --version answers
# as Open MPI's mpirun and Hydra's mpiexec do (the launcher picks its options by it).
for tool in mpirun srun mpiexec.hydra; do
  cat >"$dir/bin/$tool" <<EOF
#!/usr/bin/env bash
if [ "$tool" = srun ] && [ "\${1:-}" = --mpi=list ]; then
  echo "MPI plugin types are..."; echo "	none"
  [ "\${FAKE_SRUN_PMIX:-0}" = 1 ] && echo "	pmix"
  exit 0
fi
if [ "\${1:-}" = --version ]; then
  [ "$tool" = mpirun ] && echo "mpirun (Open MPI) 4.1.4"
  [ "$tool" = mpiexec.hydra ] && printf 'HYDRA build details:\n    Version: 4.0.2\n'
  exit 0
fi
printf '%s\n' "$tool" "\$@" >"$dir/argv"
env >"$dir/env"
EOF
  chmod +x "$dir/bin/$tool"
done

# launch ARGS...: runs the launcher with the recorders first on PATH; its status in $rc, its
# messages in $dir/log, the recorded argv as one line of words in $argv (word_is checks one
# word exactly, spaces included).
launch() {
  rm -f "$dir/argv" "$dir/env"
  env PATH="$dir/bin:$PATH" "$LAUNCHER" run "$@" >"$dir/log" 2>&1; rc=$?
  argv=""
  [ -f "$dir/argv" ] && argv="$(tr '\n' ' ' <"$dir/argv")"
  return 0
}
has() { [[ " $argv" == *" $1 "* ]]; }
lacks() { [[ " $argv" != *" $1 "* ]]; }
word_is() { grep -qxF -- "$1" "$dir/argv" 2>/dev/null; }
env_is() { grep -qx "$1" "$dir/env" 2>/dev/null; }

cores="$(lscpu -p=core,socket 2>/dev/null | grep -v "^#" | sort -u | wc -l)"
[ "$cores" -ge 1 ] || cores="$(nproc)"
unset SLURM_JOB_ID OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
      OMPI_MCA_rmaps_base_oversubscribe OMP_NUM_THREADS TPNORM_LAUNCHER

# Within the cores at one thread per rank, no placement changes; several OpenMP threads per
# rank, no binding (mpirun would bind them all to one core); past the cores, oversubscription
# and no binding; each printed with its reason.
OMP_NUM_THREADS=1 launch -n 1 true
[ "$rc" -eq 0 ] || fail "-n 1: exit $rc: $(cat "$dir/log")"
lacks --oversubscribe && lacks --bind-to || fail "-n 1, 1 thread, on $cores cores: $argv"
has "-n 1" || fail "-n 1 not passed: $argv"
OMP_NUM_THREADS=2 launch -n 1 true
lacks --oversubscribe && has "--bind-to none" && grep -q "(2 threads per rank)" "$dir/log" ||
  fail "-n 1, 2 threads: $argv: $(cat "$dir/log")"
launch -np $((cores + 1)) true
has "--oversubscribe --bind-to none" || fail "-np $((cores + 1)) on $cores cores: $argv"
grep -q -- "adds: --oversubscribe --bind-to none ($((cores + 1)) ranks > $cores cores)" "$dir/log" ||
  fail "not printed: $(cat "$dir/log")"
has "-n $((cores + 1))" || fail "-np not passed as -n: $argv"
# Named hosts bring their own slots: nothing added even past this machine's cores.
launch -n $((cores + 1)) --hosts ha:$((cores + 1)) true
lacks --oversubscribe || fail "--hosts: oversubscribed: $argv"
has "--host ha:$((cores + 1))" || fail "--hosts not passed: $argv"

# The run-as-root settings exactly when root.
launch -n 1 true
if [ "$(id -u)" -eq 0 ]; then
  env_is OMPI_ALLOW_RUN_AS_ROOT=1 && grep -q 'OMPI_ALLOW_RUN_AS_ROOT=1' "$dir/log" ||
    fail "root: run-as-root not set and printed"
  # The same launcher as an unprivileged user sets nothing of the kind.
  if command -v setpriv >/dev/null && id nobody >/dev/null 2>&1; then
    chmod 755 "$dir" "$dir/bin"
    rm -f "$dir/argv" "$dir/env"
    chmod 777 "$dir"
    env PATH="$dir/bin:$PATH" HOME=/tmp setpriv --reuid=nobody --regid=nogroup --clear-groups \
      "$LAUNCHER" run -n 1 true >"$dir/log" 2>&1
    [ -f "$dir/env" ] && ! grep -q '^OMPI_ALLOW_RUN_AS_ROOT' "$dir/env" &&
      ! grep -q OMPI_ALLOW_RUN_AS_ROOT "$dir/log" || fail "nobody: run-as-root set: $(cat "$dir/log")"
  fi
else
  ! env_is OMPI_ALLOW_RUN_AS_ROOT=1 || fail "not root: run-as-root set"
fi

# Pass-through: -H/--host (joined), -N, -x VAR and -x VAR=VALUE.
export TPNORM_LINES_A=from-shell
launch -n 4 -H ha:2 --host hb:2 -N 2 -x TPNORM_LINES_A -x LINES_B=set-here true
has "--host ha:2,hb:2" || fail "-H/--host: $argv"
has "-N 2" || fail "-N: $argv"
has "-x TPNORM_LINES_A" && has "-x LINES_B" || fail "-x: $argv"
env_is LINES_B=set-here || fail "-x LINES_B=set-here not in the environment"
launch -n 1 -x UNSET_LINES_VAR true
[ "$rc" -eq 2 ] && grep -q 'UNSET_LINES_VAR is not set' "$dir/log" || fail "-x of an unset var: $rc"

# --mpirun-args as a shell splits it: quoted values stay one word, nothing is expanded.
launch -n 1 --mpirun-args "--mca plm_rsh_args '-o Opt=a b' --tag-output \"\$HOME\"" true
has "--mca plm_rsh_args -o Opt=a b --tag-output \$HOME" && word_is "-o Opt=a b" &&
  word_is '$HOME' || fail "--mpirun-args: $argv"
launch -n 1 --mpirun-args "--mca x 'unbalanced" true
[ "$rc" -eq 2 ] && [ -z "$argv" ] || fail "--mpirun-args with an open quote: exit $rc, ran '$argv'"
launch -n 1 --transport tcp true
has "--mca pml ob1 --mca btl tcp,self" || fail "--transport tcp: $argv"
launch -n 1 --bind-to core true
[ "$rc" -eq 2 ] && grep -q 'unknown option --bind-to' "$dir/log" || fail "unknown option: $rc"

# Inside Slurm with PMIx: srun, with the flags translated or refused by name.
export SLURM_JOB_ID=1 FAKE_SRUN_PMIX=1
launch -n 4 -N 2 -x LINES_B=s --transport tcp true
[[ "$argv" == "srun --mpi=pmix -n 4 --ntasks-per-node=2 true " ]] || fail "srun line: $argv"
env_is LINES_B=s && env_is OMPI_MCA_btl=tcp,self && env_is TPNORM_WORLD_SIZE=4 ||
  fail "srun environment lacks -x / transport / world size"
for flags in "--hosts ha:2" "-H ha:2" "--hostfile /dev/null" "--mpirun-args --tag-output"; do
  read -r -a f <<<"$flags"
  launch -n 2 "${f[@]}" true
  [ "$rc" -eq 2 ] && [ -z "$argv" ] && grep -q "srun cannot honour ${f[0]}" "$dir/log" ||
    fail "srun with $flags: exit $rc, ran '$argv': $(cat "$dir/log")"
done
# --launcher mpirun inside the allocation takes every flag.
launch -n 2 --launcher mpirun --hosts ha:2 true
[[ "$argv" == mpirun* ]] && has "--host ha:2" || fail "--launcher mpirun in Slurm: $argv"
# Without PMIx in srun: mpirun, which reads the allocation.
FAKE_SRUN_PMIX=0 launch -n 2 true
[[ "$argv" == mpirun* ]] || fail "Slurm without PMIx: $argv"
unset SLURM_JOB_ID FAKE_SRUN_PMIX

# MPICH's Hydra: nothing of Open MPI's (no --oversubscribe, --bind-to, -x, run-as-root, --mca),
# the environment by -genv VAR VALUE, hosts by -hosts / -f, K per host by -ppn; --transport tcp
# (Open MPI's TCP transport) refused.
export TPNORM_MPIEXEC="$dir/bin/mpiexec.hydra"
unset OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM
launch -n $((cores + 2)) -N 2 --hosts ha:2,hb:2 -x LINES_B=set-here -x TPNORM_LINES_A true
[[ "$argv" == "mpiexec.hydra "* ]] || fail "Hydra: not run: $argv"
lacks --oversubscribe && lacks --bind-to && lacks -x && lacks --mca && lacks --host ||
  fail "Hydra: an Open MPI option: $argv"
has "-genv TPNORM_WORLD_SIZE $((cores + 2))" && has "-genv TPNORM_LINES_A from-shell" &&
  has "-genv LINES_B set-here" && has "-genv OMP_NUM_THREADS 1" || fail "Hydra: -genv: $argv"
has "-ppn 2" && has "-hosts ha:2,hb:2" && has "-n $((cores + 2)) true" || fail "Hydra: hosts: $argv"
! env_is OMPI_ALLOW_RUN_AS_ROOT=1 && ! grep -q OMPI_ALLOW "$dir/log" || fail "Hydra: run-as-root set"
grep -q "mpiexec.hydra -n $((cores + 2)) adds: OMP_NUM_THREADS=1 -genv OMP_NUM_THREADS 1" "$dir/log" ||
  fail "Hydra: not printed: $(cat "$dir/log")"
launch -n 2 --hostfile /dev/null true
has "-f /dev/null" || fail "Hydra: --hostfile: $argv"
OMP_NUM_THREADS=2 launch -n $((cores + 1)) true
lacks --oversubscribe && lacks --bind-to && has "-genv OMP_NUM_THREADS 2" ||
  fail "Hydra: past the cores, 2 threads: $argv"
launch -n 2 --transport tcp true
[ "$rc" -eq 2 ] && [ -z "$argv" ] && grep -q "Open MPI's TCP transport only" "$dir/log" ||
  fail "Hydra: --transport tcp: exit $rc, ran '$argv'"
unset TPNORM_MPIEXEC

# bench takes the hosts too (its flags are checked before anything is built: a bad flag after
# --hosts is the first complaint, so --hosts itself was taken).
out="$("$LAUNCHER" bench --hosts ha:1,hb:1 --hostfile /dev/null --no-such-flag 2>&1)"; rc=$?
[ "$rc" -eq 2 ] && [[ "$out" == *"unknown flag --no-such-flag"* ]] || fail "bench --hosts: $rc: $out"
out="$("$LAUNCHER" bench --hosts 2>&1)"; rc=$?
[ "$rc" -eq 2 ] && [[ "$out" == *"--hosts needs a value"* ]] || fail "bench --hosts without value: $out"

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "PASS: launcher command lines"
