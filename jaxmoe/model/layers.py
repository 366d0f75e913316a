"""The numerical building blocks every module uses: RMSNorm, linear, RoPE (half / interleaved,
YaRN).

Everything here is a pure function of arrays (parameters are passed in explicitly); the modules
(:mod:`jaxmoe.model.params`, ``attention``, ``mlp``, ...) call them.

Precision rules (docs/LAYOUT.md, "Numerics"):

* RMSNorm statistics are computed in fp32 and the result cast back to the input dtype.
* RoPE angles and the rotation are computed in fp32.
* Matmuls take inputs in the compute dtype (``x.dtype``); weights are cast to it at the point of use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config.schema import ModelConfig
from jaxmoe.model import fp8


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, in fp32; returns ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` with ``w`` stored ``[in, out]``, computed in ``x.dtype`` (fp32 accumulation)."""
    recipe = fp8.current()  # compute.fp8 (jaxmoe.model.fp8): quantised operands, fp32 product
    if recipe != "none":
        return fp8.fp8_matmul(x, w, recipe).astype(x.dtype)
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(m: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[rope_dim // 2]`` (fp32) and the cos/sin ``attention_factor``.

    Plain RoPE: ``theta^(-2i/d)``, factor 1. YaRN (``rope_scaling == "yarn"``) follows HF
    transformers' ``_compute_yarn_parameters``: the frequencies blend interpolated (``/factor``)
    and extrapolated ones with a linear ramp between the correction dims found from
    ``beta_fast``/``beta_slow`` (floored/ceiled, HF's default ``truncate=True``), and
    ``attention_factor`` (which multiplies cos and sin) is ``mscale(f, mscale)/mscale(f, all_dim)``
    when both are non-zero, else ``mscale(f)`` (HF ``_compute_yarn_parameters``, 5.25: an absent
    ``mscale`` -- 0 here -- with ``mscale_all_dim`` given is ``mscale(f)``, not a ratio).
    """
    dim = m.rope_dim
    base = m.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    if m.rope_scaling != "yarn":
        return inv_extra.astype(np.float32), 1.0
    factor = m.yarn_factor
    if m.yarn_attention_factor:  # given explicitly: HF uses it as is
        attention_factor = m.yarn_attention_factor
    elif m.yarn_mscale and m.yarn_mscale_all_dim:
        attention_factor = _yarn_get_mscale(factor, m.yarn_mscale) / _yarn_get_mscale(
            factor, m.yarn_mscale_all_dim
        )
    else:
        attention_factor = _yarn_get_mscale(factor)
    beta_fast = m.yarn_beta_fast or 32.0
    beta_slow = m.yarn_beta_slow or 1.0
    orig = m.yarn_original_max_pos

    def correction_dim(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra_factor = (1 - ramp).astype(np.float32)
    inv_inter = 1.0 / (factor * pos_freqs)
    inv = inv_inter * (1 - extra_factor) + inv_extra * extra_factor
    return inv.astype(np.float32), float(attention_factor)


def yarn_softmax_mscale(m: ModelConfig) -> float:
    """Extra softmax-scale multiplier of DeepSeek-V3 attention under YaRN (``mscale_all_dim``^2).

    HF ``yarn_apply_mscale``: ``scale *= mscale(factor, mscale_all_dim)**2`` when RoPE scaling is on
    and ``mscale_all_dim`` is non-zero; 1 otherwise.
    """
    if m.rope_scaling != "yarn" or not m.yarn_mscale_all_dim:
        return 1.0
    ms = _yarn_get_mscale(m.yarn_factor, m.yarn_mscale_all_dim)
    return ms * ms


def rope_tables(m: ModelConfig, seq_len: int, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[seq_len, rope_dim // 2]`` (fp32) for positions ``0..seq_len-1``,
    already multiplied by the YaRN attention factor (as HF multiplies its cos/sin).

    With ``positions [B, S]`` (int; packed documents: each token's position inside its document)
    the tables are per token, ``[B, S, rope_dim // 2]``: the same fp32 product ``position * inv``
    and the same cos/sin, so a document starting at position 0 gets exactly the rotation it gets
    alone in a row."""
    inv, attention_factor = rope_frequencies(m)
    if positions is not None:
        ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
        return jnp.cos(ang) * attention_factor, jnp.sin(ang) * attention_factor
    pos = np.arange(seq_len, dtype=np.float32)
    ang = jnp.asarray(pos[:, None] * inv[None, :])
    return jnp.cos(ang) * attention_factor, jnp.sin(ang) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: str) -> jax.Array:
    """Rotate ``x [B, S, H, d]`` by position; ``cos``/``sin`` are ``[S, d/2]`` (one table for
    every row) or ``[B, S, d/2]`` (per-token positions: packed documents, :func:`rope_tables`).

    ``half``: dims ``i`` and ``i + d/2`` form a pair (rotate-half, HF Llama/Qwen/Mixtral).
    ``interleaved``: dims ``2i`` and ``2i+1`` form a pair. HF DeepSeek-V3 with ``rope_interleave``
    de-interleaves q and k identically and then applies rotate-half, so the q·k scores equal ours.
    Computed in fp32, returned in ``x.dtype``.
    """
    dtype = x.dtype
    x = x.astype(jnp.float32)
    if cos.ndim == 2:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    if layout == "half":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    elif layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape)
    else:
        raise ValueError(f"unknown rope_layout {layout!r}")
    return out.astype(dtype)
