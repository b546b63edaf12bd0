# conftest.py — every test runs on every rank of an mpirun job (world sizes 1-4): MPI through
# mpi4py, and a gloo torch.distributed group over the same ranks (its TCP rendezvous port is
# chosen by rank 0 and broadcast over MPI). A test's verdict is agreed over all ranks
# (support.agree), so a failure fails the test on every rank and no rank runs ahead into a
# collective the others never join. Under torchrun (support.TORCHRUN) the group comes from
# torchrun's env:// rendezvous and there is no MPI.
import datetime
import socket

import pytest
import torch
import torch.distributed as dist

import tpnorm
from support import TORCHRUN, WORLD


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_configure(config):
    torch.set_num_threads(1)  # ranks share the cores
    if TORCHRUN:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        return
    world = WORLD
    port = world.bcast(_free_port() if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size, timeout=datetime.timedelta(seconds=120))


def pytest_unconfigure(config):
    if dist.is_initialized():
        dist.barrier()  # as the examples end (examples/python/tensor_parallel.py says why)
        dist.destroy_process_group()


def pytest_report_header(config):
    return (f"tpnorm: rank {WORLD.rank} of {WORLD.size}, torch "
            f"{torch.__version__}, torch.library ops: "
            f"{'on' if tpnorm.library.AVAILABLE else tpnorm.library.REASON}")


@pytest.fixture(params=["gloo"] if TORCHRUN else ["gloo", "mpi4py"])
def comm(request):
    """A fresh tpnorm communicator over all ranks: the gloo group's all_reduce, or MPI."""
    if request.param == "gloo":
        return tpnorm.from_process_group(dist.group.WORLD)
    return tpnorm.from_mpi4py(WORLD)
