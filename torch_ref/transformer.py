"""The whole PyTorch reference model: embed -> [dense blocks] -> [MoE blocks] -> norm -> lm head.

``TorchTransformer(cfg).state_dict()`` has exactly the HF hub tensor names of
``cfg.model.hf_arch`` (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.*``,
``model.layers.{i}.mlp.*`` / Mixtral ``block_sparse_moe.*``, ``model.norm.weight``,
``lm_head.weight`` unless tied), linear weights ``[out, in]``; so HF checkpoints load with a plain
``load_state_dict`` (see ``torch_ref.hf_io``).

Multi-token prediction (``model.mtp_layers = N``; DeepSeek-V3, arXiv 2412.19437 section 2.2): HF
layers ``L .. L+N-1`` are the depths, each a decoder layer (MoE when the model has MoE layers) with
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``. Depth ``k``'s input at position ``i``
is ``eh_proj(cat[enorm(embed(token[i+k])), hnorm(h_{k-1}[i])])`` with ``h_0`` the last main
layer's output before ``model.norm``; where ``i+k`` is past the row (or in another packed
document) the token is 0 and ``h_{k-1}`` is zeroed. Its output goes through ``shared_head.norm``
and the shared LM head: ``aux["mtp_logits"] [N, B, S, V]``.
"""

from __future__ import annotations

import torch
from torch import nn

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from torch_ref import fp8
from torch_ref.attention import make_attention
from torch_ref.layers import DTYPES, Linear, RMSNorm, SwiGLU, rope_tables, shift_left
from torch_ref.moe import MoEBlock


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``; the FFN is a dense SwiGLU
    for the first ``first_k_dense`` layers and a MoE block after."""

    def __init__(self, cfg: Config, index: int):
        super().__init__()
        m = cfg.model
        # an MTP depth (index >= n_layers) is a MoE layer when the model has MoE layers
        self.is_moe = index >= m.first_k_dense if index < m.n_layers else m.n_moe_layers > 0
        # the HF module name of a MoE layer's FFN in the hub (per-expert) layout
        self.ffn_name = get_arch(m.hf_arch).moe_module["per-expert"] if self.is_moe else "mlp"
        self.self_attn = make_attention(m)
        self.input_layernorm = RMSNorm(m.d_model, m.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(m.d_model, m.rms_norm_eps)
        ffn = MoEBlock(cfg) if self.is_moe else SwiGLU(m.d_model, m.dense_ffn_dim)
        self.add_module(self.ffn_name, ffn)
        if index >= m.n_layers:  # multi-token prediction depth index - n_layers + 1
            self.enorm = RMSNorm(m.d_model, m.rms_norm_eps)
            self.hnorm = RMSNorm(m.d_model, m.rms_norm_eps)
            self.eh_proj = Linear(2 * m.d_model, m.d_model)
            self.shared_head = nn.Module()
            self.shared_head.norm = RMSNorm(m.d_model, m.rms_norm_eps)

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
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(m.n_layers + m.mtp_layers))
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
        """The main layers' MoE blocks (not the MTP depths': their routing adds no loss and their
        bias is not updated, as in jaxmoe)."""
        return [layer.ffn for layer in self.model.layers[: self.cfg.model.n_layers] if layer.is_moe]

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
        for layer in self.model.layers[: m.n_layers]:
            forced = None
            if layer.is_moe and forced_idx is not None:
                forced = forced_idx[j]
            with fp8.using(self.cfg.compute.fp8):  # the LM head (below) and the router stay high precision
                x, attn_out, ffn_out, aux = layer(x, cos, sin, forced, segment_ids)
            attn_outs.append(attn_out)
            if aux is None:
                ffn_outs.append(ffn_out)
            else:
                moe_outs.append(ffn_out)
                auxes.append(aux)
                j += 1
        final = self.model.norm(x)
        logits = self.head(final)
        mtp_logits = self.mtp(tokens, x, cos, sin, segment_ids) if m.mtp_layers > 0 else None

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
        if mtp_logits is not None:
            out["mtp_logits"] = mtp_logits
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

    def head(self, final: torch.Tensor) -> torch.Tensor:
        """The shared LM head (``lm_head`` or the tied embedding) -> fp32 logits."""
        if self.lm_head is not None:
            return self.lm_head(final).float()
        return (final @ self.model.embed_tokens.weight.to(final.dtype).t()).float()

    def mtp(self, tokens, h, cos, sin, segment_ids=None) -> torch.Tensor:
        """The MTP depths (module doc) from ``h_0 = h``: logits ``[N, B, S, V]``."""
        out = []
        for k, layer in enumerate(self.model.layers[self.cfg.model.n_layers:], 1):
            tok, valid = shift_left(tokens, k, segment_ids)
            emb = self.model.embed_tokens(tok).to(self.compute_dtype)
            h = h * valid[..., None].to(h.dtype)
            x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))
            h, _, _, _ = layer(x, cos, sin, None, segment_ids)
            out.append(self.head(layer.shared_head.norm(h)))
        return torch.stack(out)

