"""MoE block of the PyTorch reference: router -> experts (per-expert loop) -> combine (+ shared).

HF names (from the architecture record, :mod:`jaxmoe.archs`): the block (``mlp``, Mixtral
``block_sparse_moe``, chosen by the caller) holds ``gate`` (the router), ``experts.{e}.*`` and
``shared_experts.*``.
"""

from __future__ import annotations

import torch
from torch import nn

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from torch_ref.experts import Experts
from torch_ref.layers import SwiGLU
from torch_ref.losses import load_balance_loss, router_z_loss, seq_aux_loss
from torch_ref.router import Router


class MoEBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m, e = cfg.model, cfg.moe
        self.e = e
        arch = get_arch(m.hf_arch)  # HF names: the architecture record (jaxmoe.archs)
        # the bias buffer: where the architecture stores one (DeepSeek-V3), or where the config uses
        # an expert bias the architecture cannot store (torchtitan's bias on softmax scores)
        self.gate = Router(m.d_model, e, with_bias_buffer=arch.bias_tensor or e.use_expert_bias)
        self.experts = Experts(m.d_model, e, arch.expert_projections)
        if e.n_shared_experts > 0:
            self.shared_experts = SwiGLU(m.d_model, e.n_shared_experts * e.expert_ffn_dim)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor, forced_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """``x [B, S, D]`` -> (``out [B, S, D]``, per-layer aux).

        aux: ``logits, scores [T, E]`` fp32, ``topk_idx [T, k]`` int64, ``topk_weights [T, k]``
        fp32, ``counts [E]`` (assignments per expert, before any capacity drop), ``dropped`` (pairs
        dropped by capacity), ``losses`` {lb, seq_aux, router_z} (fp32 scalars, unweighted).
        T = B*S row-major.
        """
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        r = self.gate(flat, forced_idx)
        idx, w = r["topk_idx"], r["topk_weights"]
        out, dropped = self.experts(flat, idx, w)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        counts = torch.bincount(idx.reshape(-1), minlength=self.e.n_experts)
        losses = {
            "lb": load_balance_loss(r["scores"], counts, self.e),
            "seq_aux": seq_aux_loss(r["scores"], idx, self.e, b),
            "router_z": router_z_loss(r["logits"]),
        }
        aux = dict(r, counts=counts, dropped=dropped, losses=losses)
        return out.view(b, s, d), aux
