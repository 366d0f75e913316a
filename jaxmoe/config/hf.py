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

from jaxmoe.archs import arch_for_model_type, get_arch
from jaxmoe.archs.common import get as _get
from jaxmoe.config import SECTIONS, Config, validate
from jaxmoe.errors import ConfigError

# --------------------------------------------------------------------------------------------
# jaxmoe -> HF
# --------------------------------------------------------------------------------------------


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
            mscale_all_dim=float(m.yarn_mscale_all_dim),
        )
        if m.yarn_mscale:  # 0 = absent (HF then uses mscale(factor) alone)
            rope["mscale"] = float(m.yarn_mscale)
        if m.yarn_attention_factor:  # 0 = absent (derived from factor / mscale)
            rope["attention_factor"] = float(m.yarn_attention_factor)
    return rope


def to_hf_config(cfg: Config, dtype: str = "float32") -> dict:
    """The ``config.json`` dict of ``cfg`` for its ``cfg.model.hf_arch``.

    ``dtype`` is the dtype the weights are stored in (written as ``dtype`` for transformers 5.x and
    ``torch_dtype`` for 4.x). Raises ConfigError when the architecture cannot express ``cfg``.
    """
    m, e = cfg.model, cfg.moe
    arch = get_arch(m.hf_arch)
    arch.check(cfg)
    d: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.name,
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
        "rope_theta": float(m.rope_theta),
        "rope_parameters": _rope_parameters(cfg),
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    d.update(arch.to_hf(cfg))
    return d


# --------------------------------------------------------------------------------------------
# HF -> jaxmoe
# --------------------------------------------------------------------------------------------


def _rope_dict(d: dict) -> dict:
    """The RoPE settings of a config.json in one flat dict, whatever its transformers version
    (as transformers' ``standardize_rope_params``: ``rope_parameters`` or 4.x ``rope_scaling``,
    the top-level ``rope_theta`` -- ``d`` already holds the class default -- filling in)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json rope_parameters/rope_scaling must be a dict, got {rope!r}")
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = _get(d, "rope_theta")
    if d.get("original_max_position_embeddings") is not None:  # top level wins in HF (Phi3 style)
        rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    return rope


def from_hf_config(d: dict, base: Config | None = None) -> Config:
    """Build a Config from a HF ``config.json`` dict (DeepSeek-V3 / Kimi-K2, Qwen3-MoE, Mixtral).

    A key missing from ``d`` means transformers' class default for its ``model_type`` (the
    architecture record's ``hf_defaults``), never jaxmoe's. The semantics HF fixes are set whatever
    ``base`` says: dropless routing (capacity 0), the architecture's load-balance form
    (``moe.lb_scope``) and MLA norm eps. Other sections and fields HF does not describe come from
    ``base`` (the defaults when None). The result is validated. Settings the architecture's HF code
    would run but jaxmoe cannot (sliding windows, attention biases, other RoPE types, activations
    other than SiLU, interleaved dense/MoE layers) raise ConfigError naming the key.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    arch = arch_for_model_type(model_type)
    d = arch.with_defaults(d)  # a missing key = transformers' class default (explicit nulls kept)
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
    if d.get("use_sliding_window") or (arch.name == "mixtral" and d.get("sliding_window")):
        raise ConfigError("config.json sliding_window attention is not supported; set it to null")

    m.hf_arch = arch.name
    if not given_base:
        m.name = str(d.get("_name_or_path") or model_type).rstrip("/").split("/")[-1] or model_type
    m.vocab_size = int(_get(d, "vocab_size"))
    m.d_model = int(_get(d, "hidden_size"))
    m.n_layers = int(_get(d, "num_hidden_layers"))
    m.n_heads = int(_get(d, "num_attention_heads"))
    m.rms_norm_eps = float(_get(d, "rms_norm_eps"))
    m.max_seq_len = int(_get(d, "max_position_embeddings"))
    m.init_std = float(_get(d, "initializer_range", default=m.init_std))
    m.tie_embeddings = bool(d.get("tie_word_embeddings", False))
    # HF runs every MoE layer dropless
    cfg.moe.capacity_factor = 0.0
    cfg.mesh.a2a_capacity_factor = 0.0
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
        # Absent (or null) mscale / mscale_all_dim are 0 here: HF takes the ratio
        # mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are non-zero, else mscale(f)
        # (so mscale_all_dim alone gives mscale(f), not mscale(f) / mscale(f, all_dim)).
        m.yarn_mscale = float(rope.get("mscale") or 0.0)
        m.yarn_mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0)
        m.yarn_attention_factor = float(rope.get("attention_factor") or 0.0)
    else:
        raise ConfigError(
            f"config.json rope type {rope['rope_type']!r} is not supported (default or yarn)"
        )

    arch.from_hf(d, cfg)
    arch.apply_import(cfg)
    if cfg.train.seq_len > m.max_seq_len:
        cfg.train.seq_len = m.max_seq_len
    return validate(cfg)


__all__ = ["from_hf_config", "to_hf_config"]
