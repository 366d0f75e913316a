"""Mixtral (``MixtralForCausalLM``): GQA, softmax top-k always renormalised, no dense layers.

Its per-expert hub layout keeps the MoE block under ``block_sparse_moe.`` with projections
``w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5.x's fused layout renames the block to
``mlp.``.
"""

from __future__ import annotations

from jaxmoe.archs.base import Arch
from jaxmoe.archs.common import get, gqa_from_hf, gqa_to_hf
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
    doc=__doc__.splitlines()[0],
)
