# support.py — shared by the Python tests: seeded full tensors (the same on every rank), this
# rank's shard of them, tolerance checks as in the C++ tests (|got - want| <= atol + rtol*|want|
# against a float64 reference), and verdicts agreed over all ranks.
#
# The job is an mpirun job (WORLD is MPI.COMM_WORLD) or a torchrun one (RANK and WORLD_SIZE set
# by torchrun, no MPI: WORLD is the same interface over torch.distributed's default group).
import os

import torch

TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ


class _TorchWorld:
    """The part of an mpi4py communicator the tests use, over the default torch group."""

    rank = int(os.environ.get("RANK", 0))
    size = int(os.environ.get("WORLD_SIZE", 1))

    def allgather(self, obj):
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


if TORCHRUN:
    WORLD = _TorchWorld()
else:
    from mpi4py import MPI

    WORLD = MPI.COMM_WORLD

# Relative tolerance of one rounding to the storage dtype (tests/support/storage.h).
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def full(seed, *shape, scale=1.0, shift=0.0, dtype=torch.float32):
    """A seeded tensor, identical on every rank, rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def cols(t, rank, size, dim=-1):
    """This rank's slice of dimension `dim` (shard_range split), contiguous."""
    n = t.shape[dim]
    lo, hi = n * rank // size, n * (rank + 1) // size
    return t.narrow(dim, lo, hi - lo).contiguous()


def wrong(name, got, want, atol, rtol, report):
    """Elements out of tolerance (NaN counts); appends a line to `report` when any."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        report.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return 1
    err = (got - want).abs()
    bad = ~(err <= atol + rtol * want.abs())
    n = int(bad.sum())
    if n:
        report.append(f"{name}: {n} of {got.numel()} out of tolerance, max err "
                      f"{float(err.max()):.3g} (atol {atol:.3g}, rtol {rtol:.3g})")
    return n


def max_rel_err(got, want):
    """max |got - want| / max |want| (0 for empty tensors): the figure the tests print."""
    if want.numel() == 0:
        return 0.0
    d = (got.detach().double() - want.detach().double()).abs().max()
    return float(d / want.detach().double().abs().max().clamp_min(1e-300))


def agree(local_ok, report=()):
    """True on every rank iff `local_ok` on every rank; the failing ranks' lines are gathered
    so the assertion message on every rank says what failed where."""
    reports = WORLD.allgather((WORLD.rank, bool(local_ok), list(report)))
    lines = [f"rank {r}: {line}" for r, ok, rep in reports for line in rep]
    return all(ok for _, ok, _ in reports), "\n".join(lines)


def assert_everywhere(local_ok, report=()):
    ok, lines = agree(local_ok, report)
    assert ok, lines
