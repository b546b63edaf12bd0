"""Communicators: the group of ranks a tpnorm op sums its packed statistics over.

``as_communicator(group)`` accepts what a PyTorch job already has:

* ``None``: the default ``torch.distributed`` group when one is initialised, else one process;
* a ``torch.distributed`` ProcessGroup (gloo, mpi, ...): host buffers are summed by the group's
  ``all_reduce`` on a tensor that shares the packed buffer's memory (DLPack, no copy); an NCCL
  group instead bootstraps tpnorm's own NCCL communicator through it (see ``from_nccl_group``);
* an ``mpi4py.MPI.Comm``: its Fortran handle goes to tpnorm's MPI communicator (MPI_Comm_f2c);
* a ``tpnorm.Communicator`` (returned as is).
"""
import atexit
import gc

from . import _tpnorm as _C

Communicator = _C.Communicator

# Every communicator made here gets an integer handle when it is made (never while
# torch.compile traces a call that uses it): the torch.library ops take the handle.
_comms = []
_handles = {}


# The torch process groups that communicators made here hold, released at exit (_release).
_held_groups = []


def _release():
    """Lets go of every process group a communicator holds before the interpreter shuts down.
    A communicator (in _comms, or a module at global scope) outlives the script; the group it
    held was then destroyed during finalization, after parts of torch, where gloo's destructor
    could end the process in std::terminate after a correct run. No op runs after this.
    The collection frees what only reference cycles still hold (a model's DTensors, a device
    mesh), groups among them, while the interpreter is whole; a gloo group freed during
    finalization can have a worker thread release a tensor's Python object then, which
    std::terminates too (torch's Python-object release racing finalization)."""
    for held in _held_groups:
        held[:] = [None] * len(held)
    _held_groups.clear()
    gc.collect()


atexit.register(_release)


def handle_of(comm):
    """The integer handle of the tpnorm Communicator ``comm`` (the table keeps it alive)."""
    h = _handles.get(id(comm))
    if h is None or _comms[h] is not comm:
        _comms.append(comm)
        h = _handles[id(comm)] = len(_comms) - 1
    return h


_addresses = {}


def address_of(comm):
    """The address of the tpnorm Communicator ``comm`` for tpnorm._autograd (registered, so
    alive as long as the process, as handle_of's)."""
    a = _addresses.get(id(comm))
    if a is None or a[0] is not comm:
        handle_of(comm)
        a = _addresses[id(comm)] = (comm, _C.address_of(comm))
    return a[1]


def _registered(comm):
    handle_of(comm)
    return comm


def single():
    """A communicator of one process (all_reduce_sum is the identity)."""
    return _registered(_C.single_communicator())


def from_mpi4py(comm):
    """tpnorm's MPI communicator over an ``mpi4py.MPI.Comm`` (collective over ``comm``)."""
    return _registered(_C.mpi_communicator(comm.py2f()))


def from_process_group(group=None):
    """A host communicator over a ``torch.distributed`` group (default: the world group).

    Every all_reduce_sum of an op becomes one ``torch.distributed.all_reduce`` of the group on a
    CPU tensor viewing tpnorm's packed buffer; it blocks until the sum is done.
    """
    import torch.distributed as dist
    from torch.utils.dlpack import from_dlpack

    if group is None:
        group = dist.group.WORLD
    # [the group, the last buffer's tensor]. The tensor is kept from Python until the next call
    # (or exit): gloo's worker thread lets go of a finished work's tensors a moment after the
    # caller returns, and if that were the tensor's last reference the worker would need the
    # GIL to free its Python object, which at interpreter exit ends in std::terminate.
    held = [group, None]
    _held_groups.append(held)

    def all_reduce(capsule):
        t = from_dlpack(capsule)
        dist.all_reduce(t, group=held[0])
        held[1] = t

    return _registered(_C.callback_communicator(dist.get_rank(group), dist.get_world_size(group),
                                                all_reduce))


def from_nccl_group(group=None, device=None, stream=None):
    """tpnorm's NCCL communicator for CUDA tensors, bootstrapped through ``group``.

    The group's rank 0 makes an ncclUniqueId, the group broadcasts it, and every rank joins an
    NCCL communicator of its own on ``device`` (default: torch.cuda.current_device()) that runs
    on ``stream`` (default: torch.cuda.current_stream() at this call).
    """
    import torch
    import torch.distributed as dist

    if not _C.has_nccl():
        raise RuntimeError("tpnorm: this build has no NCCL backend")
    if group is None:
        group = dist.group.WORLD
    device = torch.cuda.current_device() if device is None else int(device)
    stream = torch.cuda.current_stream(device) if stream is None else stream
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    uid = _C.nccl_unique_id() if rank == 0 else bytes(128)
    on = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    buf = torch.tensor(list(uid), dtype=torch.uint8, device=on if on == "cpu" else device)
    global_rank = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    src = 0 if group is dist.group.WORLD else global_rank(group, 0)
    dist.broadcast(buf, src=src, group=group)
    return _registered(_C.nccl_communicator(bytes(buf.cpu().tolist()), rank, size, device,
                                            stream.cuda_stream))


# as_communicator's communicators: one per (group, device), made on first use and kept (with
# the group, so that its id is never reused) for the life of the process. Making one per call
# would cost a communicator's set-up on every call (over mpi4py an MPI_Comm_dup and a
# shared-memory window, over NCCL an ncclCommInitRank), leak what it holds, and keep every call
# in the strict mode of a new communicator's first calls.
_cache = {}
atexit.register(_cache.clear)  # before finalization, with the groups (see _release)


def _cached(key, group, make):
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = (group, make())
    return hit[1]


def local(device=None):
    """This process's own communicator of one rank for tensors on ``device`` (None or CPU: the
    host one; a CUDA device: one on that GPU, on its current stream when first made), one object
    each, made on first use: for calls that sum nothing across processes (a DTensor whose row is
    whole on every rank, a SyncBatchNorm in eval)."""
    import torch

    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return _cached(("single",), None, single)
    import torch.cuda

    index = torch.cuda.current_device() if device.index is None else device.index
    return _cached(("cuda single", index), None, lambda: _registered(
        _C.cuda_single_communicator(index, torch.cuda.current_stream(index).cuda_stream)))


def as_communicator(group=None):
    """The tpnorm communicator for ``group`` (see the module documentation): made on the first
    call for a group (collective over it where the group's kind needs it: mpi4py's, NCCL's)
    and the same object on every later call, one per (group, CUDA device) for NCCL groups."""
    if isinstance(group, Communicator):
        return group
    if group is not None and hasattr(group, "py2f"):
        return _cached(("mpi4py", id(group)), group, lambda: from_mpi4py(group))
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return local()
    pg = dist.group.WORLD if group is None else group
    if dist.get_backend(pg) == "nccl":
        import torch

        device = torch.cuda.current_device()
        return _cached(("nccl", id(pg), device), pg, lambda: from_nccl_group(pg, device))
    if dist.get_world_size(pg) == 1:  # a group of one sums nothing: no c10d call at all
        return local()
    return _cached(("group", id(pg)), pg, lambda: from_process_group(pg))
