"""Building blocks of the PyTorch reference: linear layers, RMSNorm, RoPE (+ YaRN), SwiGLU MLP.

Weights live in the dtype the model was built/loaded in (fp32 masters by default); every layer
casts its weight to the dtype of the activations it receives, so the compute dtype is decided
once, where the embedding output is cast (``cfg.compute.dtype``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from jaxmoe.config.schema import ModelConfig
from torch_ref import fp8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Linear(nn.Linear):
    """Bias-free linear layer, weight ``[out, in]`` as in HF; computes in the input's dtype."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = fp8.current()  # compute.fp8 (torch_ref.fp8); "none" outside the decoder layers
        if recipe != "none":
            return fp8.linear(x, self.weight, recipe)
        return F.linear(x, self.weight.to(x.dtype))


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``; the statistics are computed in fp32 and the
    normalised value is cast back to the input dtype before the weight multiplies it (as HF)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * xf.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``. ``names`` sets the submodule names so that state_dict keys
    follow HF: ``(gate_proj, up_proj, down_proj)`` or Mixtral's ``(w1, w3, w2)``."""

    def __init__(self, d_model: int, d_ff: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = tuple(names)
        gate, up, down = self.names
        self.add_module(gate, Linear(d_model, d_ff))
        self.add_module(up, Linear(d_model, d_ff))
        self.add_module(down, Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(m: ModelConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rope_dim/2] fp32, attention_factor)`` for ``m.rope_dim`` rotary dims.

    Plain RoPE: ``inv_freq_i = theta^(-2i/dim)``, factor 1.

    YaRN (``m.rope_scaling == "yarn"``, factor ``f``, original length ``L0``): dimensions whose
    wavelength is short (more than ``beta_fast`` rotations over ``L0``) keep ``inv_freq``, long ones
    (fewer than ``beta_slow`` rotations) use ``inv_freq / f``, with a linear ramp between the
    correction dims ``low = floor(d(beta_fast))``, ``high = ceil(d(beta_slow))`` where
    ``d(r) = dim * ln(L0 / (2 pi r)) / (2 ln theta)``. cos/sin are multiplied by
    ``attention_factor = mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both are non-zero,
    else ``mscale(f)`` (HF transformers semantics; DeepSeek-V3 has both = 1, so 1; an absent
    ``mscale``, 0 in the config, with ``mscale_all_dim`` given means ``mscale(f)``).
    Computed in fp32 like HF so that the tables agree bit for bit.
    """
    dim = m.rope_dim
    theta = m.rope_theta
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if m.rope_scaling != "yarn":
        return 1.0 / pos_freqs, 1.0
    f = m.yarn_factor
    if m.yarn_attention_factor:  # given explicitly (HF's rope_parameters.attention_factor)
        attention_factor = m.yarn_attention_factor
    elif m.yarn_mscale and m.yarn_mscale_all_dim:
        attention_factor = yarn_mscale(f, m.yarn_mscale) / yarn_mscale(f, m.yarn_mscale_all_dim)
    else:
        attention_factor = yarn_mscale(f)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(m.yarn_original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(m.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(m.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by f)
    inv_freq = (1.0 / (f * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(m: ModelConfig, seq_len: int,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[S, rope_dim/2]`` (fp32, attention factor included) for positions 0..S-1, or,
    given ``positions [B, S]`` (packed documents: each token's position in its document),
    ``[B, S, rope_dim/2]`` for those positions."""
    inv_freq, factor = rope_frequencies(m)
    if positions is None:
        positions = torch.arange(seq_len)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x [B, S, H, dim]`` by position. Pair ``i`` (rotated by frequency ``i``) is
    ``(x[i], x[i + dim/2])`` in the ``half`` layout (HF Llama/Qwen/Mixtral) and
    ``(x[2i], x[2i+1])`` in the ``interleaved`` layout (DeepSeek). The output keeps the input's
    layout. (HF's DeepSeek code returns interleaved pairs de-interleaved; since q and k are permuted
    alike, attention scores are identical.) ``cos``/``sin``: ``[S, dim/2]`` for every row or
    ``[B, S, dim/2]`` per token (packed documents)."""
    lead = (None,) if cos.ndim == 2 else (slice(None),)
    c = cos[lead + (slice(None), None, slice(None))].to(x.dtype)
    s = sin[lead + (slice(None), None, slice(None))].to(x.dtype)
    if layout == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def shift_left(x: torch.Tensor, k: int, segment_ids: torch.Tensor | None = None):
    """``(x shifted left by k along dim 1, valid [B, S] bool)``: position ``i`` holds ``x[:, i+k]``
    where ``i + k < S`` (and in the same packed document), else 0."""
    s = x.shape[1]
    valid = torch.zeros(x.shape[:2], dtype=torch.bool)
    valid[:, : s - k] = True
    if segment_ids is not None:
        same = torch.zeros_like(valid)
        same[:, : s - k] = segment_ids[:, k:] == segment_ids[:, : s - k]
        valid = valid & same
    out = torch.zeros_like(x)
    out[:, : s - k] = x[:, k:]
    return torch.where(valid, out, torch.zeros_like(out)), valid
