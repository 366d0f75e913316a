"""Causal self-attention modules: GQA (optional Qwen3 QK-norm) and MLA (DeepSeek-V3).

Both are NNX modules ``attn(x, cos, sin, segment_ids=None) -> [B, S, D]`` whose weights are the
``attn/`` sub-tree of docs/LAYOUT.md. Scores and softmax are computed in fp32; the value matmul runs in the compute
dtype with fp32 accumulation.

The score/softmax/value kernel is a named choice, ``compute.attention_kernel`` (:func:`attend`):

* ``dot_product``: ``jax.nn.dot_product_attention`` -- cuDNN flash attention on GPU (bf16/fp16;
  the ``[B, H, S, S]`` scores are never stored), XLA's implementation where cuDNN does not apply
  (CPU, fp32, unsupported head dims: decided at trace time, falling back to XLA).
* ``explicit``: the scores materialised by hand (:func:`causal_softmax_attend`). On XLA:CPU the
  XLA implementation of ``dot_product_attention`` materialises the same scores too and its
  compiled fwd+bwd moved more bytes for the same FLOPs (docs/MEASUREMENTS.md, "Kernels").
* ``auto`` (default): ``dot_product`` on GPU, ``explicit`` elsewhere.

Document packing (``segment_ids [B, S]`` int, documents numbered 1, 2, ... in a row, 0 = padding):
token ``i`` attends to token ``j`` iff ``j <= i`` and ``segment_ids[i] == segment_ids[j]``
(:func:`document_mask`), in both kernels. Padding is treated as one more segment: a padding token
attends to itself and the padding before it, so its row always has a visible key (the diagonal)
and no softmax sees only ``-inf`` (no NaN; its loss is masked anyway). ``segment_ids=None`` is
plain causal attention over the whole row, with the very same graph as before packing existed.
The ``dot_product`` kernel passes the same-segment test as ``mask [B, 1, S, S]`` next to
``is_causal``; jax hands it to cuDNN as an additive ``[B, 1, S, S]`` bias in the compute dtype (a
GPU path not exercised by the CPU test suite).

MLA's value head dim differs from its query/key head dim. On a GPU with cuDNN >= 9.10 (Hopper or
later; jax #28872) cuDNN's fused attention takes d_qk != d_v as they are (:func:`_cudnn_mla`), so no
PV work is spent on padding. Otherwise -- ``jax.nn.dot_product_attention`` needs equal head dims
(jax 0.10-0.12) -- the narrower side is zero-padded (zeros in v give zero output columns, sliced
off; zeros in q/k add nothing to the scores; the scale is passed explicitly). Which of the two an
MLA model took is said once per process (``attention: MLA ...`` on stderr, when it is traced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config.autoconf import say_once
from jaxmoe.config.schema import ModelConfig
from jaxmoe.model.layers import apply_rope, yarn_softmax_mscale
from jaxmoe.model.params import Linear, RMSNorm, builds, normal, ones, stack_axes

KERNELS = ("auto", "dot_product", "explicit")


def _use_cudnn(q, v) -> bool:
    """cuDNN flash attention applies: a GPU backend and a 16-bit compute dtype (fp32 is not
    supported by cuDNN's fused attention; the shape limits are checked by jax at trace time)."""
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """``segment_ids [B, S]`` -> bool ``[B, S, S]``: ``mask[b, i, j]`` iff ``j <= i`` and tokens
    ``i`` and ``j`` of row ``b`` are in the same segment (the module doc; padding is segment 0)."""
    s = segment_ids.shape[-1]
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    return causal & (segment_ids[..., :, None] == segment_ids[..., None, :])


def _cudnn_mla(q, k, v, scale, mask):
    """cuDNN fused attention with ``d_qk != d_v``, unpadded, or None where it does not apply.

    ``jax.nn.dot_product_attention`` checks ``value.shape == key.shape`` (jax 0.10-0.12), so this
    calls the entry point its ``cudnn`` implementation wraps,
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (private to jax, the same
    arguments jax.nn passes); it checks the cuDNN version (>= 9.10 for d_qk != d_v) and the GPU
    (Hopper or later) and raises NotImplementedError otherwise: the caller then pads."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return fa.dot_product_attention(q, k, v, None, mask, scale=scale, mask_type=fa.MaskType.CAUSAL)
    except (ImportError, AttributeError, NotImplementedError, RuntimeError, ValueError):
        return None


def _dot_product(q, k, v, scale, segment_ids=None):
    """``jax.nn.dot_product_attention`` on ``q [B,S,H,d]``, ``k [B,S,KV,d]``, ``v [B,S,KV,dv]``;
    with ``segment_ids [B, S]`` a same-segment mask ``[B, 1, S, S]`` on top of ``is_causal``."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d and _use_cudnn(q, v):  # MLA on GPU: cuDNN >= 9.10 takes the head dims as they are
        mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        out = _cudnn_mla(q, k, v, scale, mask)
        say_once(f"attention: MLA (d_qk={d}, d_v={dv}) by cuDNN fused attention, unpadded" if out is not None
                 else f"attention: MLA (d_qk={d}, d_v={dv}) by cuDNN with head dims padded to {max(d, dv)} "
                      "(unpadded needs cuDNN >= 9.10 on Hopper or later)")
        if out is not None:
            return out.astype(q.dtype)
    if dv < d:  # MLA: pad v's head dim up to q/k's
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, d - dv)])
    elif dv > d:
        pad = [(0, 0)] * 3 + [(0, dv - d)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    kw = dict(scale=scale, is_causal=True)
    if segment_ids is not None:
        kw["mask"] = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    out = None
    if _use_cudnn(q, v):
        try:
            out = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        except (NotImplementedError, RuntimeError, ValueError):  # shape/version cuDNN rejects
            out = None
    if out is None:
        out = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    return out[..., :dv].astype(q.dtype)


def attend(q, k, v, scale, kernel: str = "auto", segment_ids=None, q_shared=None, k_shared=None):
    """Causal attention: ``q [B,S,H,d]``, ``k [B,S,KV,d]``, ``v [B,S,KV,dv]`` (``H`` a multiple
    of ``KV``) -> ``[B,S,H,dv]`` in ``q.dtype``, by ``kernel`` (module doc); with
    ``segment_ids [B, S]`` no token attends across a document boundary (:func:`document_mask`).

    ``q_shared [B,S,H,r]`` with ``k_shared [B,S,r]``: one more key part that every head shares
    (MLA's RoPE key), as if ``q`` and every key head were concatenated with them. The explicit
    kernel adds ``q_shared . k_shared`` to the scores without broadcasting the shared key to the
    heads; ``dot_product`` concatenates."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown compute.attention_kernel {kernel!r}; use one of {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = "dot_product" if jax.default_backend() == "gpu" else "explicit"
    b, s, h, d = q.shape
    kv = k.shape[2]
    if kernel == "dot_product":
        if q_shared is not None:
            q = jnp.concatenate([q, q_shared], axis=-1)
            k = jnp.concatenate([k, jnp.broadcast_to(k_shared[:, :, None], (b, s, kv, k_shared.shape[-1]))], -1)
        return _dot_product(q, k, v, scale, segment_ids)
    g = h // kv
    qs = None if q_shared is None else q_shared.reshape(b, s, kv, g, q_shared.shape[-1])
    out = causal_softmax_attend(q.reshape(b, s, kv, g, d), k, v, scale, segment_ids, qs, k_shared)
    return out.reshape(b, s, h, v.shape[-1])


# Query rows per block of the explicit kernel: block i attends to keys 0 .. (i+1)*Q - 1 only, so
# the scores above the diagonal's blocks are never computed (S=256: 3/4 of the full square with
# Q=128). Each block's softmax still runs over every key it can see: the same math as one masked
# S x S softmax. A sequence that is not a multiple of Q (or not longer) is one block.
_Q_BLOCK = 128


def _attend_block(qh, kh, vh, scale, q0, segment_ids=None, qs=None, ks=None):
    """Head-major queries ``q0 .. q0+Sq-1`` (``qh [B,KV,G,Sq,d]``) against keys ``0 .. Sk-1``
    (``kh [B,KV,Sk,d]``, ``vh [B,KV,Sk,dv]``), causal (and within a segment when ``segment_ids
    [B, S]`` is given); ``qs [B,KV,G,Sq,r]`` . ``ks [B,Sk,r]``: the shared key part. -> fp32
    ``[B,KV,G,Sq,dv]``."""
    sq, sk = qh.shape[3], kh.shape[2]
    scores = jnp.einsum("bkgsd,bktd->bkgst", qh, kh, preferred_element_type=jnp.float32)
    if qs is not None:
        scores = scores + jnp.einsum("bkgsr,btr->bkgst", qs, ks, preferred_element_type=jnp.float32)
    scores = scores * scale
    mask = (q0 + jnp.arange(sq))[:, None] >= jnp.arange(sk)[None, :]
    if segment_ids is not None:  # [B, Sq, Sk] -> [B, 1, 1, Sq, Sk] against scores [B, KV, G, Sq, Sk]
        same = segment_ids[:, q0:q0 + sq, None] == segment_ids[:, None, :sk]
        mask = (mask & same)[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype)
    return jnp.einsum("bkgst,bktd->bkgsd", probs, vh, preferred_element_type=jnp.float32)


def causal_softmax_attend(q, k, v, scale, segment_ids=None, q_shared=None, k_shared=None):
    """q ``[B,S,KV,G,d]``, k ``[B,S,KV,d]``, v ``[B,S,KV,dv]`` -> ``[B,S,KV,G,dv]`` (q.dtype);
    ``segment_ids [B, S]``: attention stays within each segment (the module doc); ``q_shared
    [B,S,KV,G,r]`` . ``k_shared [B,S,r]``: a key part shared by every head (:func:`attend`).

    The operands are put head-major (``[B,KV,G,S,d]``) once, before the query blocks, so each
    block's two batched matmuls read contiguous ``[S, d]`` tiles per head instead of transposing
    sequence-major operands inside every block's einsum (faster on XLA:CPU; the figures are in
    docs/MEASUREMENTS.md, "Train step against torchtitan")."""
    s_len = q.shape[1]
    qh, kh, vh = q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    qs = None if q_shared is None else q_shared.transpose(0, 2, 3, 1, 4)
    qb = _Q_BLOCK
    if qb <= 0 or s_len <= qb or s_len % qb:
        out = _attend_block(qh, kh, vh, scale, 0, segment_ids, qs, k_shared)
    else:
        out = jnp.concatenate(
            [_attend_block(qh[:, :, :, i:i + qb], kh[:, :, :i + qb], vh[:, :, :i + qb], scale, i, segment_ids,
                           None if qs is None else qs[:, :, :, i:i + qb],
                           None if k_shared is None else k_shared[:, :i + qb]) for i in range(0, s_len, qb)],
            axis=3)
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


class GQAttention(nnx.Module):
    """Grouped-query attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (+ ``q_norm``,
    ``k_norm`` when ``qk_norm``: per-head RMSNorm applied before RoPE, as Qwen3). Softmax scale
    ``hd^-0.5``."""

    @builds
    def __init__(self, m: ModelConfig, *, stack: tuple = (), kernel: str = "auto", rngs: nnx.Rngs):
        d, h, kv, hd, std = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.init_std
        self.n_heads, self.n_kv_heads, self.head_dim, self.kernel = h, kv, hd, kernel
        self.rope_layout = m.rope_layout
        ax = lambda *a: stack_axes(stack, a)  # noqa: E731
        self.q_proj = Linear.declare(stack + (d, h * hd), ax("embed", "heads"), normal(std))
        self.k_proj = Linear.declare(stack + (d, kv * hd), ax("embed", "heads"), normal(std))
        self.v_proj = Linear.declare(stack + (d, kv * hd), ax("embed", "heads"), normal(std))
        self.o_proj = Linear.declare(stack + (h * hd, d), ax("heads", "embed"), normal(std))
        self.qk_norm = m.qk_norm
        if m.qk_norm:
            self.q_norm = RMSNorm.declare(stack + (hd,), ax("norm"), ones(), eps=m.rms_norm_eps)
            self.k_norm = RMSNorm.declare(stack + (hd,), ax("norm"), ones(), eps=m.rms_norm_eps)

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """``x [B, S, D]`` -> RoPE'd ``q [B,S,H,hd]``, ``k``, ``v [B,S,KV,hd]`` (QK-normed if set);
        shared with the KV-cache decode (jaxmoe.model.decode)."""
        b, s, _ = x.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(b, s, h, hd)
        k = self.k_proj(x).reshape(b, s, kv, hd)
        v = self.v_proj(x).reshape(b, s, kv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin, self.rope_layout), apply_rope(k, cos, sin, self.rope_layout), v

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids=None) -> jax.Array:
        b, s, _ = x.shape
        h, hd = self.n_heads, self.head_dim
        q, k, v = self.qkv(x, cos, sin)
        out = attend(q, k, v, hd**-0.5, self.kernel, segment_ids)
        return self.o_proj(out.reshape(b, s, h * hd))


class MLAttention(nnx.Module):
    """Multi-head latent attention, as HF ``DeepseekV3Attention``.

    q: ``q_proj`` (``q_lora_rank == 0``) or ``q_b_proj(q_a_norm(q_a_proj(x)))``, per head
    ``[nope, rope]``. ``kv_a_proj(x)`` -> ``[compressed kv (kv_lora), k_rope (rope)]``; the
    compressed part is RMS-normed and expanded by ``kv_b_proj`` into per-head ``[k_nope, v]``;
    ``k_rope`` is one head shared by all heads. RoPE touches only the rope parts. Softmax scale
    ``qh^-0.5 * yarn_mscale^2``.

    The two low-rank norms use ``model.mla_norm_eps`` (HF DeepSeek-V3 fixes them at 1e-6 whatever
    ``rms_norm_eps`` says; the HF import sets it so).
    """

    @builds
    def __init__(self, m: ModelConfig, *, stack: tuple = (), kernel: str = "auto", rngs: nnx.Rngs):
        d, h, std = m.d_model, m.n_heads, m.init_std
        self.n_heads, self.rope_layout, self.kernel = h, m.rope_layout, kernel
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = m.kv_lora_rank, m.q_lora_rank
        qh = self.nope + self.rope
        self.scale = qh**-0.5 * yarn_softmax_mscale(m)
        ax = lambda *a: stack_axes(stack, a)  # noqa: E731
        eps = m.mla_norm_eps
        if m.q_lora_rank > 0:
            r = m.q_lora_rank
            self.q_a_proj = Linear.declare(stack + (d, r), ax("embed", "lora"), normal(std))
            self.q_a_norm = RMSNorm.declare(stack + (r,), ax("norm"), ones(), eps=eps)
            self.q_b_proj = Linear.declare(stack + (r, h * qh), ax("lora", "heads"), normal(std))
        else:
            self.q_proj = Linear.declare(stack + (d, h * qh), ax("embed", "heads"), normal(std))
        c = m.kv_lora_rank
        self.kv_a_proj = Linear.declare(stack + (d, c + self.rope), ax("embed", "lora"), normal(std))
        self.kv_a_norm = RMSNorm.declare(stack + (c,), ax("norm"), ones(), eps=eps)
        self.kv_b_proj = Linear.declare(stack + (c, h * (self.nope + self.v_dim)), ax("lora", "heads"),
                                        normal(std))
        self.o_proj = Linear.declare(stack + (h * self.v_dim, d), ax("heads", "embed"), normal(std))

    def latent(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """``x [B, S, D]`` -> ``q_nope [B,S,H,nope]``, RoPE'd ``q_rope [B,S,H,rope]``, the normed
        latent ``ckv [B,S,kv_lora]`` and the RoPE'd shared key ``k_rope [B,S,rope]``: everything
        before ``kv_b_proj``, shared with the KV-cache decode (jaxmoe.model.decode)."""
        b, s, _ = x.shape
        h, nope, rope = self.n_heads, self.nope, self.rope
        if self.q_lora_rank > 0:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(b, s, h, nope + rope)
        kv_a = self.kv_a_proj(x)
        ckv = self.kv_a_norm(kv_a[..., : self.kv_lora_rank])
        k_rope = apply_rope(kv_a[..., self.kv_lora_rank :].reshape(b, s, 1, rope), cos, sin, self.rope_layout)
        return q[..., :nope], apply_rope(q[..., nope:], cos, sin, self.rope_layout), ckv, k_rope[:, :, 0]

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids=None) -> jax.Array:
        b, s, _ = x.shape
        h, nope, vd = self.n_heads, self.nope, self.v_dim
        q_nope, q_rope, ckv, k_rope = self.latent(x, cos, sin)
        kv = self.kv_b_proj(ckv).reshape(b, s, h, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        # the rope key is one head shared by all: attend adds q_rope . k_rope to the nope scores
        out = attend(q_nope, k_nope, v, self.scale, self.kernel, segment_ids, q_rope, k_rope)
        return self.o_proj(out.reshape(b, s, h * vd))


ATTENTION = {"gqa": GQAttention, "mla": MLAttention}  # model.attention -> module


def make_attention(m: ModelConfig, *, stack: tuple = (), kernel: str = "auto", rngs: nnx.Rngs) -> nnx.Module:
    """The attention module of ``m`` (``model.attention``) with score kernel ``kernel``
    (``compute.attention_kernel``)."""
    return ATTENTION[m.attention](m, stack=stack, kernel=kernel, rngs=rngs)


__all__ = ["ATTENTION", "GQAttention", "KERNELS", "MLAttention", "attend", "causal_softmax_attend",
           "document_mask", "make_attention"]
