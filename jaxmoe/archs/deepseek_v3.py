"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; also Kimi-K2): MLA, sigmoid routing with expert bias,
groups, route scale, shared experts, dense first layers, YaRN, interleaved or half-split RoPE.

Kimi-K2 ships this architecture under its own ``model_type`` (and remote code); its weights use
DeepSeek-V3 names.
"""

from __future__ import annotations

from jaxmoe.archs.base import Arch
from jaxmoe.archs.common import COMMON_DEFAULTS, get
from jaxmoe.errors import ConfigError


def to_hf(cfg) -> dict:
    m, e = cfg.model, cfg.moe
    return dict(
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
        moe_intermediate_size=e.expert_ffn_dim,
        norm_topk_prob=e.norm_topk_prob,
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
        num_nextn_predict_layers=m.mtp_layers,  # multi-token-prediction depths (layers L ..)
        attention_bias=False,
    )


def from_hf(d: dict, cfg) -> None:
    m, e = cfg.model, cfg.moe
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"config.json scoring_func={scoring!r} is not supported (sigmoid)")
    if int(d.get("moe_layer_freq", 1)) != 1:
        raise ConfigError(f"config.json moe_layer_freq={d['moe_layer_freq']} is not supported (1)")
    kv = d.get("num_key_value_heads")
    if kv is not None and int(kv) != m.n_heads:
        raise ConfigError(
            f"config.json num_key_value_heads={kv} must equal num_attention_heads={m.n_heads} for MLA"
        )
    m.attention = "mla"
    m.qk_norm = False
    m.q_lora_rank = int(d.get("q_lora_rank") or 0)
    m.kv_lora_rank = int(get(d, "kv_lora_rank"))
    m.qk_nope_head_dim = int(get(d, "qk_nope_head_dim"))
    m.qk_rope_head_dim = int(get(d, "qk_rope_head_dim"))
    m.v_head_dim = int(get(d, "v_head_dim"))
    qk = d.get("qk_head_dim")
    if qk is not None and int(qk) != m.qk_nope_head_dim + m.qk_rope_head_dim:
        raise ConfigError(
            f"config.json qk_head_dim={qk} contradicts qk_nope_head_dim + qk_rope_head_dim = "
            f"{m.qk_nope_head_dim + m.qk_rope_head_dim}"
        )
    m.rope_layout = "interleaved" if get(d, "rope_interleave") else "half"
    # HF: layer i is MoE iff i >= first_k_dense_replace (so a value past the last layer = all dense)
    m.first_k_dense = min(int(d.get("first_k_dense_replace") or 0), m.n_layers)
    # a missing key reads as transformers' class default (1); the hf: reader drops it to 0 when the
    # checkpoint holds no MTP tensors (port/maps/hf_map.without_absent_mtp)
    m.mtp_layers = int(d.get("num_nextn_predict_layers", 1) or 0)
    m.dense_ffn_dim = int(get(d, "intermediate_size"))
    e.n_experts = int(get(d, "n_routed_experts", "num_local_experts"))
    e.expert_ffn_dim = int(get(d, "moe_intermediate_size"))
    e.n_shared_experts = int(d.get("n_shared_experts") or 0)
    e.score_func = "sigmoid"
    e.norm_topk_prob = bool(get(d, "norm_topk_prob"))
    e.route_scale = float(get(d, "routed_scaling_factor"))
    e.n_groups = int(d.get("n_group") or 1)
    e.topk_groups = int(d.get("topk_group") or 1)
    # HF's DeepseekV3 always selects with e_score_correction_bias; only an explicit
    # non-noaux_tc topk_method (DeepSeek's own config key) turns the bias off.
    e.use_expert_bias = d.get("topk_method", "noaux_tc") == "noaux_tc"
    if d.get("seq_aux", False):
        e.seq_aux_coef = float(d.get("aux_loss_alpha", 0.0))
    elif "seq_aux" in d:
        e.seq_aux_coef = 0.0


# HF's DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default
# eps, whatever rms_norm_eps says (transformers 5.25)
MLA_NORM_EPS = 1e-6

# transformers' DeepseekV3Config defaults (5.25), by config.json key. num_key_value_heads is left
# out: its class default (128) only works when it equals num_attention_heads, which MLA needs.
HF_DEFAULTS = dict(
    COMMON_DEFAULTS,
    attention_bias=False,
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_interleave=True,
)

ARCH = Arch(
    name="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    model_types=("deepseek_v3", "kimi_k2"),
    attention="mla",
    score_func="sigmoid",
    features=frozenset({"mtp", "shared_experts", "expert_bias", "dense_layers", "groups", "route_scale",
                        "unnormalised_topk", "interleaved_rope", "yarn"}),
    required=frozenset(),
    moe_module={"per-expert": "mlp", "fused": "mlp"},
    expert_projections=("gate_proj", "up_proj", "down_proj"),
    bias_tensor=True,
    to_hf=to_hf,
    from_hf=from_hf,
    hf_defaults=HF_DEFAULTS,
    hf_aliases=(("n_routed_experts", "num_local_experts"),),
    fixed={"model.mla_norm_eps": MLA_NORM_EPS},
    doc=__doc__.splitlines()[0],
)
