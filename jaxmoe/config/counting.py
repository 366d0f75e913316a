"""Analytic parameter counts and training FLOPs of a config (pure Python, no jax).

``count_params(cfg)`` counts every trained weight from the config alone (``jaxmoe count`` prints
it; tests check it equals the model's own parameter count), ``flops_per_token`` the training
FLOPs per token used for MFU.
"""

from __future__ import annotations

COUNT_METHOD = (
    "Counted analytically from the config: every trained weight (embedding, attention, norms, "
    "dense FFNs, router weights, routed and shared experts, final norm, and the LM head when "
    "untied). Expert-bias buffers (not trained) are excluded; multi-token-prediction depths "
    "(model.mtp_layers: each one decoder layer plus enorm, hnorm, eh_proj and its norm; the "
    "embedding and head shared) are counted apart (mtp_params), not in total or active. "
    "Active per token = total minus the routed experts a token does not visit "
    "((n_experts - top_k) per MoE layer); embeddings and head are counted in both."
)


def count_params(cfg) -> dict:
    """Analytic counts of total and per-token-active parameters, with a breakdown."""
    m, e = cfg.model, cfg.moe
    d = m.d_model
    if m.attention == "gqa":
        attn = d * m.n_heads * m.head_dim + 2 * d * m.n_kv_heads * m.head_dim
        attn += m.n_heads * m.head_dim * d
        if m.qk_norm:
            attn += 2 * m.head_dim
    else:
        qh = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            attn = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.n_heads * qh
        else:
            attn = d * m.n_heads * qh
        attn += d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        attn += m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
        attn += m.n_heads * m.v_head_dim * d
    norms = 2 * d
    dense_ffn = 3 * d * m.dense_ffn_dim
    expert = 3 * d * e.expert_ffn_dim
    shared = e.n_shared_experts * expert
    router = d * e.n_experts
    dense_layer = attn + norms + dense_ffn
    moe_layer_total = attn + norms + router + e.n_experts * expert + shared
    moe_layer_active = attn + norms + router + e.top_k * expert + shared
    embed = m.vocab_size * d
    head = 0 if m.tie_embeddings else m.vocab_size * d
    final_norm = d
    base = embed + head + final_norm + m.first_k_dense * dense_layer
    total = base + m.n_moe_layers * moe_layer_total
    active = base + m.n_moe_layers * moe_layer_active
    # an MTP depth: its block (MoE when the model has MoE layers) + enorm, hnorm, norm + eh_proj
    mtp_depth = (moe_layer_total if m.n_moe_layers > 0 else dense_layer) + 3 * d + 2 * d * d
    return {
        "name": m.name,
        "total_params": int(total),
        "active_params": int(active),
        "mtp_params": int(m.mtp_layers * mtp_depth),
        # DeepSeek-V3's HF checkpoint also stores a copy of the embedding and the head per depth
        "mtp_params_hf_stored": int(m.mtp_layers * (mtp_depth + 2 * embed)),
        "breakdown": {
            "embedding": embed,
            "lm_head": head,
            "attention_per_layer": attn,
            "dense_ffn_per_layer": dense_ffn,
            "router_per_moe_layer": router,
            "expert_params_each": expert,
            "shared_expert_params_per_moe_layer": shared,
            "routed_expert_params_total": m.n_moe_layers * e.n_experts * expert,
        },
        "dims": {
            "vocab_size": m.vocab_size,
            "d_model": d,
            "n_layers": m.n_layers,
            "first_k_dense": m.first_k_dense,
            "mtp_layers": m.mtp_layers,
            "n_moe_layers": m.n_moe_layers,
            "attention": m.attention,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads if m.attention == "gqa" else None,
            "head_dim": m.head_dim if m.attention == "gqa" else None,
            "q_lora_rank": m.q_lora_rank if m.attention == "mla" else None,
            "kv_lora_rank": m.kv_lora_rank if m.attention == "mla" else None,
            "qk_nope_head_dim": m.qk_nope_head_dim if m.attention == "mla" else None,
            "qk_rope_head_dim": m.qk_rope_head_dim if m.attention == "mla" else None,
            "v_head_dim": m.v_head_dim if m.attention == "mla" else None,
            "dense_ffn_dim": m.dense_ffn_dim,
            "n_experts": e.n_experts,
            "top_k": e.top_k,
            "expert_ffn_dim": e.expert_ffn_dim,
            "n_shared_experts": e.n_shared_experts,
            "tie_embeddings": m.tie_embeddings,
        },
        "method": COUNT_METHOD,
    }


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def flops_per_token(cfg, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 x the active matmul parameters (the input embedding is a lookup,
    not a matmul; a tied embedding counts once, as the head) plus causal attention: per layer and
    head, q.k and p.v over on average S/2 keys, 2 * (qk + v) * S / 2 forward, x3 with backward."""
    c = count_params(cfg)
    m = cfg.model
    s = seq_len or cfg.train.seq_len
    active_matmul = c["active_params"] - c["breakdown"]["embedding"]
    if m.tie_embeddings:
        active_matmul += c["breakdown"]["embedding"]
    qk = m.q_head_dim
    v = m.v_head_dim if m.attention == "mla" else m.head_dim
    attn_fwd = m.n_layers * m.n_heads * s * (qk + v)  # causal: half of the full 2 * S * (qk + v)
    return 6.0 * active_matmul + 3.0 * attn_fwd


__all__ = ["COUNT_METHOD", "count_params", "flops_per_token", "human"]
