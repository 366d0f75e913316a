"""transformers itself as the reference: tiny random HF models (DeepSeek-V3, Qwen3-MoE both ways of
``norm_topk_prob``, Mixtral), built in-process from transformers' own config classes, saved with
``save_pretrained`` in both on-disk expert layouts (per-expert hub names and the fused
``save_original_format=False`` form), read by jaxmoe straight from the directory.

Weights are multiplied by 8 (norms excepted) so that logits and routing are decisive (logit std
~1): a wrong eps, mscale, default or routing rule moves the logits far past the tolerances
(max |dlogit| <= 1e-4, KL <= 1e-6). Each HF-semantics case (MLA norm eps, YaRN with only
``mscale_all_dim``, keys missing from config.json) is also shown to matter: transformers' own
logits move past the tolerance when the case is done the naive way.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxmoe.errors import UserError
from jaxmoe.port.commands.convert import convert, load_numpy_tree
from jaxmoe.port.commands.logits import compare_logits
from jaxmoe.port.formats import open_source, parse_endpoint
from jaxmoe.port.io.safetensors_io import SafetensorsReader
from jaxmoe.port.maps import hf_map
from jaxmoe.train.losses import router_losses

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYOUTS = ("per-expert", "fused")
TOKENS = np.random.default_rng(7).integers(0, 128, (2, 16)).astype(np.int64)
PAD = np.ones((2, 16), np.int64)
PAD[1, 11:] = 0  # right padding on the second row
TOL = {"kl": 1e-6, "max_abs": 1e-4}

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
_DS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
           n_routed_experts=8, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
           v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
           max_position_embeddings=256)
_GQA = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
            max_position_embeddings=256)

# name -> (HF class, config kwargs, config.json keys deleted after saving, extra weight scales)
MODELS = {
    # groups, random expert bias, shared expert, route scale 2.5, YaRN (mscale and all_dim)
    "deepseek": ("DeepseekV3", dict(_DS, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    rms_norm_eps=1e-6,
                                    rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0)),
                 (), {}),
    # rms_norm_eps 1e-5 (HF keeps the MLA norms at 1e-6), YaRN with only mscale_all_dim, and
    # routed_scaling_factor / n_group / topk_group / norm_topk_prob / rope_interleave left to
    # DeepseekV3Config's defaults (2.5 / 8 / 4 / true / true), missing from config.json (16
    # experts: 8 groups of 2)
    "deepseek-edge": ("DeepseekV3", dict(_DS, n_routed_experts=16, rms_norm_eps=1e-5,
                                         rope_parameters=dict(_YARN, mscale_all_dim=0.707)),
                      ("routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                       "rope_interleave"),
                      # small low-rank activations (variance ~4e-4), where the norm eps matters
                      {"q_a_proj": 1 / 64, "kv_a_proj_with_mqa": 1 / 64}),
    "qwen3-norm": ("Qwen3Moe", dict(_GQA, num_experts=8, moe_intermediate_size=32,
                                    intermediate_size=96, norm_topk_prob=True,
                                    router_aux_loss_coef=0.01), (), {}),
    "qwen3-nonorm": ("Qwen3Moe", dict(_GQA, num_experts=8, moe_intermediate_size=32,
                                      intermediate_size=96, norm_topk_prob=False,
                                      mlp_only_layers=[0]), (), {}),
    # rope_theta (MixtralConfig default 1e6) and rms_norm_eps (1e-5) missing from config.json
    "mixtral": ("Mixtral", dict(_GQA, num_local_experts=8, intermediate_size=32,
                                router_aux_loss_coef=0.02),
                ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps"), {}),
}


def _build(kind: str, kwargs: dict, seed: int, scales: dict):
    hcfg = getattr(transformers, kind + "Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForCausalLM")(hcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.mul_(8.0 * next((f for k, f in scales.items() if k in name), 1.0))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _hf_run(model, mask=None, router=False):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(TOKENS),
                    attention_mask=None if mask is None else torch.from_numpy(mask),
                    output_router_logits=router)
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> {"model": the transformers model (reloaded from disk), "dirs": {layout: dir},
    "logits": its fp32 logits on TOKENS}."""
    root = tmp_path_factory.mktemp("hfref")
    out = {}
    for i, (name, (kind, kwargs, drop, scales)) in enumerate(MODELS.items()):
        model = _build(kind, kwargs, seed=i, scales=scales)
        dirs = {}
        for layout in LAYOUTS if name != "deepseek-edge" else LAYOUTS[:1]:
            d = root / f"{name}-{layout}"
            model.save_pretrained(d, save_original_format=(layout == "per-expert"))
            if drop:
                cj = json.loads((d / "config.json").read_text())
                for k in drop:
                    cj.pop(k, None)
                (d / "config.json").write_text(json.dumps(cj))
            dirs[layout] = d
        # the reference is what transformers loads from the directory jaxmoe reads
        ref = getattr(transformers, kind + "ForCausalLM").from_pretrained(
            dirs["per-expert"], dtype=torch.float32).eval()
        out[name] = {"model": ref, "dirs": dirs, "logits": _hf_run(ref).logits.numpy()}
    return out


_JAX_RUNS: dict = {}
_JAX_FNS: dict = {}


def _jax(d):
    """(cfg, logits, routing record, [LB loss without mask, with PAD]) of jaxmoe on TOKENS, for
    HF directory ``d`` (cached; one compiled forward + loss per config, shared by both layouts).
    The dense expert path (dropless at capacity 0) compiles fastest; tests/test_experts.py holds the paths equal."""
    if str(d) not in _JAX_RUNS:
        import jax
        import jax.numpy as jnp

        from jaxmoe.model.transformer import apply_model

        cfg, params, buffers = load_numpy_tree(parse_endpoint(f"hf:{d}"))
        cfg.moe.compute_path = "dense"
        key = cfg.to_json()
        if key not in _JAX_FNS:
            def run(p, b, t, pad, cfg=cfg):
                logits, aux = apply_model(cfg, p, b, t)
                lb = [router_losses(cfg, aux["router"], *t.shape, m)["lb"] for m in (None, pad)]
                return logits, aux, lb

            _JAX_FNS[key] = jax.jit(run)
        params, buffers = jax.tree.map(jnp.asarray, (params, buffers))
        logits, aux, lb = _JAX_FNS[key](params, buffers, jnp.asarray(TOKENS, jnp.int32),
                                        jnp.asarray(PAD))
        aux = jax.tree.map(np.array, aux)
        _JAX_RUNS[str(d)] = (cfg, np.asarray(logits, np.float32), aux, [float(x) for x in lb])
    return _JAX_RUNS[str(d)]


CASES = [(n, lay) for n in MODELS for lay in (LAYOUTS if n != "deepseek-edge" else LAYOUTS[:1])]


@pytest.mark.parametrize("name,layout", CASES)
def test_logits_match_transformers(hf, name, layout):
    d = hf[name]["dirs"][layout]
    if layout == "fused":  # really the fused form on disk (Mixtral's block under mlp.)
        names = SafetensorsReader(d).names()
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        assert not any(".experts.0." in n or "block_sparse_moe" in n for n in names)
    cfg, logits, _, _ = _jax(d)
    ref = hf[name]["logits"]
    assert ref.std() > 0.5  # decisive weights
    f = compare_logits(ref, logits)
    assert f["max_abs"] <= TOL["max_abs"] and f["kl"] <= TOL["kl"], f
    assert cfg.moe.capacity_factor == 0.0  # an HF import is dropless


def test_both_layouts_read_the_same_leaves(hf):
    for name in ("deepseek", "mixtral"):
        a = open_source(parse_endpoint(f"hf:{hf[name]['dirs']['per-expert']}"))
        b = open_source(parse_endpoint(f"hf:{hf[name]['dirs']['fused']}"))
        assert set(b.layouts.values()) >= {"fused"}
        for key in a.keys():
            assert np.array_equal(a.read_leaf(key), b.read_leaf(key)), key


@pytest.mark.parametrize("name", ["deepseek", "qwen3-norm", "mixtral"])
def test_fused_table_matches_save_pretrained(hf, name):
    """hf_map.entries(cfg, "fused") -- what a fused writer uses -- names every tensor of
    transformers' fused save with its shape."""
    d = hf[name]["dirs"]["fused"]
    r = SafetensorsReader(d)
    cfg = open_source(parse_endpoint(f"hf:{d}")).cfg
    table = hf_map.tensors(hf_map.entries(cfg, "fused"))
    assert sorted(table) == sorted(r.names())
    for n, rows in table.items():
        assert rows[0].hf_shape == tuple(r.shape(n)), n
        assert len(rows) == (2 if n.endswith("gate_up_proj") else 1)


def test_edge_config_was_read_as_transformers_reads_it(hf):
    cfg = _jax(hf["deepseek-edge"]["dirs"]["per-expert"])[0]
    m, e = cfg.model, cfg.moe
    assert (e.route_scale, e.n_groups, e.topk_groups, e.norm_topk_prob) == (2.5, 8, 4, True)
    assert m.rope_layout == "interleaved" and m.rms_norm_eps == 1e-5 and m.mla_norm_eps == 1e-6
    assert m.yarn_mscale == 0.0 and m.yarn_mscale_all_dim == 0.707
    mx = _jax(hf["mixtral"]["dirs"]["per-expert"])[0].model
    assert mx.rope_theta == 1e6 and mx.rms_norm_eps == 1e-5


def test_each_edge_case_matters(hf):
    """Done the naive way, each case moves transformers' own logits past the tolerance, so the
    logits tests above would catch a reader that got it wrong."""
    from transformers.modeling_rope_utils import yarn_get_mscale

    ds = hf["deepseek-edge"]["model"]
    ref = hf["deepseek-edge"]["logits"]

    def moved(model):
        return compare_logits(ref, _hf_run(model).logits.numpy())["max_abs"]

    attn = [layer.self_attn for layer in ds.model.layers]
    for a in attn:  # MLA norms at rms_norm_eps (1e-5) instead of HF's fixed 1e-6
        a.q_a_layernorm.variance_epsilon = a.kv_a_layernorm.variance_epsilon = 1e-5
    try:
        assert moved(ds) > 10 * TOL["max_abs"]
    finally:
        for a in attn:
            a.q_a_layernorm.variance_epsilon = a.kv_a_layernorm.variance_epsilon = 1e-6
    rot = ds.model.rotary_emb
    keep = rot.attention_scaling
    rot.attention_scaling = 1.0 / yarn_get_mscale(4.0, 0.707) * yarn_get_mscale(4.0, 1.0)  # mscale=1 read
    try:
        assert moved(ds) > 10 * TOL["max_abs"]
    finally:
        rot.attention_scaling = keep
    for a in ds.model.layers[1:]:  # routed_scaling_factor at jaxmoe's old default 1.0
        a.mlp.gate.routed_scaling_factor = 1.0
    try:
        assert moved(ds) > 10 * TOL["max_abs"]
    finally:
        for a in ds.model.layers[1:]:
            a.mlp.gate.routed_scaling_factor = 2.5


def test_torch_ref_matches_transformers_on_edge_cases(hf):
    """torch_ref reads the same fields (MLA norm eps, mscale, defaults) and gives HF's logits."""
    from torch_ref import hf_io

    for name in ("deepseek-edge", "mixtral"):
        _cfg, model = hf_io.load_hf(str(hf[name]["dirs"]["per-expert"]))
        with torch.no_grad():
            logits = model.float().eval()(torch.from_numpy(TOKENS))[0].numpy()
        f = compare_logits(hf[name]["logits"], logits)
        assert f["max_abs"] <= TOL["max_abs"] and f["kl"] <= TOL["kl"], (name, f)


@pytest.mark.parametrize("name", ["qwen3-norm", "qwen3-nonorm", "mixtral"])
@pytest.mark.parametrize("padded", [False, True], ids=["nomask", "padmask"])
def test_load_balance_loss_equals_hf_aux_loss(hf, name, padded):
    """jaxmoe's moe.lb_scope="pooled" loss (set by the HF import) == HF's aux_loss, with and
    without an attention mask with padding (right padding: the real tokens' routing is the
    same with or without the mask, causal attention). torch_ref's too."""
    from torch_ref.losses import pooled_load_balance_loss

    d = hf[name]["dirs"]["per-expert"]
    cfg, _logits, aux, lbs = _jax(d)
    assert cfg.moe.lb_scope == "pooled"
    assert cfg.moe.lb_coef == hf[name]["model"].config.router_aux_loss_coef
    mask = PAD if padded else None
    want = float(_hf_run(hf[name]["model"], mask, router=True).aux_loss)
    got = lbs[padded]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    r = aux["router"]
    tr = float(pooled_load_balance_loss(torch.from_numpy(np.asarray(r["scores"])),
                                        torch.from_numpy(np.asarray(r["topk_idx"])), cfg.moe,
                                        None if mask is None else torch.from_numpy(mask)))
    assert abs(tr - want) <= 1e-5 * abs(want), (tr, want)
    if padded:  # the mask matters
        unmasked = float(_hf_run(hf[name]["model"], None, router=True).aux_loss)
        assert abs(unmasked - want) > 1e-3 * abs(want)


def test_bf16_conversion_keeps_router_and_bias_fp32(hf, tmp_path):
    src = hf["deepseek"]["dirs"]["fused"]
    convert(parse_endpoint(f"hf:{src}"), parse_endpoint(f"hf:{tmp_path}/bf16"), dtype="bfloat16")
    r = SafetensorsReader(tmp_path / "bf16")
    kept = [n for n in r.names() if n.endswith((".gate.weight", "e_score_correction_bias"))]
    assert len(kept) == 4  # two MoE layers
    for n in r.names():
        want = np.float32 if n in kept else np.dtype("bfloat16")
        assert r.dtype(n) == want, n
    a = open_source(parse_endpoint(f"hf:{src}"))
    b = open_source(parse_endpoint(f"hf:{tmp_path}/bf16"))
    for key in ("params/moe/router", "buffers/moe/expert_bias"):
        assert np.array_equal(a.read_leaf(key), b.read_leaf(key)), key


def test_cli_logits_framework_hf(hf, tmp_path, monkeypatch, capsys):
    from jaxmoe.cli import main
    from jaxmoe.port.commands import logits as port_logits

    d = hf["mixtral"]["dirs"]["fused"]
    np.save(tmp_path / "tok.npy", TOKENS.astype(np.int32))
    args = ["logits", "--ckpt", f"hf:{d}", "--tokens", str(tmp_path / "tok.npy"), "--out",
            str(tmp_path / "lg.npy"), "--framework", "hf"]
    assert main(args) == 0
    np.testing.assert_allclose(np.load(tmp_path / "lg.npy"), hf["mixtral"]["logits"], atol=1e-6)
    args_torch = args[:-1] + ["torch"]  # torch_ref on a fused dir (read through a torch: file)
    assert main(args_torch) == 0
    f = compare_logits(hf["mixtral"]["logits"], np.load(tmp_path / "lg.npy"))
    assert f["max_abs"] <= TOL["max_abs"] and f["kl"] <= TOL["kl"], f
    capsys.readouterr()
    monkeypatch.setattr(port_logits, "installed", lambda module: module != "transformers")
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[ref]" in err[0] and "transformers" in err[0], err


def test_unknown_expert_layout_names_the_supported_ones(hf, tmp_path):
    from jaxmoe.port.io.safetensors_io import write_tensors

    src = hf["qwen3-norm"]["dirs"]["fused"]
    r = SafetensorsReader(src)
    renamed = {n.replace("experts.gate_up_proj", "experts.w13"): r.get(n) for n in r.names()}
    (tmp_path / "bad").mkdir()
    shutil.copy(src / "config.json", tmp_path / "bad" / "config.json")
    write_tensors(tmp_path / "bad", renamed)
    with pytest.raises(UserError, match="per-expert .* or fused") as e:
        open_source(parse_endpoint(f"hf:{tmp_path / 'bad'}"))
    assert "\n" not in str(e.value)
