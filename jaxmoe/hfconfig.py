"""HuggingFace ``config.json`` <-> jaxmoe :class:`~jaxmoe.config.Config` (pure Python).

Shared by ``jaxmoe.port`` and ``torch_ref.hf_io``; imports neither jax nor torch.

Three HF architectures are supported, chosen by ``cfg.model.hf_arch``:

======================  =========================  ===========================================
``hf_arch``             HF class                   what it expresses
======================  =========================  ===========================================
``deepseek_v3``         ``DeepseekV3ForCausalLM``  MLA, sigmoid routing with expert bias, groups,
                                                   route scale, shared experts, dense first layers,
                                                   YaRN, interleaved or half-split RoPE
``qwen3_moe``           ``Qwen3MoeForCausalLM``    GQA with QK-norm (always), softmax routing,
                                                   optional renormalisation, dense first layers
``mixtral``             ``MixtralForCausalLM``     GQA, softmax top-k always renormalised
======================  =========================  ===========================================

A jaxmoe config the target architecture cannot express (e.g. ``route_scale != 1`` for Qwen3)
raises :class:`ConfigError` naming the key, rather than writing a config.json that HF would load
into a different model.

RoPE settings: transformers 5.x keeps them in ``rope_parameters`` (``rope_type``, ``rope_theta``,
``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
``mscale_all_dim``); transformers 4.x and hub configs such as DeepSeek-V3's and Kimi-K2's use a
top-level ``rope_theta`` plus ``rope_scaling`` (with ``type`` or ``rope_type``). :func:`to_hf_config`
writes ``rope_parameters`` and the top-level ``rope_theta`` (read by 4.x); :func:`from_hf_config`
reads all of these forms.

Fields HF has no key for (mesh, train, expert compute path, ...) are taken from ``base`` in
:func:`from_hf_config` (defaults when ``base`` is None), so
``from_hf_config(to_hf_config(cfg), base=cfg) == cfg``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmoe.config import Config, ConfigError, SECTIONS, validate

ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

# model_type in a config.json -> our hf_arch. Kimi-K2 ships the DeepSeek-V3 architecture under its
# own model_type (and remote code); its weights use DeepSeek-V3 names.
MODEL_TYPES = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


# --------------------------------------------------------------------------------------------
# jaxmoe -> HF
# --------------------------------------------------------------------------------------------


def _need(cond: bool, arch: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"hf_arch={arch!r} cannot express {msg}")


def _rope_parameters(cfg: Config) -> dict:
    m = cfg.model
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_theta)}
    if m.rope_scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(m.yarn_factor),
            original_max_position_embeddings=int(m.yarn_original_max_pos),
            beta_fast=float(m.yarn_beta_fast),
            beta_slow=float(m.yarn_beta_slow),
            mscale=float(m.yarn_mscale),
            mscale_all_dim=float(m.yarn_mscale_all_dim),
        )
    return rope


def to_hf_config(cfg: Config, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of ``cfg`` for its ``cfg.model.hf_arch``.

    ``dtype`` is the dtype the weights are stored in (written as ``dtype`` for transformers 5.x and
    ``torch_dtype`` for 4.x). Raises ConfigError when the architecture cannot express ``cfg``.
    """
    m, e = cfg.model, cfg.moe
    arch = m.hf_arch
    if arch not in ARCHITECTURES:
        raise ConfigError(f"model.hf_arch={arch!r} is not one of: {', '.join(ARCHITECTURES)}")
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "max_position_embeddings": m.max_seq_len,
        "initializer_range": m.init_std,
        "tie_word_embeddings": m.tie_embeddings,
        "num_experts_per_tok": e.top_k,
        "moe_intermediate_size": e.expert_ffn_dim,
        "norm_topk_prob": e.norm_topk_prob,
        "rope_theta": float(m.rope_theta),
        "rope_parameters": _rope_parameters(cfg),
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "deepseek_v3":
        _need(m.attention == "mla", arch, f"model.attention={m.attention!r} (MLA only)")
        _need(e.score_func == "sigmoid", arch, f"moe.score_func={e.score_func!r} (sigmoid only)")
        d.update(
            num_key_value_heads=m.n_heads,
            q_lora_rank=m.q_lora_rank if m.q_lora_rank > 0 else None,
            kv_lora_rank=m.kv_lora_rank,
            qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim,
            qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim,
            head_dim=m.qk_rope_head_dim,  # what DeepseekV3Config derives (RoPE width)
            v_head_dim=m.v_head_dim,
            rope_interleave=m.rope_layout == "interleaved",
            intermediate_size=m.dense_ffn_dim,
            first_k_dense_replace=m.first_k_dense,
            moe_layer_freq=1,
            n_routed_experts=e.n_experts,
            n_shared_experts=e.n_shared_experts,
            routed_scaling_factor=e.route_scale,
            n_group=e.n_groups,
            topk_group=e.topk_groups,
            scoring_func="sigmoid",
            # noaux_tc = DeepSeek-V3's bias-corrected selection. HF always adds
            # e_score_correction_bias; with use_expert_bias=False it is kept at zero.
            topk_method="noaux_tc" if e.use_expert_bias else "greedy",
            seq_aux=e.seq_aux_coef > 0,
            aux_loss_alpha=e.seq_aux_coef,
            num_nextn_predict_layers=0,  # jaxmoe has no multi-token-prediction layers
            attention_bias=False,
        )
    else:
        _need(m.attention == "gqa", arch, f"model.attention={m.attention!r} (GQA only)")
        _need(e.score_func == "softmax", arch, f"moe.score_func={e.score_func!r} (softmax only)")
        _need(e.route_scale == 1.0, arch, f"moe.route_scale={e.route_scale} (must be 1.0)")
        _need(e.n_groups == 1, arch, f"moe.n_groups={e.n_groups} (no group-limited routing)")
        _need(e.n_shared_experts == 0, arch, f"moe.n_shared_experts={e.n_shared_experts} (none)")
        _need(m.rope_layout == "half", arch, f"model.rope_layout={m.rope_layout!r} (half only)")
        d.update(
            num_key_value_heads=m.n_kv_heads,
            head_dim=m.head_dim,
            router_aux_loss_coef=e.lb_coef,
            sliding_window=None,
        )
        if arch == "qwen3_moe":
            _need(m.qk_norm, arch, "model.qk_norm=false (Qwen3-MoE always has q_norm/k_norm)")
            d.update(
                num_experts=e.n_experts,
                intermediate_size=m.dense_ffn_dim,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(m.first_k_dense)),
                use_sliding_window=False,
                attention_bias=False,
            )
        else:  # mixtral: intermediate_size is the expert width; top-k is always renormalised
            _need(not m.qk_norm, arch, "model.qk_norm=true")
            _need(m.first_k_dense == 0, arch, f"model.first_k_dense={m.first_k_dense} (none)")
            _need(e.norm_topk_prob, arch, "moe.norm_topk_prob=false (Mixtral always renormalises)")
            del d["moe_intermediate_size"], d["norm_topk_prob"]
            d.update(num_local_experts=e.n_experts, intermediate_size=e.expert_ffn_dim)
    return d


# --------------------------------------------------------------------------------------------
# HF -> jaxmoe
# --------------------------------------------------------------------------------------------


def _rope_dict(d: dict) -> dict:
    """The RoPE settings of a config.json in one flat dict, whatever its transformers version."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json rope_parameters/rope_scaling must be a dict, got {rope!r}")
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return rope


def _get(d: dict, *keys: str, default: Any = ...) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    if default is ...:
        raise ConfigError(f"config.json lacks {' / '.join(keys)} (model_type {d.get('model_type')!r})")
    return default


def from_hf_config(d: dict, base: Config | None = None) -> Config:
    """Build a Config from a HF ``config.json`` dict (DeepSeek-V3 / Kimi-K2, Qwen3-MoE, Mixtral).

    Sections and fields HF does not describe come from ``base`` (the defaults when None). The
    result is validated. Settings the architecture's HF code would run but jaxmoe cannot
    (sliding windows, attention biases, other RoPE types, activations other than SiLU, interleaved
    dense/MoE layers) raise ConfigError naming the key.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported; supported: "
            + ", ".join(MODEL_TYPES)
        )
    arch = MODEL_TYPES[model_type]
    given_base = base is not None
    base = base if base is not None else Config()
    cfg = Config(
        **{s: dataclasses.replace(getattr(base, s)) for s in SECTIONS},
        description=base.description,
    )
    m, e = cfg.model, cfg.moe

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json hidden_act={act!r} is not supported (SwiGLU with silu only)")
    if d.get("attention_bias"):
        raise ConfigError("config.json attention_bias=true is not supported (no attention biases)")
    if d.get("use_sliding_window") or (arch == "mixtral" and d.get("sliding_window")):
        raise ConfigError("config.json sliding_window attention is not supported; set it to null")

    m.hf_arch = arch
    if not given_base:
        m.name = str(d.get("_name_or_path") or model_type).rstrip("/").split("/")[-1] or model_type
    m.vocab_size = int(_get(d, "vocab_size"))
    m.d_model = int(_get(d, "hidden_size"))
    m.n_layers = int(_get(d, "num_hidden_layers"))
    m.n_heads = int(_get(d, "num_attention_heads"))
    m.rms_norm_eps = float(_get(d, "rms_norm_eps", default=1e-6))
    m.max_seq_len = int(_get(d, "max_position_embeddings", default=m.max_seq_len))
    m.init_std = float(_get(d, "initializer_range", default=m.init_std))
    m.tie_embeddings = bool(d.get("tie_word_embeddings", False))
    e.top_k = int(_get(d, "num_experts_per_tok"))

    rope = _rope_dict(d)
    m.rope_theta = float(rope["rope_theta"])
    if rope["rope_type"] == "default":
        m.rope_scaling = "none"
    elif rope["rope_type"] == "yarn":
        if rope.get("truncate", True) is False:
            raise ConfigError("config.json rope_parameters.truncate=false is not supported")
        m.rope_scaling = "yarn"
        orig = int(_get(rope, "original_max_position_embeddings", default=m.max_seq_len))
        m.yarn_original_max_pos = orig
        factor = rope.get("factor")
        m.yarn_factor = float(factor) if factor is not None else m.max_seq_len / orig
        m.yarn_beta_fast = float(rope.get("beta_fast") or 32.0)
        m.yarn_beta_slow = float(rope.get("beta_slow") or 1.0)
        # Absent mscale / mscale_all_dim behave in HF exactly like 1.0 / 0.0 here.
        m.yarn_mscale = float(rope.get("mscale") if rope.get("mscale") is not None else 1.0)
        m.yarn_mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
        if rope.get("attention_factor") is not None:
            raise ConfigError("config.json rope_parameters.attention_factor is not supported")
    else:
        raise ConfigError(
            f"config.json rope type {rope['rope_type']!r} is not supported (default or yarn)"
        )

    if arch == "deepseek_v3":
        scoring = d.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"config.json scoring_func={scoring!r} is not supported (sigmoid)")
        if int(d.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"config.json moe_layer_freq={d['moe_layer_freq']} is not supported (1)")
        kv = d.get("num_key_value_heads")
        if kv is not None and int(kv) != m.n_heads:
            raise ConfigError(
                f"config.json num_key_value_heads={kv} must equal num_attention_heads={m.n_heads} "
                "for MLA"
            )
        m.attention = "mla"
        m.qk_norm = False
        m.q_lora_rank = int(d.get("q_lora_rank") or 0)
        m.kv_lora_rank = int(_get(d, "kv_lora_rank"))
        m.qk_nope_head_dim = int(_get(d, "qk_nope_head_dim"))
        m.qk_rope_head_dim = int(_get(d, "qk_rope_head_dim"))
        m.v_head_dim = int(_get(d, "v_head_dim"))
        qk = d.get("qk_head_dim")
        if qk is not None and int(qk) != m.qk_nope_head_dim + m.qk_rope_head_dim:
            raise ConfigError(
                f"config.json qk_head_dim={qk} contradicts qk_nope_head_dim + qk_rope_head_dim = "
                f"{m.qk_nope_head_dim + m.qk_rope_head_dim}"
            )
        m.rope_layout = "interleaved" if d.get("rope_interleave", True) else "half"
        m.first_k_dense = int(d.get("first_k_dense_replace") or 0)
        m.dense_ffn_dim = int(_get(d, "intermediate_size"))
        e.n_experts = int(_get(d, "n_routed_experts", "num_local_experts"))
        e.expert_ffn_dim = int(_get(d, "moe_intermediate_size"))
        e.n_shared_experts = int(d.get("n_shared_experts") or 0)
        e.score_func = "sigmoid"
        e.norm_topk_prob = bool(d.get("norm_topk_prob", True))
        e.route_scale = float(d.get("routed_scaling_factor", 1.0))
        e.n_groups = int(d.get("n_group") or 1)
        e.topk_groups = int(d.get("topk_group") or 1)
        # HF's DeepseekV3 always selects with e_score_correction_bias; only an explicit
        # non-noaux_tc topk_method (DeepSeek's own config key) turns the bias off.
        e.use_expert_bias = d.get("topk_method", "noaux_tc") == "noaux_tc"
        if d.get("seq_aux", False):
            e.seq_aux_coef = float(d.get("aux_loss_alpha", 0.0))
        elif "seq_aux" in d:
            e.seq_aux_coef = 0.0
    else:
        m.attention = "gqa"
        m.n_kv_heads = int(_get(d, "num_key_value_heads", default=m.n_heads))
        m.head_dim = int(_get(d, "head_dim", default=m.d_model // m.n_heads))
        m.rope_layout = "half"
        e.score_func = "softmax"
        e.route_scale = 1.0
        e.n_groups = 1
        e.topk_groups = 1
        e.use_expert_bias = False
        e.n_shared_experts = 0
        if "router_aux_loss_coef" in d:
            e.lb_coef = float(d["router_aux_loss_coef"])
        if arch == "qwen3_moe":
            m.qk_norm = True
            e.n_experts = int(_get(d, "num_experts", "num_local_experts"))
            e.expert_ffn_dim = int(_get(d, "moe_intermediate_size"))
            e.norm_topk_prob = bool(d.get("norm_topk_prob", False))
            m.dense_ffn_dim = int(_get(d, "intermediate_size", default=m.dense_ffn_dim))
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
        else:  # mixtral
            m.qk_norm = False
            m.first_k_dense = 0
            e.n_experts = int(_get(d, "num_local_experts", "num_experts"))
            e.expert_ffn_dim = int(_get(d, "intermediate_size"))
            e.norm_topk_prob = True
            if d.get("router_jitter_noise"):
                raise ConfigError("config.json router_jitter_noise > 0 is not supported")
    if cfg.train.seq_len > m.max_seq_len:
        cfg.train.seq_len = m.max_seq_len
    return validate(cfg)


__all__ = ["ARCHITECTURES", "MODEL_TYPES", "from_hf_config", "to_hf_config"]
