"""tpnorm: normalization layers whose statistics span several processes, for PyTorch.

Tensors cross into the C++ library through DLPack with no copy; every op makes one collective
over a communicator made from a torch.distributed group, an mpi4py communicator, or one
process (see tpnorm.comm). Errors are tpnorm.Error (a RuntimeError with .code), raised on every
rank of the call together.
"""
from . import _tpnorm as _C
from .comm import (Communicator, as_communicator, from_mpi4py, from_nccl_group,
                   from_process_group, single)
from .functional import (deepnorm_alpha, deepnorm_beta, fused_add_layer_norm,
                         fused_add_rms_norm, group_norm, instance_norm, layer_norm, rms_norm,
                         rms_norm_gated, shard_range, sync_batch_norm)
# The row norms of tpnorm.dtensor: those of .functional, also taking DTensors (torch >= 2.5).
from .dtensor import (fused_add_layer_norm, fused_add_rms_norm, layer_norm, rms_norm,  # noqa: F811
                      rms_norm_gated)
from .modules import (FusedAddLayerNorm, FusedAddRMSNorm, ShardedGroupNorm,
                      ShardedInstanceNorm, ShardedLayerNorm, ShardedRMSNorm, ShardedRMSNormGated,
                      SyncBatchNorm, SyncBatchNormAct)
from .batched import batched_row_norm
from . import parallel  # HiddenShardedNorm and QKNormPair, ParallelStyles (torch >= 2.5)
from . import library  # torch.library registration where torch >= 2.4 (else a no-op)

Error = _C.Error
# An invalid argument (Error.code == tpnorm._tpnorm.INVALID_ARGUMENT), also a ValueError: where
# torch's own layers raise ValueError for a bad input, tpnorm's do too.
InvalidArgumentError = _C.InvalidArgumentError
__version__ = "0.1.0"
