"""FP8 matmuls of the PyTorch reference (``compute.fp8``): the same quantisation as
:mod:`jaxmoe.model.fp8`, written independently in torch (``torch.float8_e4m3fn``).

Each GEMM operand is scaled by ``448 / amax`` (``57344 / amax`` for tensorwise's e5m2
gradients) over its scaling group (1 where amax is 0; amax
clamped to >= 1e-12; rounded down to a power of two for rowwise), clipped to +-448, rounded to e4m3,
dequantised (``q * (1 / scale)``) and multiplied in fp32. Groups, per recipe, for a GEMM contracting K:
tensorwise = the whole operand; rowwise = one row along K; blockwise = 1x128 tiles along K for
activations and gradients, 128x128 blocks for weights. The backward quantises ``grad_output`` with
the same rules (e4m3; e5m2 under tensorwise, as torchao's default recipe). The router and the LM head stay out (see
``torch_ref.transformer``), as in jaxmoe.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0  # tensorwise's gradient format (torchao's default recipe: grad_output in e5m2)
BLOCK = 128
AMAX_EPS = 1e-12
_RECIPE = contextvars.ContextVar("torch_ref_fp8", default="none")


def current() -> str:
    return _RECIPE.get()


@contextlib.contextmanager
def using(recipe: str):
    token = _RECIPE.set(recipe)
    try:
        yield
    finally:
        _RECIPE.reset(token)


def _tile(recipe: str, shape, contract: int, weight: bool) -> tuple[int, int]:
    r, c = shape
    if recipe == "tensorwise":
        return r, c
    if recipe == "rowwise":
        return (1, c) if contract == 1 else (r, 1)
    if weight:
        return min(BLOCK, r), min(BLOCK, c)
    return (1, min(BLOCK, c)) if contract == 1 else (min(BLOCK, r), 1)


def quantise(x: torch.Tensor, recipe: str, contract: int, weight: bool = False, grad: bool = False) -> torch.Tensor:
    """2-D ``x`` -> its FP8 quantise-dequantise (fp32) for a GEMM contracting axis ``contract``:
    e4m3, or e5m2 for a gradient (``grad``) under tensorwise."""
    fdtype, fmax = ((torch.float8_e5m2, E5M2_MAX) if grad and recipe == "tensorwise"
                    else (torch.float8_e4m3fn, E4M3_MAX))
    x = x.float()
    r, c = x.shape
    tr, tc = _tile(recipe, x.shape, contract, weight)
    pr, pc = -r % tr, -c % tc
    a = torch.nn.functional.pad(x.abs(), (0, pc, 0, pr))
    amax = a.view((r + pr) // tr, tr, (c + pc) // tc, tc).amax(dim=(1, 3))
    amax = amax.repeat_interleave(tr, 0).repeat_interleave(tc, 1)[:r, :c]
    # divisions in float64, rounded once to float32: the correctly rounded fp32 quotient that XLA
    # and numpy give (torch 2.13's CPU fp32 division differs from it in the last bit for ~25% of values)
    scale = torch.where(amax > 0, (fmax / amax.clamp(min=AMAX_EPS).double()).float(), torch.ones_like(amax))
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x * scale).clamp(-fmax, fmax).to(fdtype)
    return q.float() * (1.0 / scale.double()).float()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, recipe):  # x [M, K], w [K, N]
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        return quantise(x, recipe, 1) @ quantise(w, recipe, 0, weight=True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        r = ctx.recipe
        g = g.float()
        dx = quantise(g, r, 1, grad=True) @ quantise(w.t(), r, 0, weight=True)
        dw = quantise(x, r, 0).t() @ quantise(g, r, 0, grad=True)
        return dx.to(x.dtype), dw.to(w.dtype), None


def linear(x: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x @ weight.T`` (``weight [out, in]`` as nn.Linear) under ``recipe``, in ``x.dtype``."""
    lead = x.shape[:-1]
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.t(), recipe)
    return y.reshape(*lead, weight.shape[0]).to(x.dtype)
