"""HF config.json <-> Config: round trips both ways, transformers accepts what we write, real-world
(DeepSeek-V3 / Kimi-K2 hub style) keys, and clear errors."""

import dataclasses

import pytest

from jaxmoe.config import SECTIONS, Config, ConfigError, list_presets, load_config
from jaxmoe.config.hf import from_hf_config, to_hf_config

# moe fields config.json carries (the rest, e.g. compute_path, come from `base`)
ROUTING = ("n_experts", "top_k", "expert_ffn_dim", "n_shared_experts", "score_func", "norm_topk_prob",
           "route_scale", "n_groups", "topk_groups", "use_expert_bias")


def _model_fields_equal(a: Config, b: Config) -> list:
    diffs = [k for k in dataclasses.asdict(a.model) if k != "name" and getattr(a.model, k) != getattr(b.model, k)]
    diffs += [k for k in ROUTING if getattr(a.moe, k) != getattr(b.moe, k)]
    return diffs


def _as_imported(cfg: Config) -> Config:
    """``cfg`` with what an HF import always sets: the record's fixed / on-import semantics
    (e.g. moe.lb_scope = "pooled" for Qwen3/Mixtral) and dropless routing."""
    from jaxmoe.archs import get_arch

    out = Config(**{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS},
                 description=cfg.description)
    get_arch(cfg.model.hf_arch).apply_import(out)
    out.moe.capacity_factor = out.mesh.a2a_capacity_factor = 0.0
    return out


@pytest.mark.parametrize("preset", list_presets())
def test_round_trip_ours_to_hf_to_ours(preset):
    cfg = load_config(preset)
    d = to_hf_config(cfg)
    assert from_hf_config(d, base=cfg) == _as_imported(cfg)
    assert _model_fields_equal(cfg, from_hf_config(d)) == []


@pytest.mark.parametrize("preset", list_presets())
def test_transformers_accepts_and_round_trips(preset):
    """The arch's own config class reads what we write with the same meaning, and what it writes
    back (to_dict, as save_pretrained does) maps to the same Config."""
    transformers = pytest.importorskip("transformers")
    cfg = load_config(preset)
    hf = transformers.AutoConfig.for_model(**to_hf_config(cfg))
    m, e = cfg.model, cfg.moe
    cls = {"deepseek_v3": "DeepseekV3Config", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}
    assert type(hf).__name__ == cls[m.hf_arch]
    assert hf.hidden_size == m.d_model and hf.num_hidden_layers == m.n_layers
    assert hf.rms_norm_eps == m.rms_norm_eps and hf.tie_word_embeddings == m.tie_embeddings
    assert hf.num_experts_per_tok == e.top_k and hf.num_local_experts == e.n_experts
    rope = hf.rope_parameters
    assert rope["rope_theta"] == m.rope_theta
    assert rope["rope_type"] == ("yarn" if m.rope_scaling == "yarn" else "default")
    if m.rope_scaling == "yarn":
        assert rope["factor"] == m.yarn_factor and rope["original_max_position_embeddings"] == m.yarn_original_max_pos
        assert rope["mscale_all_dim"] == m.yarn_mscale_all_dim and rope["beta_fast"] == m.yarn_beta_fast
    if m.hf_arch == "deepseek_v3":
        assert hf.n_group == e.n_groups and hf.topk_group == e.topk_groups
        assert hf.routed_scaling_factor == e.route_scale and hf.norm_topk_prob == e.norm_topk_prob
        assert hf.first_k_dense_replace == m.first_k_dense and hf.n_shared_experts == e.n_shared_experts
        assert hf.rope_interleave == (m.rope_layout == "interleaved")
        assert hf.q_lora_rank == (m.q_lora_rank or None) and hf.qk_head_dim == m.q_head_dim
    elif m.hf_arch == "qwen3_moe":
        assert hf.norm_topk_prob == e.norm_topk_prob and hf.head_dim == m.head_dim
        assert hf.mlp_only_layers == list(range(m.first_k_dense))
    else:
        assert hf.intermediate_size == e.expert_ffn_dim and hf.head_dim == m.head_dim
    assert from_hf_config(hf.to_dict(), base=cfg) == _as_imported(cfg)


def _kimi_k2_hub_style() -> dict:
    """A config.json in the hub style of moonshotai/Kimi-K2 (transformers-4 rope keys, DeepSeek's
    own routing keys, fp8 quantization block), with the kimi-k2 preset's numbers."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "model_type": "kimi_k2",
        "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }


def test_kimi_k2_hub_keys():
    cfg = from_hf_config(_kimi_k2_hub_style())
    assert _model_fields_equal(load_config("kimi-k2"), cfg) == []
    assert cfg.model.rope_layout == "interleaved" and cfg.moe.seq_aux_coef == 0.001


def test_deepseek_v3_hub_keys_with_groups():
    d = _kimi_k2_hub_style()
    d.update(model_type="deepseek_v3", n_group=8, topk_group=4, n_routed_experts=256, num_attention_heads=128,
             num_key_value_heads=128, first_k_dense_replace=3, vocab_size=129280, max_position_embeddings=163840,
             routed_scaling_factor=2.5, rope_theta=10000.0, num_nextn_predict_layers=1)
    d["rope_scaling"] = dict(d["rope_scaling"], factor=40.0, beta_fast=32)
    assert _model_fields_equal(load_config("deepseek-v3-671b"), from_hf_config(d)) == []


def test_qwen3_hub_keys():
    d = to_hf_config(load_config("qwen3-30b-a3b"))
    d.pop("rope_parameters")  # 4.x style: rope_theta at top level only
    assert _model_fields_equal(load_config("qwen3-30b-a3b"), from_hf_config(d)) == []


def test_unknown_model_type_names_it():
    with pytest.raises(ConfigError, match="model_type='llama'"):
        from_hf_config({"model_type": "llama", "hidden_size": 8})


@pytest.mark.parametrize(
    "preset,override,key",
    [
        ("tiny", "moe.route_scale=2.0", "moe.route_scale"),
        ("tiny", "model.qk_norm=false", "model.qk_norm"),
        ("tiny", "model.rope_layout=interleaved", "model.rope_layout"),
        ("mixtral-tiny", "moe.norm_topk_prob=false", "moe.norm_topk_prob"),
    ],
)
def test_inexpressible_config_raises(preset, override, key):
    with pytest.raises(ConfigError, match=key):
        to_hf_config(load_config(preset, overrides=[override]))


@pytest.mark.parametrize(
    "change,key",
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding_window"),
    ],
)
def test_unsupported_hf_settings_raise(change, key):
    d = to_hf_config(load_config("tiny"))
    d.update(change)
    with pytest.raises(ConfigError, match=key):
        from_hf_config(d)
