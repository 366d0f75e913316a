"""HF-exact semantics as config fields, checked piece by piece (fast: no model is run).

* the pooled load-balance loss (``moe.lb_scope = "pooled"``): hand-computed values, balanced value
  = k (the per-layer form: number of layers), padding exclusion, jaxmoe == torch_ref;
* missing config.json keys = transformers' class defaults (the records' ``hf_defaults`` against
  the installed config classes, and an empty config.json against the class's full one);
* YaRN attention factor and MLA softmax mscale against transformers' own functions, for every
  combination of ``mscale`` / ``mscale_all_dim`` given or absent;
* both config styles (``rope_parameters``, ``rope_theta`` + ``rope_scaling``);
* the MLA norm eps HF fixes: set on import, an export with another value refused.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.archs import ARCHS
from jaxmoe.config import ConfigError, load_config
from jaxmoe.config.hf import from_hf_config, to_hf_config
from jaxmoe.model.layers import rope_frequencies, yarn_softmax_mscale
from jaxmoe.train.losses import pooled_load_balance_loss, router_losses

# two MoE layers, two tokens, two experts, top-1
PROBS = np.array([[[0.7, 0.3], [0.4, 0.6]], [[0.9, 0.1], [0.2, 0.8]]], np.float32)
IDX = np.array([[[0], [1]], [[0], [0]]], np.int32)


def test_pooled_load_balance_hand_computed():
    # no mask: f = [3, 1] / 4 rows, P = [2.2, 1.8] / 4 -> 2 * (0.75 * 0.55 + 0.25 * 0.45)
    got = pooled_load_balance_loss(jnp.asarray(PROBS), jnp.asarray(IDX), 2)
    assert float(got) == pytest.approx(1.05, rel=1e-6)
    # token 1 is padding: f = [2, 0] / 2 rows, P = [1.6, 0.4] / 2 -> 2 * (1 * 0.8)
    got = pooled_load_balance_loss(jnp.asarray(PROBS), jnp.asarray(IDX), 2, jnp.asarray([1.0, 0.0]))
    assert float(got) == pytest.approx(1.6, rel=1e-6)


def _record(lm, t, e, k, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(lm, t, e)).astype(np.float32) * 2
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    idx = np.argsort(-probs, -1)[..., :k].astype(np.int32)
    return {"logits": logits, "scores": probs, "topk_idx": idx}


def test_balanced_values_pooled_k_layer_sum_of_layers():
    """Uniform probabilities and balanced counts: pooled = k, per-layer form = number of layers."""
    lm, t, e, k = 3, 8, 4, 2
    probs = np.full((lm, t, e), 1 / e, np.float32)
    idx = np.stack([np.stack([(np.arange(k) + 2 * i) % e for i in range(t)])] * lm).astype(np.int32)
    rec = {"logits": np.zeros((lm, t, e), np.float32), "scores": probs, "topk_idx": idx}
    cfg = load_config("tiny", overrides=[f"moe.n_experts={e}", f"moe.top_k={k}"])
    assert float(router_losses(cfg, rec, 1, t)["lb"]) == pytest.approx(lm, rel=1e-6)
    cfg.moe.lb_scope = "pooled"
    assert float(router_losses(cfg, rec, 1, t)["lb"]) == pytest.approx(k, rel=1e-6)


def test_pooled_jaxmoe_equals_torch_ref_with_padding():
    torch = pytest.importorskip("torch")
    from torch_ref.losses import loss_terms

    cfg = load_config("tiny", overrides=["moe.lb_scope=pooled"])
    b, s, e, k = 2, 6, cfg.moe.n_experts, cfg.moe.top_k
    rec = _record(cfg.model.n_moe_layers, b * s, e, k, seed=1)
    attn = np.ones((b, s), np.int64)
    attn[0, 4:] = 0
    for batch_extra, pad in (({}, None), ({"attention_mask": attn}, attn),
                             ({"segment_ids": attn * 3}, attn)):
        want = float(router_losses(cfg, rec, b, s, None if pad is None else jnp.asarray(pad))["lb"])
        tbatch = {"targets": torch.zeros(b, s, dtype=torch.long),
                  **{kk: torch.from_numpy(v) for kk, v in batch_extra.items()}}
        aux = {"router": {kk: torch.from_numpy(v) for kk, v in rec.items()},
               "losses": {n: torch.zeros(()) for n in ("lb", "seq_aux", "router_z")}}
        got = float(loss_terms(cfg, torch.zeros(b, s, 4), aux, tbatch)["lb"])
        assert got == pytest.approx(want, rel=1e-6), batch_extra.keys()
    # the padding changes the value (so it is really excluded)
    assert float(router_losses(cfg, rec, b, s, jnp.asarray(attn))["lb"]) != pytest.approx(
        float(router_losses(cfg, rec, b, s)["lb"]), rel=1e-3)


def test_compute_loss_takes_the_attention_mask_not_the_target_mask():
    from jaxmoe.train.losses import compute_loss

    cfg = load_config("tiny", overrides=["moe.lb_scope=pooled", "moe.lb_coef=1.0"])
    b, s = 2, 6
    rec = _record(cfg.model.n_moe_layers, b * s, cfg.moe.n_experts, cfg.moe.top_k, seed=2)
    logits = jnp.zeros((b, s, cfg.model.vocab_size))
    batch = {"targets": jnp.zeros((b, s), jnp.int32), "mask": jnp.ones((b, s)).at[0, 3:].set(0)}
    _, m_nomask = compute_loss(cfg, logits, {"router": rec}, batch)
    want = router_losses(cfg, rec, b, s)["lb"]  # the targets mask is not attention padding
    assert float(m_nomask["lb"]) == pytest.approx(float(want), rel=1e-6)
    batch["attention_mask"] = batch["mask"]
    _, m_mask = compute_loss(cfg, logits, {"router": rec}, batch)
    want = router_losses(cfg, rec, b, s, batch["mask"])["lb"]
    assert float(m_mask["lb"]) == pytest.approx(float(want), rel=1e-6)


# --------------------------------------------------------------------------------------------
# transformers' class defaults
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_defaults_are_the_installed_transformers_defaults(arch):
    transformers = pytest.importorskip("transformers")
    a = ARCHS[arch]
    hf = getattr(transformers, a.hf_class.replace("ForCausalLM", "Config"))()
    for key, value in a.hf_defaults.items():
        have = hf.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(hf, key)
        assert have == value, (arch, key, have, value)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_missing_keys_read_as_the_class_defaults(arch):
    """An (almost) empty config.json means exactly what transformers' full default config means."""
    transformers = pytest.importorskip("transformers")
    a = ARCHS[arch]
    full = getattr(transformers, a.hf_class.replace("ForCausalLM", "Config"))().to_dict()
    assert from_hf_config({"model_type": a.name}).model == dataclasses.replace(
        from_hf_config(full).model, name=a.name)
    assert from_hf_config({"model_type": a.name}).moe == from_hf_config(full).moe


def test_gqa_import_sets_pooled_scope_dropless_and_coef():
    d = to_hf_config(load_config("mixtral-tiny"))
    d.pop("router_aux_loss_coef")
    base = load_config("mixtral-tiny", overrides=["moe.capacity_factor=1.5", "moe.lb_scope=layer"])
    cfg = from_hf_config(d, base=base)
    assert cfg.moe.lb_scope == "pooled" and cfg.moe.lb_coef == 0.001  # MixtralConfig default
    assert cfg.moe.capacity_factor == 0.0 and cfg.mesh.a2a_capacity_factor == 0.0
    assert from_hf_config(to_hf_config(load_config("tiny-mla"))).moe.lb_scope == "layer"


# --------------------------------------------------------------------------------------------
# YaRN and the MLA norm eps
# --------------------------------------------------------------------------------------------

MSCALES = [dict(mscale=1.0, mscale_all_dim=1.0), dict(mscale_all_dim=0.707), dict(mscale=0.8),
           {}, dict(mscale=1.2, mscale_all_dim=0.5), dict(attention_factor=1.3, mscale_all_dim=1.0)]


@pytest.mark.parametrize("ms", MSCALES, ids=lambda m: ",".join(m) or "none")
def test_yarn_factors_equal_transformers(ms):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from torch_ref.layers import rope_frequencies as torch_rope_frequencies

    d = to_hf_config(load_config("tiny-mla"))
    d["max_position_embeddings"] = 512
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, **ms}
    d["rope_parameters"] = dict(rope)
    d.pop("rope_theta")
    hf = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "model_type"})
    inv_hf, att_hf = ROPE_INIT_FUNCTIONS["yarn"](hf)
    scale_hf = yarn_apply_mscale(hf.rope_parameters, 1.0)
    m = from_hf_config(d).model
    inv, att = rope_frequencies(m)
    assert att == pytest.approx(att_hf, rel=1e-12)
    np.testing.assert_allclose(inv, inv_hf.numpy(), rtol=1e-6)
    assert yarn_softmax_mscale(m) == pytest.approx(scale_hf, rel=1e-12)
    inv_t, att_t = torch_rope_frequencies(m)
    assert att_t == pytest.approx(att_hf, rel=1e-12)
    assert torch.allclose(inv_t, inv_hf.float(), rtol=1e-6)


def test_both_config_styles_read_alike():
    d5 = to_hf_config(load_config("tiny-mla"))
    rope = dict(d5.pop("rope_parameters"))
    d4 = dict(d5, rope_theta=rope.pop("rope_theta"))
    rope["type"] = rope.pop("rope_type")
    d4["rope_scaling"] = rope
    assert from_hf_config(d4) == from_hf_config(to_hf_config(load_config("tiny-mla")))


def test_mla_norm_eps_fixed_by_deepseek():
    d = to_hf_config(load_config("tiny-mla"))
    d["rms_norm_eps"] = 1e-5
    cfg = from_hf_config(d, base=load_config("tiny-mla", overrides=["model.mla_norm_eps=1e-3"]))
    assert cfg.model.rms_norm_eps == 1e-5 and cfg.model.mla_norm_eps == 1e-6
    with pytest.raises(ConfigError, match="model.mla_norm_eps"):
        to_hf_config(load_config("tiny-mla", overrides=["model.mla_norm_eps=1e-5"]))


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ConfigError, match="supported: qwen3_moe, mixtral, deepseek_v3, kimi_k2"):
        from_hf_config({"model_type": "llama"})


def test_router_computes_in_fp32_from_bf16_activations():
    """In a bf16 model the router weight is used unrounded: logits = fp32(x) @ w (fp32)."""
    from jaxmoe.model.router import route

    cfg = load_config("tiny-mla")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, cfg.moe.n_experts)) * 1.001, jnp.float32)
    out = route(x, w, jnp.zeros(cfg.moe.n_experts), cfg.moe)
    want = np.asarray(x, np.float32).astype(np.float64) @ np.asarray(w, np.float64)
    assert out.logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out.logits), want, rtol=1e-5, atol=1e-5)
    rounded = np.asarray(x, np.float32) @ np.asarray(w.astype(jnp.bfloat16), np.float32)
    assert np.abs(rounded - want).max() > 1e-3  # a bf16 router weight would show
