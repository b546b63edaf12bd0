"""What a norm module computes, for the ParallelStyles of tpnorm.parallel.

torch's nn.LayerNorm / nn.RMSNorm say it by their class. Model libraries define their own: HF
transformers has an RMSNorm class per model (Olmo2RMSNorm, OlmoeRMSNorm, MiniMaxM2RMSNorm, ...),
each with a 1-D ``weight`` and an ``eps`` or ``variance_epsilon``, computing in float32 and
casting back to the input's dtype at one of two points:

    weight in float32   (self.weight * h).to(input_dtype)      OLMo 2, OLMo 3, FlexOlmo, T5
    weight after cast   self.weight * h.to(input_dtype)        Llama, OLMoE, MiniMax-M2, Qwen

The two differ in low precision (the second rounds twice, and with a float32 weight returns
float32). ``numerics(module)`` finds out which formula a module computes by running its own
forward once on a seeded probe (float32 for the formula, bfloat16 for the cast point), so any
class with that shape is taken without a list of names, and one that computes something else
(Gemma's (1 + weight), a norm over several dims) is refused, on every rank alike (the probe is
deterministic), before anything is sharded.
"""
import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Numerics:
    centered: bool         # LayerNorm (mean subtracted) or RMSNorm
    weight_after_cast: bool  # y = weight * norm(x).to(x.dtype), else norm(x) * weight in float32
    has_bias: bool


def hidden_size(module):
    """The normalized (last) dimension's full size of a supported norm module."""
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        return int(tuple(shape)[-1])
    return int(module.weight.shape[-1])


def eps_of(module):
    for name in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, name, None)
        if v is not None:
            return float(v)
    return None


_TORCH = {}  # the classes of torch.nn: their formula is their class


def _torch_numerics(cls):
    if issubclass(cls, nn.LayerNorm):
        return "layer"
    if hasattr(nn, "RMSNorm") and issubclass(cls, nn.RMSNorm):
        return "rms"
    return None


def numerics(module):
    """The module's Numerics; raises NotImplementedError (what it found) when the module is not
    a LayerNorm / RMSNorm over its last dimension with a 1-D weight."""
    cls = type(module)
    kind = _torch_numerics(cls)
    if kind is not None:
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"tpnorm.parallel: normalized_shape {shape} has more than one "
                             "dimension")
        return Numerics(kind == "layer", False, getattr(module, "bias", None) is not None)
    name = cls.__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise NotImplementedError(f"tpnorm.parallel: {name} has no 1-D weight; the style "
                                  "takes nn.LayerNorm, nn.RMSNorm and classes computing "
                                  "either over the last dimension with a 1-D weight")
    if eps_of(module) is None:
        raise NotImplementedError(f"tpnorm.parallel: {name} has no eps / variance_epsilon")
    bias = getattr(module, "bias", None)
    has_bias = isinstance(bias, torch.Tensor)
    return _probe(module, weight.shape[0], has_bias, name)


def _run(module, H, has_bias, x, seed):
    """The module's own forward on x with seeded float32 parameters in place of its own (so
    that a model still holding ones, or living on the meta device, probes alike)."""
    g = torch.Generator().manual_seed(seed)
    probe = copy.copy(module)  # shallow: its own parameter dict, the module's untouched
    probe._parameters = dict(module._parameters)
    probe._buffers = {k: None if v is None else v.detach().clone()  # a BatchNorm updates its own
                      for k, v in module._buffers.items()}
    probe._parameters["weight"] = nn.Parameter(
        1 + 0.5 * torch.randn(H, generator=g), requires_grad=False)
    if has_bias:
        probe._parameters["bias"] = nn.Parameter(0.5 * torch.randn(H, generator=g),
                                                 requires_grad=False)
    with torch.no_grad():
        return type(module).forward(probe, x), probe


def _probe(module, H, has_bias, name):
    g = torch.Generator().manual_seed(1)
    x = 2 * torch.randn(4, H, generator=g) + 3  # an offset mean: LayerNorm != RMSNorm
    try:
        y, probe = _run(module, H, has_bias, x, 0)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign forward is a refusal
        raise NotImplementedError(f"tpnorm.parallel: {name}'s forward failed on a probe "
                                  f"[4, {H}] float32 input ({type(e).__name__}: {e})") from e
    w = probe._parameters["weight"].double()
    b = probe._parameters["bias"].double() if has_bias else 0
    eps = eps_of(module)
    xd = x.double()
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w
    c = xd - xd.mean(-1, keepdim=True)
    layer = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w + b
    found = None
    for centered, want in ((False, rms), (True, layer)):
        if y.shape == x.shape and torch.allclose(y.double(), want, rtol=1e-4, atol=1e-5):
            found = centered
    if found is None or (found is False and has_bias):
        raise NotImplementedError(f"tpnorm.parallel: {name} computes neither "
                                  "x / rms(x) * weight nor LayerNorm(x) * weight (+ bias) over "
                                  "the last dimension (checked on a probe input)")
    # The cast point: a float32 weight on a bfloat16 input gives float32 when the weight
    # multiplies after the cast (type promotion), bfloat16 when the product is cast.
    y16, _ = _run(module, H, has_bias, x.bfloat16(), 0)
    return Numerics(found, y16.dtype == torch.float32, has_bias)
