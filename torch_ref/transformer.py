"""The whole PyTorch reference model: embed -> [dense blocks] -> [MoE blocks] -> norm -> lm head.

``TorchTransformer(cfg).state_dict()`` has exactly the HF hub tensor names of
``cfg.model.hf_arch`` (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.*`` / Mixtral ``block_sparse_moe.*``, ``model.norm.weight``,
``lm_head.weight`` unless tied), linear weights ``[out, in]``; so HF checkpoints load with a plain
``load_state_dict`` (see ``torch_ref.hf_io``).
"""

from __future__ import annotations

import torch
from torch import nn

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from torch_ref.attention import make_attention
from torch_ref.layers import DTYPES, Linear, RMSNorm, SwiGLU, rope_tables
from torch_ref.moe import MoEBlock


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; the FFN is a dense SwiGLU
    for the first ``first_k_dense`` layers and a MoE block after."""

    def __init__(self, cfg: Config, index: int):
        super().__init__()
        m = cfg.model
        self.is_moe = index >= m.first_k_dense
        # the HF module name of a MoE layer's FFN in the hub (per-expert) layout
        self.ffn_name = get_arch(m.hf_arch).moe_module["per-expert"] if self.is_moe else "mlp"
        self.self_attn = make_attention(m)
        self.input_layernorm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(m.d_model, m.rms_norm_eps)
        ffn = MoEBlock(cfg) if self.is_moe else SwiGLU(m.d_model, m.dense_ffn_dim)
        self.add_module(self.ffn_name, ffn)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x, cos, sin, forced_idx=None, segment_ids=None):
        """-> (x, attn_out, ffn_out, moe aux or None)."""
        attn_out = self.self_attn(self.input_layernorm(x), cos, sin, segment_ids)
        x = x + attn_out
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            ffn_out, aux = self.ffn(h, forced_idx)
        else:
            ffn_out, aux = self.ffn(h), None
        return x + ffn_out, attn_out, ffn_out, aux


class Backbone(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.embed_tokens = nn.Embedding(m.vocab_size, m.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(m.n_layers))
        self.norm = RMSNorm(m.d_model, m.rms_norm_eps)


class TorchTransformer(nn.Module):
    def __init__(self, cfg: Config, seed: int | None = None):
        super().__init__()
        self.cfg = cfg
        m = cfg.model
        self.model = Backbone(cfg)
        self.lm_head = None if m.tie_embeddings else Linear(m.d_model, m.vocab_size)
        self.init_weights(cfg.train.seed if seed is None else seed)

    # ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) for matrices and embeddings, Normal(0, router_init_std) for
        routers, ones for norms, zeros for the expert bias. Deterministic in ``seed``."""
        g = torch.Generator().manual_seed(seed)
        std, rstd = self.cfg.model.init_std, self.cfg.moe.router_init_std
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                s = rstd if name.endswith("gate.weight") else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
        for b in self.expert_biases():
            b.zero_()

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.ffn for layer in self.model.layers if layer.is_moe]

    def expert_biases(self) -> list[torch.Tensor]:
        """The ``e_score_correction_bias`` buffers (one per MoE layer; DeepSeek-V3 only)."""
        return [b.gate.e_score_correction_bias for b in self.moe_blocks() if b.gate.e_score_correction_bias is not None]

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.cfg.compute.dtype]

    # ---------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, forced_idx: torch.Tensor | None = None, return_probes: bool = False,
                segment_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        """``tokens [B, S]`` -> ``(logits [B, S, V] fp32, aux)``.

        Packed documents: ``segment_ids [B, S]`` (1, 2, ... per row, 0 = padding) keep attention
        inside each document; ``positions [B, S]`` (position in the document) drive RoPE. None:
        causal over the whole row, positions 0..S-1.

        ``forced_idx [Lm, T, k]`` (T = B*S row-major) replays a routing. aux:
        ``router`` {logits, scores [Lm, T, E], topk_idx, topk_weights [Lm, T, k]},
        ``counts [Lm, E]``, ``dropped [Lm]``, ``losses`` {lb, seq_aux, router_z} summed over MoE
        layers, and with ``return_probes`` ``probes`` {embedding, attn_out [L, B, S, D],
        router_logits, moe_out [Lm, B, S, D], ffn_out [Ld, B, S, D], final_hidden, logits}.
        """
        m, e = self.cfg.model, self.cfg.moe
        b, s = tokens.shape
        t = b * s
        x = self.model.embed_tokens(tokens).to(self.compute_dtype)
        embedding = x
        cos, sin = rope_tables(m, s, positions)
        attn_outs, moe_outs, ffn_outs, auxes = [], [], [], []
        j = 0
        for layer in self.model.layers:
            forced = None
            if layer.is_moe and forced_idx is not None:
                forced = forced_idx[j]
            x, attn_out, ffn_out, aux = layer(x, cos, sin, forced, segment_ids)
            attn_outs.append(attn_out)
            if aux is None:
                ffn_outs.append(ffn_out)
            else:
                moe_outs.append(ffn_out)
                auxes.append(aux)
                j += 1
        final = self.model.norm(x)
        if self.lm_head is not None:
            logits = self.lm_head(final).float()
        else:
            logits = (final @ self.model.embed_tokens.weight.to(final.dtype).t()).float()

        def stack(key, shape, dtype):
            if not auxes:
                return torch.zeros(0, *shape, dtype=dtype)
            return torch.stack([a[key] for a in auxes])

        k, n = e.top_k, e.n_experts
        zero = torch.zeros((), dtype=torch.float32)
        out = {
            "router": {
                "logits": stack("logits", (t, n), torch.float32),
                "scores": stack("scores", (t, n), torch.float32),
                "topk_idx": stack("topk_idx", (t, k), torch.int64),
                "topk_weights": stack("topk_weights", (t, k), torch.float32),
            },
            "counts": stack("counts", (n,), torch.int64),
            "dropped": stack("dropped", (), torch.int64),
            "losses": {
                name: sum((a["losses"][name] for a in auxes), zero) for name in ("lb", "seq_aux", "router_z")
            },
        }
        if return_probes:
            d = m.d_model

            def stack_or_empty(xs):
                return torch.stack(xs) if xs else torch.zeros(0, b, s, d, dtype=x.dtype)

            out["probes"] = {
                "embedding": embedding,
                "attn_out": torch.stack(attn_outs),
                "router_logits": out["router"]["logits"],
                "moe_out": stack_or_empty(moe_outs),
                "ffn_out": stack_or_empty(ffn_outs),
                "final_hidden": final,
                "logits": logits,
            }
        return logits, out
