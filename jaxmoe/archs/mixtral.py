"""Mixtral (``MixtralForCausalLM``): GQA, softmax top-k always renormalised, no dense layers.

Its per-expert hub layout keeps the MoE block under ``block_sparse_moe.`` with projections
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5.x's fused layout renames the block to
``mlp.``.
"""

from __future__ import annotations

from jaxmoe.archs.base import Arch
from jaxmoe.archs.common import COMMON_DEFAULTS, GQA_ON_IMPORT, get, gqa_from_hf, gqa_to_hf
from jaxmoe.errors import ConfigError


def to_hf(cfg) -> dict:
    e = cfg.moe
    d = gqa_to_hf(cfg)
    # intermediate_size is the expert width; top-k is always renormalised
    d.update(num_local_experts=e.n_experts, intermediate_size=e.expert_ffn_dim)
    return d


def from_hf(d: dict, cfg) -> None:
    m, e = cfg.model, cfg.moe
    gqa_from_hf(d, cfg)
    m.qk_norm = False
    m.first_k_dense = 0
    e.n_experts = int(get(d, "num_local_experts", "num_experts"))
    e.expert_ffn_dim = int(get(d, "intermediate_size"))
    e.norm_topk_prob = True
    if d.get("router_jitter_noise"):
        raise ConfigError("config.json router_jitter_noise > 0 is not supported")


# transformers' MixtralConfig defaults (5.25), by config.json key. head_dim: null -> HF derives
# hidden_size // num_attention_heads; num_key_value_heads: null -> num_attention_heads.
HF_DEFAULTS = dict(
    COMMON_DEFAULTS,
    rope_theta=1e6,  # MixtralConfig.default_theta
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
    rms_norm_eps=1e-5, sliding_window=None, num_experts_per_tok=2, num_local_experts=8,
    router_aux_loss_coef=0.001, router_jitter_noise=0.0,
)

ARCH = Arch(
    name="mixtral",
    hf_class="MixtralForCausalLM",
    model_types=("mixtral",),
    attention="gqa",
    score_func="softmax",
    features=frozenset({"yarn"}),
    required=frozenset(),
    moe_module={"per-expert": "block_sparse_moe", "fused": "mlp"},
    expert_projections=("w1", "w3", "w2"),
    bias_tensor=False,
    to_hf=to_hf,
    from_hf=from_hf,
    hf_defaults=HF_DEFAULTS,
    hf_aliases=(("num_local_experts", "num_experts"),),
    on_import=GQA_ON_IMPORT,
    doc=__doc__.splitlines()[0],
)
