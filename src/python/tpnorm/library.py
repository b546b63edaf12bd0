"""torch.library registration for torch.compile (torch >= 2.4 only; torch 1.13 has neither
torch.compile nor torch.library.custom_op, and then this module registers nothing).

The ops tpnorm::layer_norm and tpnorm::rms_norm take the communicator as an integer handle
(tensors and scalars only may cross a custom op) and have fake implementations (shapes only)
and registered autograd, so torch.compile(fullgraph=True) traces a model that calls
layer_norm_op / rms_norm_op. The handle table keeps each communicator alive.
"""
import torch

from . import _tpnorm as _C
from . import functional as F

_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
AVAILABLE = _version >= (2, 4) and hasattr(torch.library, "custom_op")
REASON = None if AVAILABLE else f"torch {torch.__version__} < 2.4 has no torch.library.custom_op"

_comms = []


def comm_handle(comm):
    """The integer handle of ``comm`` for the ops below (registered once)."""
    for i, c in enumerate(_comms):
        if c is comm:
            return i
    _comms.append(comm)
    return len(_comms) - 1


if AVAILABLE:
    @torch.library.custom_op("tpnorm::row_norm_fwd", mutates_args=())
    def _row_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, handle: int,
                      eps: float, centered: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
        rows = F._rows(x)
        y = F._empty(x.shape, x)
        mean = F._empty((rows,), x, torch.float32)
        rstd = F._empty((rows,), x, torch.float32)
        opt = F.norm_options(eps)
        b = bias if bias.numel() else None
        if centered:
            _C.layer_norm_forward(_comms[handle], x, weight, b, y, mean, rstd, opt)
        else:
            _C.rms_norm_forward(_comms[handle], x, weight, y, rstd, opt)
            mean.zero_()
        return y, mean, rstd

    @_row_norm_fwd.register_fake
    def _(x, weight, bias, handle, eps, centered):
        rows = F._rows(x)
        return (torch.empty_like(x), x.new_empty((rows,), dtype=torch.float32),
                x.new_empty((rows,), dtype=torch.float32))

    @torch.library.custom_op("tpnorm::row_norm_bwd", mutates_args=())
    def _row_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      mean: torch.Tensor, rstd: torch.Tensor, handle: int, eps: float,
                      centered: bool, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
        dx = F._empty(x.shape, x)
        dw = F._empty(weight.shape, weight)
        db = F._empty(weight.shape, weight) if has_bias else weight.new_empty((0,))
        opt = F.norm_options(eps)
        if centered:
            _C.layer_norm_backward(_comms[handle], dy.contiguous(), x, weight, mean, rstd, dx,
                                   dw, db if has_bias else None, opt)
        else:
            _C.rms_norm_backward(_comms[handle], dy.contiguous(), x, weight, rstd, dx, dw, opt)
        return dx, dw, db

    @_row_norm_bwd.register_fake
    def _(dy, x, weight, mean, rstd, handle, eps, centered, has_bias):
        return (torch.empty_like(x), torch.empty_like(weight),
                torch.empty_like(weight) if has_bias else weight.new_empty((0,)))

    def _setup(ctx, inputs, output):
        x, weight, bias, handle, eps, centered = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.handle, ctx.eps, ctx.centered, ctx.has_bias = handle, eps, centered, bias.numel() > 0

    def _backward(ctx, dy, dmean, drstd):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _row_norm_bwd(dy, x, weight, mean, rstd, ctx.handle, ctx.eps,
                                   ctx.centered, ctx.has_bias)
        return dx, dw, (db if ctx.has_bias else None), None, None, None

    _row_norm_fwd.register_autograd(_backward, setup_context=_setup)


def layer_norm_op(x, weight, bias, handle, eps=1e-5):
    """tpnorm::row_norm_fwd as LayerNorm (weight required; bias may be None)."""
    if not AVAILABLE:
        raise RuntimeError(f"tpnorm.library: {REASON}")
    b = bias if bias is not None else weight.new_empty((0,))
    return _row_norm_fwd(x, weight, b, handle, eps, True)[0]


def rms_norm_op(x, weight, handle, eps=1e-5):
    """tpnorm::row_norm_fwd as RMSNorm (weight required)."""
    if not AVAILABLE:
        raise RuntimeError(f"tpnorm.library: {REASON}")
    return _row_norm_fwd(x, weight, weight.new_empty((0,)), handle, eps, False)[0]
