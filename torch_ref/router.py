"""The fp32 router: scores, (biased, group-limited) selection, top-k, gate weights.

Semantics (docs/LAYOUT.md "Routing semantics"):

* scores ``s``: ``softmax(logits)`` or (DeepSeek-V3) ``sigmoid(logits)``.
* selection score ``s + bias`` when ``use_expert_bias``, whatever the score function (the
  aux-loss-free bias of DeepSeek-V3, which torchtitan also puts on softmax scores); with
  ``n_groups > 1`` each group scores the sum of its top-2 selection scores, the best
  ``topk_groups`` groups are kept and the others masked to -inf; top-k on the selection scores.
* weights ``s[idx]`` (unbiased), divided by their sum if ``norm_topk_prob`` (``sum + 1e-20`` for
  sigmoid); times ``route_scale``.
* top-k is sorted by score, descending, ties to the lower index (groups too). ``torch.topk``
  does not promise an order among equal values, so :func:`topk_sorted` uses a stable descending
  sort instead.
* ``forced_idx [T, k]`` replaces the selection; weights are computed at those indices as above.
"""

from __future__ import annotations

import torch
from torch import nn

from jaxmoe.config.schema import MoEConfig


def topk_sorted(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, descending; equal values keep index order (lower index first)."""
    values, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def scores_from_logits(logits: torch.Tensor, e: MoEConfig) -> torch.Tensor:
    """Router scores (fp32): softmax probabilities or sigmoid gates."""
    logits = logits.float()
    return torch.softmax(logits, dim=-1) if e.score_func == "softmax" else torch.sigmoid(logits)


def select_experts(scores: torch.Tensor, e: MoEConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """``scores [T, E]`` -> selected expert indices ``[T, k]`` (no gradient flows through this)."""
    sel = scores.detach()
    if e.use_expert_bias and bias is not None:
        sel = sel + bias.float()
    if e.n_groups > 1:
        t, n = sel.shape
        grouped = sel.view(t, e.n_groups, n // e.n_groups)
        group_scores = topk_sorted(grouped, 2)[0].sum(-1)  # [T, G]
        keep = topk_sorted(group_scores, e.topk_groups)[1]  # [T, topk_groups]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        sel = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, n)
    return topk_sorted(sel, e.top_k)[1]


def gate_weights(scores: torch.Tensor, idx: torch.Tensor, e: MoEConfig) -> torch.Tensor:
    """Gate weights ``[T, k]`` (fp32) of the experts ``idx`` from the unbiased ``scores``."""
    w = scores.gather(1, idx)
    if e.norm_topk_prob:
        denom = w.sum(-1, keepdim=True)
        if e.score_func == "sigmoid":
            denom = denom + 1e-20
        w = w / denom
    return w * e.route_scale


def route(
    logits: torch.Tensor,
    e: MoEConfig,
    bias: torch.Tensor | None = None,
    forced_idx: torch.Tensor | None = None,
) -> dict:
    """``logits [T, E]`` (fp32) -> ``{"scores", "topk_idx", "topk_weights"}``."""
    scores = scores_from_logits(logits, e)
    if forced_idx is not None:
        idx = forced_idx.to(device=logits.device, dtype=torch.int64)
    else:
        idx = select_experts(scores, e, bias)
    return {"scores": scores, "topk_idx": idx, "topk_weights": gate_weights(scores, idx, e)}


class Router(nn.Module):
    """HF ``mlp.gate``: ``weight [E, D]`` kept in fp32; with an expert bias (DeepSeek-V3's, or
    one on softmax scores) also the fp32 buffer ``e_score_correction_bias [E]`` (it only affects
    selection)."""

    def __init__(self, d_model: int, e: MoEConfig, with_bias_buffer: bool):
        super().__init__()
        self.e = e
        self.weight = nn.Parameter(torch.zeros(e.n_experts, d_model, dtype=torch.float32))
        if with_bias_buffer:
            self.register_buffer("e_score_correction_bias", torch.zeros(e.n_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, forced_idx: torch.Tensor | None = None) -> dict:
        """``x [T, D]`` -> route() dict plus ``"logits" [T, E]`` (all fp32)."""
        logits = x.float() @ self.weight.float().t()
        out = route(logits, self.e, self.e_score_correction_bias, forced_idx)
        out["logits"] = logits
        return out
