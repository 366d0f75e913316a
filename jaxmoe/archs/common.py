"""config.json pieces shared by several architecture records (pure Python)."""

from __future__ import annotations

from typing import Any

from jaxmoe.errors import ConfigError


def get(d: dict, *keys: str, default: Any = ...) -> Any:
    """The first of ``keys`` present (and not null) in config.json ``d``; ConfigError when none
    is and there is no ``default``."""
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    if default is ...:
        raise ConfigError(f"config.json lacks {' / '.join(keys)} (model_type {d.get('model_type')!r})")
    return default


def gqa_to_hf(cfg) -> dict:
    """config.json keys of the GQA + softmax architectures (Qwen3-MoE, Mixtral)."""
    m, e = cfg.model, cfg.moe
    return dict(
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        router_aux_loss_coef=e.lb_coef,
        sliding_window=None,
    )


def gqa_from_hf(d: dict, cfg) -> None:
    """Read the GQA + softmax keys; the routing semantics these architectures fix."""
    m, e = cfg.model, cfg.moe
    m.attention = "gqa"
    m.n_kv_heads = int(get(d, "num_key_value_heads", default=m.n_heads))
    # absent or null head_dim: HF derives hidden_size // num_attention_heads
    m.head_dim = int(get(d, "head_dim", default=m.d_model // m.n_heads))
    m.rope_layout = "half"
    e.score_func = "softmax"
    e.route_scale = 1.0
    e.n_groups = 1
    e.topk_groups = 1
    e.use_expert_bias = False
    e.n_shared_experts = 0
    # HF's coefficient multiplies its pooled load-balance loss (the records' on_import sets
    # moe.lb_scope = "pooled")
    e.lb_coef = float(get(d, "router_aux_loss_coef"))


# config.json keys every supported transformers config class shares, with their class defaults
COMMON_DEFAULTS = dict(
    hidden_act="silu",
    initializer_range=0.02,
    tie_word_embeddings=False,
    rope_theta=10000.0,  # PreTrainedConfig.default_theta (Mixtral overrides it)
)

# What an HF import of Qwen3-MoE / Mixtral means for training: transformers' pooled
# load_balancing_loss_func is what router_aux_loss_coef multiplies
GQA_ON_IMPORT = {"moe.lb_scope": "pooled"}

__all__ = ["COMMON_DEFAULTS", "GQA_ON_IMPORT", "get", "gqa_from_hf", "gqa_to_hf"]
