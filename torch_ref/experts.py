"""Routed experts of the PyTorch reference: one SwiGLU per expert, computed in a readable loop.

State-dict names are HF's per-expert hub names: ``experts.{e}.gate_proj/up_proj/down_proj``
(Qwen3-MoE, DeepSeek-V3) or ``experts.{e}.w1/w3/w2`` (Mixtral; w1 = gate, w3 = up, w2 = down).

Capacity dropping (docs/LAYOUT.md "Dropping") applies when ``compute_path == "dense"`` and
``capacity_factor > 0``: capacity ``C = max(1, ceil(cf * T * k / E))``; an expert's slots are
filled in order of (choice rank, token index); pairs past capacity contribute zero and the other
weights of that token are not renormalised. Every other configuration is dropless.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from jaxmoe.config.schema import MoEConfig
from torch_ref import fp8
from torch_ref.layers import SwiGLU


def capacity(e: MoEConfig, n_tokens: int) -> int | None:
    """Slots per expert, or None when dropless."""
    if e.compute_path != "dense" or e.capacity_factor <= 0:
        return None
    return max(1, math.ceil(e.capacity_factor * n_tokens * e.top_k / e.n_experts))


def keep_mask(idx: torch.Tensor, n_experts: int, cap: int | None) -> torch.Tensor:
    """``idx [T, k]`` -> bool ``[T, k]``: True where the (token, choice) pair gets a slot.

    Priority: all first choices (tokens in order), then all second choices, and so on."""
    if cap is None:
        return torch.ones_like(idx, dtype=torch.bool)
    t, k = idx.shape
    rank_major = idx.t().reshape(-1)  # position r*T + t holds token t's r-th choice
    one_hot = torch.nn.functional.one_hot(rank_major, n_experts)
    slot = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # 0-based slot within its expert
    return (slot < cap).view(k, t).t()


class Experts(nn.ModuleList):
    """``E`` SwiGLU experts of width ``I``; a ModuleList so that expert ``e``'s weights are named
    ``experts.{e}.*`` directly under the MoE block, as in HF."""

    def __init__(self, d_model: int, e: MoEConfig, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__(SwiGLU(d_model, e.expert_ffn_dim, names) for _ in range(e.n_experts))
        self.e = e

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]``, ``idx / weights [T, k]`` -> (``out [T, D]`` in x's dtype, ``dropped``
        (number of dropped pairs)). The weighted sum is accumulated in fp32 and cast once."""
        t = x.shape[0]
        keep = keep_mask(idx, self.e.n_experts, capacity(self.e, t))
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for ex, mlp in enumerate(self):
            tok, choice = torch.where((idx == ex) & keep)
            if tok.numel() == 0:
                continue
            if fp8.current() != "none":  # rows in jaxmoe's slot order (choice rank, token): fp8 tiles over rows
                order = torch.argsort(choice * t + tok)
                tok, choice = tok[order], choice[order]
            y = mlp(x[tok]).float() * weights[tok, choice].float()[:, None]
            out = out.index_add(0, tok, y)
        return out.to(x.dtype), (~keep).sum()
