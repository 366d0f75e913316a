"""torchtitan (the seed's framework) as a reference: the flavor -> config mapping, the one
torchtitan name map, and an fp32 parity run against torchtitan's own model (issue 26).

Everything that needs torchtitan is skipped, with the reason, when it is not importable; CI
installs it (``pip install -e '.[titan]'`` in .ci/run), so they run there. The name-map round
trip needs no torchtitan.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.counting import count_params
from jaxmoe.errors import UserError
from jaxmoe.port.titan_map import from_titan, leaf_shapes, titan_entries, to_titan
from jaxmoe.trees import unflatten


def _titan_ok() -> bool:
    try:
        return importlib.util.find_spec("torchtitan") is not None and bool(
            __import__("torchtitan.models.deepseek_v3"))
    except Exception:  # noqa: BLE001 (a missing dependency of torchtitan: triton, tyro, spmd_types, torch)
        return False


needs_titan = pytest.mark.skipif(not _titan_ok(), reason="torchtitan is not importable: pip install -e '.[titan]'")


def _all_flavors():
    if not _titan_ok():
        return []
    from parity.titan_flavors import FAMILIES, flavors

    return [f"{fam}/{fl}" for fam in FAMILIES for fl in flavors(fam)]


# --------------------------------------------------------------------------------------------
# The name map (no torchtitan needed)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,overrides", [("tiny", ["model.qk_norm=true"]), ("tiny-mla", []),
                                              ("tiny-mla", ["model.q_lora_rank=0", "model.first_k_dense=0"])])
def test_titan_map_round_trip_and_declarations(preset, overrides):
    """to_titan -> from_titan is bit-exact (the fused GQA wqkv included), and the table covers
    exactly the model's declared leaves with their shapes."""
    from jaxmoe.model.transformer import model_declarations

    cfg = load_config(preset, overrides=overrides)
    declared = {("params/" if d.trained else "buffers/") + p: tuple(d.shape)
                for p, d in model_declarations(cfg).items()}
    assert leaf_shapes(cfg) == declared
    rng = np.random.default_rng(0)
    flat = {k: rng.standard_normal(s).astype(np.float32) for k, s in declared.items()}
    params = unflatten({k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")})
    buffers = unflatten({k[len("buffers/"):]: v for k, v in flat.items() if k.startswith("buffers/")})
    tensors = to_titan(cfg, params, buffers)
    assert {e.name for e in titan_entries(cfg)} == set(tensors)
    back = from_titan(cfg, tensors)
    assert set(back) == set(flat)
    for k in flat:
        np.testing.assert_array_equal(back[k], flat[k], err_msg=k)
    if cfg.model.attention == "gqa":  # wqkv: per KV group its q heads, then k, then v
        m = cfg.model
        w = tensors["layers.0.attention.qkv_linear.wqkv.weight"].reshape(
            m.n_kv_heads, m.n_heads // m.n_kv_heads + 2, m.head_dim, m.d_model)
        k0 = flat["params/moe/attn/k_proj"][0].T.reshape(m.n_kv_heads, m.head_dim, m.d_model)
        np.testing.assert_array_equal(w[:, -2], k0)


def test_from_titan_names_a_missing_tensor():
    cfg = load_config("tiny-mla")
    shapes = leaf_shapes(cfg)
    params = unflatten({k[7:]: np.zeros(s, np.float32) for k, s in shapes.items() if k.startswith("params/")})
    tensors = to_titan(cfg, params, with_buffers=False)
    with pytest.raises(UserError, match=r"moe\.expert_bias_E is missing"):
        from_titan(cfg, tensors)


# --------------------------------------------------------------------------------------------
# Flavor -> config (torchtitan's config objects; models on the meta device)
# --------------------------------------------------------------------------------------------


@needs_titan
def test_every_moe_flavor_is_mapped():
    got = set(_all_flavors())
    # deepseek_v3 (all), kimi_k2_7 text towers, qwen3 MoE flavors
    assert {"deepseek_v3/671B", "deepseek_v3/debugmodel", "kimi_k2_7/Kimi-K2.5", "kimi_k2_7/debugmodel",
            "qwen3/debugmodel_moe", "qwen3/30B-A3B", "qwen3/235B-A22B"} <= got
    assert "qwen3/8B" not in got  # dense flavors are not MoE flavors


@needs_titan
@pytest.mark.parametrize("spec", _all_flavors() or ["(torchtitan missing)"])
def test_count_equals_torchtitan_count(spec):
    """`jaxmoe count` of the mapped config == torchtitan's own parameter count (meta device)."""
    from parity.titan_flavors import config_from_titan, titan_param_count

    cfg = config_from_titan(spec).config
    assert count_params(cfg)["total_params"] == titan_param_count(spec)


@needs_titan
def test_mapping_reads_the_flavor():
    """The fields that differ between flavors (and from jaxmoe's defaults) come from torchtitan."""
    from parity.titan_flavors import config_from_titan

    c = config_from_titan("deepseek_v3/671B").config
    m, e = c.model, c.moe
    assert (m.first_k_dense, m.q_lora_rank, m.rope_layout, m.rope_scaling, m.yarn_factor) == (
        3, 1536, "interleaved", "yarn", 40.0)
    assert m.rms_norm_eps == m.mla_norm_eps == 1e-5  # torchtitan: 1e-5 everywhere (HF: 1e-6 on q/kv norms)
    assert (e.score_func, e.n_groups, e.topk_groups, e.norm_topk_prob, e.route_scale) == ("sigmoid", 8, 4, True, 2.5)
    assert (e.use_expert_bias, e.bias_update_rate, e.n_shared_experts) == (True, 1e-3, 1)
    d = config_from_titan("deepseek_v3/debugmodel").config
    assert (d.model.yarn_mscale, d.model.yarn_mscale_all_dim, d.moe.score_func, d.moe.use_expert_bias) == (
        0.7, 0.7, "softmax", False)
    q = config_from_titan("qwen3/30B-A3B").config
    assert (q.model.attention, q.model.qk_norm, q.model.rope_layout, q.model.rms_norm_eps, q.model.n_kv_heads) == (
        "gqa", True, "half", 1e-6, 4)
    assert (q.moe.n_experts, q.moe.top_k, q.moe.norm_topk_prob, q.moe.n_shared_experts) == (128, 8, True, 0)


@needs_titan
@pytest.mark.parametrize("edit,field", [("moe.router._debug_force_load_balance=true", "_debug_force_load_balance"),
                                        ("attention.rope.truncate=false", "truncate"),
                                        ("moe.router.gate.bias=true", "moe.router.gate.bias")])
def test_unrepresentable_field_fails_with_one_line(edit, field):
    from parity.titan_flavors import config_from_titan

    with pytest.raises(UserError) as ei:
        config_from_titan("deepseek_v3/debugmodel", [edit])
    assert field in str(ei.value) and "\n" not in str(ei.value)


@needs_titan
def test_config_command_from_titan(capsys, tmp_path):
    from jaxmoe.cli import main

    assert main(["config", "--from-titan", "kimi_k2_7/Kimi-K2.5", "--out", str(tmp_path / "k.toml")]) == 0
    assert "vision_encoder not mapped" in capsys.readouterr().err
    assert load_config(path=tmp_path / "k.toml").moe.n_experts == 384
    assert main(["count", "--from-titan", "deepseek_v3/671B"]) == 0
    assert "671,026,404,352" in capsys.readouterr().out


def test_config_command_names_the_titan_extra(monkeypatch, capsys):
    """Without torchtitan: one line naming the [titan] extra."""
    import sys

    from jaxmoe.cli import main

    for mod in ("torchtitan", "torchtitan.models", "torchtitan.models.deepseek_v3"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert main(["config", "--from-titan", "deepseek_v3/671B"]) == 2
    err = capsys.readouterr().err.strip()
    assert "jaxmoe[titan]" in err and "\n" not in err


# --------------------------------------------------------------------------------------------
# fp32 parity against torchtitan's own model
# --------------------------------------------------------------------------------------------

# deepseek_v3/debugmodel with torchtitan's router in DeepSeek-V3 mode (the flavor itself routes
# softmax, no groups): sigmoid scores + a random expert bias for selection, 4 groups of 2 with 2
# kept, route_norm, route_scale 2.5
SIGMOID = ["moe.router.score_func=sigmoid", "moe.router.num_expert_groups=4", "moe.router.num_limited_groups=2",
           "moe.router.route_norm=true", "moe.router.route_scale=2.5"]


def _run(overrides=(), jax_overrides=()):
    from parity.runner import RunOptions, run_suite
    from parity.titan_runner import TITAN_INIT_SCALE

    opts = RunOptions(reference="torchtitan", titan="deepseek_v3/debugmodel", titan_overrides=list(overrides),
                      overrides=list(jax_overrides), steps=0, profile="fast", init_scale=TITAN_INIT_SCALE)
    return run_suite(opts)


@needs_titan
def test_parity_deepseek_v3_debugmodel_sigmoid_groups_bias():
    rep = _run(SIGMOID)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["passed"], rep["first_divergence"]
    assert rep["config"]["moe"]["use_expert_bias"] and rep["config"]["moe"]["n_groups"] == 4
    assert sum(k.startswith("routing[") for k in checks) == 5
    for k in ("logits", "logits_kl", "loss:ce", "loss:loss"):
        assert checks[k]["passed"]
    grads = [c for c in rep["checks"] if c["name"].startswith("grad:")]
    assert len(grads) == 83 and all(c["passed"] for c in grads)  # every torchtitan parameter
    assert "grad:layers.1.moe.routed_experts.inner_experts.w2_EDF" in checks


@needs_titan
@pytest.mark.slow
def test_parity_deepseek_v3_debugmodel_flavor_as_is():
    rep = _run()
    assert rep["passed"], rep["first_divergence"]


@needs_titan
@pytest.mark.parametrize("jax_overrides,first", [
    (["model.mla_norm_eps=1e-6"], "logits"),  # HF's MLA-norm eps instead of torchtitan's
    (["moe.topk_groups=3"], "routing["),  # a group limit other than torchtitan's
])
def test_parity_catches_a_wrong_mapping(jax_overrides, first):
    rep = _run(SIGMOID, jax_overrides)
    assert not rep["passed"]
    assert rep["first_divergence"]["name"].startswith(first), rep["first_divergence"]
