"""What one HuggingFace architecture record holds (pure Python: torch_ref and config read it).

An :class:`Arch` says everything jaxmoe needs to know about one HF architecture, in one place:

* the HF class and the ``model_type`` values read as this architecture;
* its fixed semantics (attention kind, router score function) and the optional features it can
  express (:data:`FEATURES`: QK-norm, shared experts, expert bias, dense first layers, ...);
* the HF tensor names of every jaxmoe parameter, for both on-disk expert layouts (:data:`LAYOUTS`),
  as templates keyed by the parameter's canonical path (docs/LAYOUT.md);
* the arch-specific part of ``config.json`` in both directions (``to_hf`` / ``from_hf``) and
  transformers' class defaults for that ``model_type`` (``hf_defaults``).

Adding an architecture: one module in this package defining an ``Arch`` and a line in
``jaxmoe/archs/__init__.py`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from jaxmoe.errors import ConfigError

# The two on-disk expert layouts of HF checkpoints (transformers reads both):
#   per-expert: one tensor per expert and projection (what save_pretrained writes by default and
#               what the hub holds), e.g. mlp.experts.{e}.gate_proj.weight [I, D];
#   fused:      the in-memory layout of transformers 5.x (save_original_format=False), all experts
#               in one tensor: mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I].
LAYOUTS = ("per-expert", "fused")

# Optional features a config may use; an architecture lists the ones it can express.
FEATURES = {
    "qk_norm": "per-head RMSNorm on q and k (model.qk_norm)",
    "shared_experts": "shared experts (moe.n_shared_experts > 0)",
    "expert_bias": "the aux-loss-free selection bias (moe.use_expert_bias)",
    "dense_layers": "dense first layers (model.first_k_dense > 0)",
    "groups": "group-limited routing (moe.n_groups > 1)",
    "route_scale": "a routed scaling factor (moe.route_scale != 1)",
    "unnormalised_topk": "un-normalised top-k weights (moe.norm_topk_prob = false)",
    "interleaved_rope": "interleaved RoPE pairs (model.rope_layout = interleaved)",
    "yarn": "YaRN RoPE scaling (model.rope_scaling = yarn)",
    "mtp": "multi-token-prediction layers (model.mtp_layers > 0)",
}


def features_used(cfg) -> set[str]:
    """The optional features ``cfg`` uses (keys of :data:`FEATURES`)."""
    m, e = cfg.model, cfg.moe
    used = {
        "qk_norm": m.attention == "gqa" and m.qk_norm,
        "shared_experts": e.n_shared_experts > 0,
        "expert_bias": e.use_expert_bias,
        "dense_layers": m.first_k_dense > 0,
        "groups": e.n_groups > 1,
        "route_scale": e.route_scale != 1.0,
        "unnormalised_topk": not e.norm_topk_prob,
        "interleaved_rope": m.rope_layout == "interleaved",
        "yarn": m.rope_scaling == "yarn",
        "mtp": m.mtp_layers > 0,
    }
    return {k for k, v in used.items() if v}


# HF tensor names of the parameters of one decoder layer, by canonical path below the layer
# (``dense/<path>`` or ``moe/<path>``), for HF layer ``i`` = ``model.layers.{i}.``. ``{moe}`` is
# the HF module of the MoE FFN, ``{gate}``/``{up}``/``{down}`` the per-expert projection names and
# ``{e}`` the expert index. Expert tensors differ between the layouts (see LAYOUTS).
LAYER_NAMES = {  # in hub order (experts go between the bias and the shared experts)
    "attn_norm": "input_layernorm.weight",
    # GQA
    "attn/q_proj": "self_attn.q_proj.weight",
    "attn/k_proj": "self_attn.k_proj.weight",
    "attn/v_proj": "self_attn.v_proj.weight",
    "attn/o_proj": "self_attn.o_proj.weight",
    "attn/q_norm": "self_attn.q_norm.weight",
    "attn/k_norm": "self_attn.k_norm.weight",
    # MLA (q_proj and o_proj as GQA)
    "attn/q_a_proj": "self_attn.q_a_proj.weight",
    "attn/q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn/q_b_proj": "self_attn.q_b_proj.weight",
    "attn/kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "attn/kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn/kv_b_proj": "self_attn.kv_b_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    # dense FFN
    "mlp/gate_proj": "mlp.gate_proj.weight",
    "mlp/up_proj": "mlp.up_proj.weight",
    "mlp/down_proj": "mlp.down_proj.weight",
    # MoE FFN
    "router": "{moe}.gate.weight",
    "expert_bias": "{moe}.gate.e_score_correction_bias",
    "shared/gate_proj": "{moe}.shared_experts.gate_proj.weight",
    "shared/up_proj": "{moe}.shared_experts.up_proj.weight",
    "shared/down_proj": "{moe}.shared_experts.down_proj.weight",
    # a multi-token-prediction depth (``mtp/<path>``, HF layer L + k - 1; DeepSeek-V3's names)
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "eh_proj": "eh_proj.weight",
    "norm": "shared_head.norm.weight",
}
PER_EXPERT_NAMES = {
    "experts/gate_proj": "{moe}.experts.{e}.{gate}.weight",
    "experts/up_proj": "{moe}.experts.{e}.{up}.weight",
    "experts/down_proj": "{moe}.experts.{e}.{down}.weight",
}
# fused: gate_up_proj[e] = [gate_proj[e]^T ; up_proj[e]^T] (gate rows first), down_proj[e] = down^T
FUSED_NAMES = {
    "experts/gate_proj": "{moe}.experts.gate_up_proj",
    "experts/up_proj": "{moe}.experts.gate_up_proj",
    "experts/down_proj": "{moe}.experts.down_proj",
}
GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
LAYER_PREFIX = "model.layers.{i}."


@dataclass(frozen=True)
class Arch:
    """One HF architecture (see the module doc)."""

    name: str  # model.hf_arch
    hf_class: str  # e.g. "Qwen3MoeForCausalLM"
    model_types: tuple[str, ...]  # config.json model_type values read as this architecture
    attention: str  # "gqa" | "mla": fixed by the architecture
    score_func: str  # "softmax" | "sigmoid": fixed by the architecture
    features: frozenset[str]  # optional features it can express (keys of FEATURES)
    required: frozenset[str]  # features it always has (e.g. Qwen3-MoE's QK-norm)
    moe_module: dict[str, str]  # layout -> HF module name of a MoE layer's FFN
    expert_projections: tuple[str, str, str]  # per-expert names of the gate, up, down projections
    bias_tensor: bool  # HF stores gate.e_score_correction_bias even when unused (then zeros)
    to_hf: Callable[[Any], dict]  # cfg -> the arch-specific config.json keys
    from_hf: Callable[[dict, Any], None]  # (config.json dict, cfg) -> sets the arch-specific fields
    hf_defaults: dict = field(default_factory=dict)  # transformers' defaults for model_type
    # config.json keys that name the same setting (transformers' attribute_map): when one of a
    # group is given, no default fills in the others
    hf_aliases: tuple = ()
    # values HF's code hard-codes ("section.field" -> value): set on import, checked on export
    fixed: dict = field(default_factory=dict)
    # training semantics HF's code has ("section.field" -> value), set on import only (a config
    # with another value still writes the same weights, e.g. moe.lb_scope)
    on_import: dict = field(default_factory=dict)
    doc: str = ""

    # -- what the architecture can express ---------------------------------------------------
    def problems(self, cfg, allow: frozenset = frozenset()) -> list[str]:
        """Why ``cfg`` cannot be written in this architecture (empty when it can); features in
        ``allow`` are not counted."""
        m, e = cfg.model, cfg.moe
        out = []
        if m.attention != self.attention:
            out.append(f"model.attention={m.attention!r} ({self.name} uses {self.attention!r})")
        if e.score_func != self.score_func:
            out.append(f"moe.score_func={e.score_func!r} ({self.name} uses {self.score_func!r})")
        for key, want in self.fixed.items():
            section, name = key.split(".")
            have = getattr(getattr(cfg, section), name)
            if have != want:
                out.append(f"{key}={have!r} ({self.name} fixes it at {want!r})")
        used = features_used(cfg)
        for f in sorted(used - self.features - self.required - allow):
            out.append(f"{FEATURES[f]} ({self.name} has none)")
        for f in sorted(self.required - used):
            out.append(f"a config without {FEATURES[f]} ({self.name} always has it)")
        return out

    def check(self, cfg) -> None:
        """Raise a one-line ConfigError naming the first thing ``cfg`` uses that HF's
        ``hf_class`` cannot express (so nothing is written that HF would load differently)."""
        bad = self.problems(cfg)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ConfigError(f"model.hf_arch={self.name!r} cannot express {bad[0]}{more}")

    def with_defaults(self, d: dict) -> dict:
        """config.json ``d`` with every missing key set to transformers' class default (keys
        present with null stay null; an alias given counts as its whole group given)."""
        given = set(d)
        for group in self.hf_aliases:
            if given & set(group):
                given |= set(group)
        out = {k: v for k, v in self.hf_defaults.items() if k not in given}
        out.update(d)
        return out

    def apply_import(self, cfg) -> None:
        """Set :attr:`fixed` and :attr:`on_import` on ``cfg`` (what an HF import always means)."""
        for key, value in {**self.fixed, **self.on_import}.items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)

    # -- tensor names ------------------------------------------------------------------------
    def names(self, layout: str = "per-expert") -> dict[str, str]:
        """Templates of every HF tensor name, keyed by canonical path below a layer (experts of
        ``layout`` included); global tensors are :data:`GLOBAL_NAMES`."""
        if layout not in LAYOUTS:
            raise ConfigError(f"HF layout {layout!r} is not one of: {', '.join(LAYOUTS)}")
        gate, up, down = self.expert_projections
        moe = self.moe_module[layout]
        experts = PER_EXPERT_NAMES if layout == "per-expert" else FUSED_NAMES
        table = {}
        for k, v in LAYER_NAMES.items():
            if k.startswith("shared/") and "experts/gate_proj" not in table:
                table.update(experts)
            table[k] = v
        return {k: v.replace("{moe}", moe).replace("{gate}", gate).replace("{up}", up)
                .replace("{down}", down) for k, v in table.items()}


__all__ = ["Arch", "FEATURES", "FUSED_NAMES", "GLOBAL_NAMES", "LAYER_NAMES", "LAYER_PREFIX",
           "LAYOUTS", "PER_EXPERT_NAMES", "features_used"]
