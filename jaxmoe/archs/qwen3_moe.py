"""Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with QK-norm, softmax routing, optional dense layers."""

from __future__ import annotations

from jaxmoe.archs.base import Arch
from jaxmoe.archs.common import COMMON_DEFAULTS, GQA_ON_IMPORT, get, gqa_from_hf, gqa_to_hf
from jaxmoe.errors import ConfigError


def to_hf(cfg) -> dict:
    m, e = cfg.model, cfg.moe
    d = gqa_to_hf(cfg)
    d.update(
        num_experts=e.n_experts,
        moe_intermediate_size=e.expert_ffn_dim,
        norm_topk_prob=e.norm_topk_prob,
        intermediate_size=m.dense_ffn_dim,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(m.first_k_dense)),
        use_sliding_window=False,
        attention_bias=False,
    )
    return d


def from_hf(d: dict, cfg) -> None:
    m, e = cfg.model, cfg.moe
    gqa_from_hf(d, cfg)
    m.qk_norm = True
    e.n_experts = int(get(d, "num_experts", "num_local_experts"))
    e.expert_ffn_dim = int(get(d, "moe_intermediate_size"))
    e.norm_topk_prob = bool(get(d, "norm_topk_prob"))
    m.dense_ffn_dim = int(get(d, "intermediate_size"))
    dense = list(d.get("mlp_only_layers") or [])
    step = int(d.get("decoder_sparse_step", 1))
    if step != 1:
        raise ConfigError(f"config.json decoder_sparse_step={step} is not supported (1)")
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"config.json mlp_only_layers={dense} is not supported: dense layers must be "
            "the first k layers [0, 1, ..., k-1]"
        )
    m.first_k_dense = len(dense)


# transformers' Qwen3MoeConfig defaults (5.25), by config.json key. head_dim has no default:
# HF derives hidden_size // num_attention_heads.
HF_DEFAULTS = dict(
    COMMON_DEFAULTS,
    attention_bias=False,
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
    rms_norm_eps=1e-6, use_sliding_window=False, decoder_sparse_step=1, moe_intermediate_size=768,
    num_experts_per_tok=8, num_experts=128, norm_topk_prob=False, router_aux_loss_coef=0.001,
    mlp_only_layers=[],
)

ARCH = Arch(
    name="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    model_types=("qwen3_moe",),
    attention="gqa",
    score_func="softmax",
    features=frozenset({"dense_layers", "unnormalised_topk", "yarn"}),
    required=frozenset({"qk_norm"}),
    moe_module={"per-expert": "mlp", "fused": "mlp"},
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    bias_tensor=False,
    to_hf=to_hf,
    from_hf=from_hf,
    hf_defaults=HF_DEFAULTS,
    hf_aliases=(("num_experts", "num_local_experts"),),
    on_import=GQA_ON_IMPORT,
    doc=__doc__.splitlines()[0],
)
