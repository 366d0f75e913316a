"""Causal self-attention of the PyTorch reference: GQA (optional QK-norm) and MLA (DeepSeek-V3).

Submodule names are HF's (``q_proj``, ``k_norm``, ``kv_a_proj_with_mqa``, ...), so that the
state_dict of a layer is the HF checkpoint's. Scores and softmax are computed in fp32; the
weighted sum of values in the compute dtype.

Packed documents (``segment_ids [B, S]``, documents 1, 2, ... per row, 0 = padding): query ``i``
sees key ``j`` iff ``j <= i`` and both carry the same segment id; padding is one more segment, so
every query sees at least itself (no all-masked softmax row, no NaN).
"""

from __future__ import annotations

import torch
from torch import nn

from jaxmoe.config.schema import ModelConfig
from torch_ref.layers import Linear, RMSNorm, apply_rope, yarn_mscale


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``segment_ids [B, S]`` -> bool ``[B, S, S]``: query ``i`` sees key ``j`` iff ``j <= i`` and
    both are in the same segment (padding, 0, included: the module doc)."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``q, k [B, S, H, dq]``, ``v [B, S, H, dv]`` -> ``[B, S, H, dv]`` with a causal mask (and,
    with ``segment_ids [B, S]``, no attention across documents: the module doc)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    s = q.shape[1]
    if segment_ids is None:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    else:  # [B, 1, S, S]: broadcast over heads
        mask = document_mask(segment_ids)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


class GQAAttention(nn.Module):
    """Grouped-query attention: ``H`` query heads share ``KV`` key/value heads (head ``h`` reads
    kv head ``h // (H / KV)``); optional per-head RMSNorm of q and k before RoPE (Qwen3)."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        hd = m.head_dim
        self.q_proj = Linear(m.d_model, m.n_heads * hd)
        self.k_proj = Linear(m.d_model, m.n_kv_heads * hd)
        self.v_proj = Linear(m.d_model, m.n_kv_heads * hd)
        self.o_proj = Linear(m.n_heads * hd, m.d_model)
        if m.qk_norm:
            self.q_norm = RMSNorm(hd, m.rms_norm_eps)
            self.k_norm = RMSNorm(hd, m.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        m = self.m
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, m.n_heads, m.head_dim)
        k = self.k_proj(x).view(b, s, m.n_kv_heads, m.head_dim)
        v = self.v_proj(x).view(b, s, m.n_kv_heads, m.head_dim)
        if m.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin, m.rope_layout)
        k = apply_rope(k, cos, sin, m.rope_layout)
        rep = m.n_heads // m.n_kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        out = causal_attention(q, k, v, m.head_dim**-0.5, segment_ids)
        return self.o_proj(out.reshape(b, s, m.n_heads * m.head_dim))


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), written out without weight absorption.

    * queries: ``q_proj`` (``q_lora_rank == 0``) or ``q_b_proj(norm(q_a_proj(x)))``; per head
      ``[nope | rope]``.
    * keys/values: ``kv_a_proj_with_mqa(x) = [c (kv_lora) | k_rope (rope)]``; ``c`` is normed and
      expanded by ``kv_b_proj`` to per-head ``[k_nope | v]``; ``k_rope`` is one head shared by all.
    * RoPE on the rope parts only; scale ``qh^-0.5``, times ``mscale(f, mscale_all_dim)^2`` under
      YaRN when ``mscale_all_dim != 0`` (DeepSeek-V3 / HF semantics).

    The two latent norms use ``cfg.model.mla_norm_eps`` (HF hard-codes 1e-6 for them whatever
    ``rms_norm_eps`` says; the HF import sets the field to that).
    """

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        qh = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            self.q_a_proj = Linear(m.d_model, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.mla_norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, m.n_heads * qh)
        else:
            self.q_proj = Linear(m.d_model, m.n_heads * qh)
        self.kv_a_proj_with_mqa = Linear(m.d_model, m.kv_lora_rank + m.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.mla_norm_eps)
        self.kv_b_proj = Linear(m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = Linear(m.n_heads * m.v_head_dim, m.d_model)
        self.scale = qh**-0.5
        if m.rope_scaling == "yarn" and m.yarn_mscale_all_dim:
            self.scale *= yarn_mscale(m.yarn_factor, m.yarn_mscale_all_dim) ** 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        m = self.m
        b, s, _ = x.shape
        nope, rope, h = m.qk_nope_head_dim, m.qk_rope_head_dim, m.n_heads
        if m.q_lora_rank > 0:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, s, h, nope + rope)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_rope = ckv[..., : m.kv_lora_rank], ckv[..., m.kv_lora_rank :]
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, s, h, nope + m.v_head_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_rope = apply_rope(q_rope, cos, sin, m.rope_layout)
        k_rope = apply_rope(k_rope.view(b, s, 1, rope), cos, sin, m.rope_layout)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, s, h, rope)], dim=-1)
        out = causal_attention(q, k, v, self.scale, segment_ids)
        return self.o_proj(out.reshape(b, s, h * m.v_head_dim))


def make_attention(m: ModelConfig) -> nn.Module:
    return MLAAttention(m) if m.attention == "mla" else GQAAttention(m)
