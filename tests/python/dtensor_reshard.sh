#!/bin/sh
# dtensor_reshard.sh MPIEXEC PYTHON DIR — a torch.distributed.checkpoint saved at TP = 2 loads
# at TP = 3 and at TP = 1 with the same parameters bit for bit (dtensor_reshard.py; three
# separate MPI jobs, as a user's save and later resumes).
set -eu
mpiexec=$1 python=$2 dir=$3
here=$(dirname "$0")
rm -rf "$dir"
"$mpiexec" -n 2 "$python" "$here/dtensor_reshard.py" save "$dir"
"$mpiexec" -n 3 "$python" "$here/dtensor_reshard.py" load "$dir"
"$mpiexec" -n 1 "$python" "$here/dtensor_reshard.py" load "$dir"
rm -rf "$dir"
