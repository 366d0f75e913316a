"""Causal self-attention: GQA (optional Qwen3 QK-norm) and MLA (DeepSeek-V3).

Both are pure functions ``attn(p, x, cos, sin, m) -> [B, S, D]`` of one layer's parameter dict
``p`` (the ``attn/`` sub-dict of docs/LAYOUT.md, without the layer axis). Scores and softmax are
computed in fp32; the value matmul runs in the compute dtype with fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import ModelConfig
from jaxmoe.model.layers import apply_rope, linear, rms_norm, yarn_softmax_mscale


def _causal_softmax_attend(q, k, v, scale):
    """q ``[B,S,KV,G,d]``, k ``[B,S,KV,d]``, v ``[B,S,KV,dv]`` -> ``[B,S,KV,G,dv]`` (q.dtype)."""
    s_len = q.shape[1]
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.tril(jnp.ones((s_len, s_len), dtype=bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def gqa_attention(p: dict, x: jax.Array, cos, sin, m: ModelConfig) -> jax.Array:
    """Grouped-query attention. ``p``: q_proj, k_proj, v_proj, o_proj (+ q_norm, k_norm when
    ``m.qk_norm``: per-head RMSNorm applied before RoPE, as Qwen3). Softmax scale ``hd^-0.5``."""
    b, s, _ = x.shape
    h, kv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    q = linear(x, p["q_proj"]).reshape(b, s, h, hd)
    k = linear(x, p["k_proj"]).reshape(b, s, kv, hd)
    v = linear(x, p["v_proj"]).reshape(b, s, kv, hd)
    if m.qk_norm:
        q = rms_norm(q, p["q_norm"], m.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], m.rms_norm_eps)
    q = apply_rope(q, cos, sin, m.rope_layout)
    k = apply_rope(k, cos, sin, m.rope_layout)
    q = q.reshape(b, s, kv, h // kv, hd)
    out = _causal_softmax_attend(q, k, v, hd**-0.5)
    return linear(out.reshape(b, s, h * hd), p["o_proj"])


def mla_attention(p: dict, x: jax.Array, cos, sin, m: ModelConfig) -> jax.Array:
    """Multi-head latent attention, as HF ``DeepseekV3Attention``.

    q: ``q_proj`` (``q_lora_rank == 0``) or ``q_b_proj(rms_norm(q_a_proj(x)))``, per head
    ``[nope, rope]``. ``kv_a_proj(x)`` -> ``[compressed kv (kv_lora), k_rope (rope)]``; the
    compressed part is RMS-normed and expanded by ``kv_b_proj`` into per-head ``[k_nope, v]``;
    ``k_rope`` is one head shared by all heads. RoPE touches only the rope parts. Softmax scale
    ``qh^-0.5 * yarn_mscale^2``.

    Note: HF builds ``q_a_layernorm``/``kv_a_layernorm`` with its default eps (1e-6) rather than
    ``rms_norm_eps``; we use ``rms_norm_eps`` (DESIGN: eps is a config field). They agree for every
    DeepSeek-V3/K2 checkpoint, whose ``rms_norm_eps`` is 1e-6.
    """
    b, s, _ = x.shape
    h = m.n_heads
    nope, rope, vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    qh = nope + rope
    if m.q_lora_rank > 0:
        q = linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_norm"], m.rms_norm_eps), p["q_b_proj"])
    else:
        q = linear(x, p["q_proj"])
    q = q.reshape(b, s, h, qh)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv_a = linear(x, p["kv_a_proj"])
    ckv = rms_norm(kv_a[..., : m.kv_lora_rank], p["kv_a_norm"], m.rms_norm_eps)
    k_rope = kv_a[..., m.kv_lora_rank :].reshape(b, s, 1, rope)
    kv = linear(ckv, p["kv_b_proj"]).reshape(b, s, h, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    q_rope = apply_rope(q_rope, cos, sin, m.rope_layout)
    k_rope = apply_rope(k_rope, cos, sin, m.rope_layout)
    q_full = jnp.concatenate([q_nope, q_rope], axis=-1)
    k_full = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (b, s, h, rope))], axis=-1)
    scale = qh**-0.5 * yarn_softmax_mscale(m)
    out = _causal_softmax_attend(q_full[:, :, :, None, :], k_full, v, scale)
    return linear(out.reshape(b, s, h * vd), p["o_proj"])


def attention(p: dict, x: jax.Array, cos, sin, m: ModelConfig) -> jax.Array:
    """Dispatch on ``m.attention`` ("gqa" | "mla")."""
    if m.attention == "mla":
        return mla_attention(p, x, cos, sin, m)
    return gqa_attention(p, x, cos, sin, m)


def attention_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer parameter shapes of the attention sub-dict (docs/LAYOUT.md); norms end in ``_norm``."""
    d, h = m.d_model, m.n_heads
    if m.attention == "gqa":
        shapes = {
            "q_proj": (d, h * m.head_dim),
            "k_proj": (d, m.n_kv_heads * m.head_dim),
            "v_proj": (d, m.n_kv_heads * m.head_dim),
            "o_proj": (h * m.head_dim, d),
        }
        if m.qk_norm:
            shapes["q_norm"] = (m.head_dim,)
            shapes["k_norm"] = (m.head_dim,)
        return shapes
    qh = m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes = {}
    if m.q_lora_rank > 0:
        shapes["q_a_proj"] = (d, m.q_lora_rank)
        shapes["q_a_norm"] = (m.q_lora_rank,)
        shapes["q_b_proj"] = (m.q_lora_rank, h * qh)
    else:
        shapes["q_proj"] = (d, h * qh)
    shapes["kv_a_proj"] = (d, m.kv_lora_rank + m.qk_rope_head_dim)
    shapes["kv_a_norm"] = (m.kv_lora_rank,)
    shapes["kv_b_proj"] = (m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim))
    shapes["o_proj"] = (h * m.v_head_dim, d)
    return shapes
