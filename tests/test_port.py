"""Checkpoint porting: HF hub layout <-> torch_ref file <-> jaxmoe Orbax run dir.

The external reference for names, shapes and logits is HF transformers itself: tiny random-init
``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` / ``MixtralForCausalLM`` built from our presets'
``to_hf_config`` and written with ``save_pretrained`` (which writes the per-expert hub names).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hf_models import random_hf_model, same_tensors

from jaxmoe.config import load_config
from jaxmoe.errors import UserError
from jaxmoe.port.commands.convert import convert
from jaxmoe.port.commands.logits import compare_logits, compute_logits
from jaxmoe.port.formats import parse_endpoint
from jaxmoe.port.io.safetensors_io import SafetensorsReader, write_tensors
from jaxmoe.port.maps import hf_map

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PRESETS = ["tiny", "tiny-mla", "mixtral-tiny"]


def ep(text: str):
    return parse_endpoint(text)


def _hf_model(cfg, seed=0):
    return random_hf_model(cfg, seed)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """preset -> (cfg, dir of a save_pretrained HF checkpoint)."""
    out = {}
    root = tmp_path_factory.mktemp("hf")
    for preset in PRESETS:
        cfg = load_config(preset)
        model = _hf_model(cfg)
        model.save_pretrained(root / preset)
        out[preset] = (cfg, root / preset)
    return out


_same_tensors = same_tensors


# --------------------------------------------------------------------------------------------
# mapping table vs transformers' own save_pretrained
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_table_matches_save_pretrained(hf_dirs, preset):
    cfg, d = hf_dirs[preset]
    reader = SafetensorsReader(d)
    have = {n: reader.shape(n) for n in reader.names()}
    want = {e.hf_name: e.hf_shape for e in hf_map.entries(cfg)}
    assert want == have


def test_table_tied_embeddings_and_no_q_lora():
    cfg = load_config("tiny-mla", overrides=["model.tie_embeddings=true", "model.q_lora_rank=0"])
    names = {e.hf_name: e for e in hf_map.entries(cfg)}
    assert "lm_head.weight" not in names
    assert names["model.layers.0.self_attn.q_proj.weight"].hf_shape == (4 * 24, 64)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in names
    shapes = hf_map.leaf_shapes(cfg)
    assert "params/lm_head" not in shapes and shapes["params/dense/attn/q_proj"] == (1, 64, 96)
    model = _hf_model(cfg)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sd["model.layers.0.self_attn.q_proj.weight"] == (96, 64)


def test_unsupported_combination_is_a_user_error():
    cfg = load_config("mixtral-tiny", overrides=["moe.n_shared_experts=1"], validate_config=False)
    with pytest.raises(UserError, match="n_shared_experts"):
        hf_map.entries(cfg)


# --------------------------------------------------------------------------------------------
# conversions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_torch_hf_round_trip_bit_exact(hf_dirs, preset, tmp_path):
    cfg, d = hf_dirs[preset]
    convert(ep(f"hf:{d}"), ep(f"torch:{tmp_path}/m.safetensors"))
    convert(ep(f"torch:{tmp_path}/m.safetensors"), ep(f"hf:{tmp_path}/back"))
    assert _same_tensors(d, tmp_path / "back") == len(hf_map.entries(cfg))
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_cfg["architectures"] == json.loads((d / "config.json").read_text())["architectures"]


def _bad_copy(src: Path, dst: Path, edit):
    """Copy an HF dir, letting ``edit(tensors, config)`` change its tensors/config."""
    r = SafetensorsReader(src)
    tensors = {n: r.get(n) for n in r.names()}
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    dst.mkdir()
    write_tensors(dst, tensors)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BAD_CASES = {
    "missing": (lambda t, c: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
                r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight "
                r"\(expected shape \[64, 64\]"),
    "extra": (lambda t, c: t.__setitem__("model.layers.0.mlp.surprise.weight",
                                         np.zeros((2, 3), np.float32)),
              r"unexpected tensor model\.layers\.0\.mlp\.surprise\.weight \[2, 3\]"),
    "misshaped": (lambda t, c: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                             np.zeros((16, 64), np.float32)),
                  r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\] in "
                  r"the checkpoint but config\.json implies \[32, 64\]"),
    "config": (lambda t, c: c.__setitem__("vocab_size", 300),
               r"tensor model\.embed_tokens\.weight has shape \[256, 64\] in the checkpoint but "
               r"config\.json implies \[300, 64\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("dst_kind", ["torch", "hf"])
def test_bad_source_names_tensor_and_writes_nothing(hf_dirs, tmp_path, case, dst_kind):
    edit, pattern = BAD_CASES[case]
    bad = _bad_copy(hf_dirs["tiny"][1], tmp_path / "bad", edit)
    dst = tmp_path / ("out.safetensors" if dst_kind == "torch" else "out")
    with pytest.raises(UserError, match=pattern):
        convert(ep(f"hf:{bad}"), ep(f"{dst_kind}:{dst}"))
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no temporary left behind


def test_existing_destination_needs_force(hf_dirs, tmp_path):
    d = hf_dirs["tiny"][1]
    out = tmp_path / "m.safetensors"
    out.write_text("precious")
    with pytest.raises(UserError, match="--force"):
        convert(ep(f"hf:{d}"), ep(f"torch:{out}"))
    assert out.read_text() == "precious"
    convert(ep(f"hf:{d}"), ep(f"torch:{out}"), force=True)
    assert len(SafetensorsReader(out).names()) == len(hf_map.entries(hf_dirs["tiny"][0]))


def test_force_never_deletes_the_source_or_a_foreign_folder(hf_dirs, tmp_path):
    """--force replaces only an earlier conversion's output: never a folder that holds the source,
    the source itself, or an ordinary folder of someone else's files."""
    import shutil

    parent = tmp_path / "parent"
    src = parent / "model"
    shutil.copytree(hf_dirs["tiny"][1], src)
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(UserError, match="contains the source"):
        convert(ep(f"hf:{src}"), ep(f"hf:{parent}"), force=True)
    with pytest.raises(UserError, match="same path"):
        convert(ep(f"hf:{src}"), ep(f"hf:{src}/."), force=True)
    assert sorted(p.name for p in src.iterdir()) == before
    run = tmp_path / "run"
    convert(ep(f"hf:{src}"), ep(f"orbax:{run}"))
    inner = run / "export"
    inner.mkdir()
    (inner / "config.json").write_text("{}")
    with pytest.raises(UserError, match="is inside the source"):
        convert(ep(f"orbax:{run}"), ep(f"hf:{inner}"), force=True)
    assert (inner / "config.json").read_text() == "{}"
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match="--force replaces only"):
        convert(ep(f"hf:{src}"), ep(f"hf:{home}"), force=True)
    with pytest.raises(UserError, match="--force replaces only"):
        convert(ep(f"hf:{src}"), ep(f"orbax:{home}"), force=True)
    assert (home / "notes.txt").read_text() == "precious"
    # an earlier conversion's output is replaced
    out = tmp_path / "out"
    convert(ep(f"hf:{src}"), ep(f"hf:{out}"))
    convert(ep(f"hf:{src}"), ep(f"hf:{out}"), force=True)
    assert (out / "config.json").is_file()


def test_fp8_checkpoint(hf_dirs, tmp_path, capsys):
    """DeepSeek-style FP8 weights are dequantised on import (MTP layers: tests/test_mtp.py)."""
    cfg, d = hf_dirs["tiny-mla"]
    name = "model.layers.1.mlp.experts.2.gate_proj.weight"  # [32, 64]: one partial 128 block

    def edit(t, c):
        w = torch.from_numpy(t[name].copy())
        scale = torch.tensor([[0.01]], dtype=torch.float32)
        t[name] = (w / 0.01).to(torch.float8_e4m3fn).view(torch.uint8).numpy().view(
            ml_dtypes.float8_e4m3fn)
        t[name + "_scale_inv"] = scale.numpy()
        c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}

    src = _bad_copy(d, tmp_path / "fp8", edit)
    convert(ep(f"hf:{src}"), ep(f"torch:{tmp_path}/m.safetensors"))
    r_in, r_out = SafetensorsReader(src), SafetensorsReader(tmp_path / "m.safetensors")
    want = r_in.get(name).astype(np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(r_out.get(name), want)
    assert r_out.dtype(name) == np.float32
    assert not any("scale_inv" in n or "layers.3." in n for n in r_out.names())
    assert np.array_equal(r_out.get("model.layers.2.mlp.gate.weight"),
                          SafetensorsReader(d).get("model.layers.2.mlp.gate.weight"))


def test_bfloat16_output(hf_dirs, tmp_path):
    cfg, d = hf_dirs["mixtral-tiny"]
    convert(ep(f"hf:{d}"), ep(f"torch:{tmp_path}/m.safetensors"), dtype="bfloat16")
    a, b = SafetensorsReader(d), SafetensorsReader(tmp_path / "m.safetensors")
    for n in a.names():
        if n.endswith(".gate.weight"):  # the router weight stays fp32 (hf_map.fp32_leaves)
            assert b.dtype(n) == np.float32 and np.array_equal(b.get(n), a.get(n)), n
            continue
        assert b.dtype(n) == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(b.get(n), a.get(n).astype(ml_dtypes.bfloat16))


# --------------------------------------------------------------------------------------------
# CLI: convert --verify --json, errors, logits
# --------------------------------------------------------------------------------------------


def _hf_reference_logits(d: Path, tokens: np.ndarray) -> np.ndarray:
    """Logits straight from transformers (no jaxmoe code on this path)."""
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def test_cli_convert_verify_json(hf_dirs, tmp_path, capsys):
    from jaxmoe.cli import main

    d = hf_dirs["tiny-mla"][1]
    rc = main(["convert", "--from", f"hf:{d}", "--to", f"torch:{tmp_path}/m.safetensors",
               "--verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    v = out["verify"]
    # jaxmoe reads the source through the mapping, torch_ref the written file with its own loader
    assert v["src_framework"] == "jax" and v["dst_framework"] == "torch"
    assert v["ok"] and v["kl"] <= 1e-6 and v["max_abs"] <= 1e-4 and v["top1"] == 1.0
    assert out["tensors"] == len(hf_map.entries(hf_dirs["tiny-mla"][0]))


def test_cli_convert_error_is_one_line_and_exit_2(hf_dirs, tmp_path, capsys):
    from jaxmoe.cli import main

    bad = _bad_copy(hf_dirs["mixtral-tiny"][1], tmp_path / "bad",
                    lambda t, c: c.__setitem__("num_local_experts", 8))
    rc = main(["convert", "--from", f"hf:{bad}", "--to", f"torch:{tmp_path}/m.safetensors"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "tensor model.layers.0.block_sparse_moe.gate.weight has shape " \
        "[4, 64] in the checkpoint but config.json implies [8, 64]" in err
    assert not (tmp_path / "m.safetensors").exists()
    rc = main(["convert", "--from", f"nope:{bad}", "--to", f"torch:{tmp_path}/m.safetensors"])
    assert rc == 2 and "expected hf:DIR" in capsys.readouterr().err


def test_cli_logits_torch_matches_transformers(hf_dirs, tmp_path):
    from jaxmoe.cli import main

    d = hf_dirs["tiny"][1]
    tokens = np.random.default_rng(3).integers(0, 256, (2, 12)).astype(np.int32)
    np.save(tmp_path / "tok.npy", tokens)
    assert main(["logits", "--ckpt", f"hf:{d}", "--tokens", str(tmp_path / "tok.npy"),
                 "--out", str(tmp_path / "lg.npy"), "--framework", "torch"]) == 0
    got = np.load(tmp_path / "lg.npy")
    assert got.dtype == np.float32 and got.shape == (2, 12, 256)
    f = compare_logits(_hf_reference_logits(d, tokens), got)
    assert f["kl"] <= 1e-6 and f["max_abs"] <= 1e-4
    np.save(tmp_path / "bad.npy", np.array([[1, 2, 256]]))
    with pytest.raises(UserError, match="token id 256 is outside the vocabulary"):
        compute_logits(ep(f"hf:{d}"), np.load(tmp_path / "bad.npy"), "torch")


# --------------------------------------------------------------------------------------------
# jaxmoe side: layout agreement, Orbax round trips, logits vs transformers
# --------------------------------------------------------------------------------------------


def _flat_leaves(params, buffers) -> dict:
    out = {"params/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(params)).items()}
    out.update({"buffers/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(buffers)).items()})
    return out


@pytest.mark.parametrize("preset", PRESETS + ["tiny-tied"])
def test_table_leaves_match_init_params(preset):
    from jaxmoe.model.transformer import init_params

    if preset == "tiny-tied":
        cfg = load_config("tiny", overrides=["model.tie_embeddings=true", "model.first_k_dense=1"])
    else:
        cfg = load_config(preset)
    import jax

    # shapes only: trace init_params abstractly instead of running ~50 eager random ops
    params, buffers = jax.eval_shape(lambda: init_params(cfg, 0))
    flat = {"params/" + k: v for k, v in hf_map.flatten(dict(params)).items()}
    flat.update({"buffers/" + k: v for k, v in hf_map.flatten(dict(buffers)).items()})
    assert {k: tuple(v.shape) for k, v in flat.items()} == hf_map.leaf_shapes(cfg)
    assert {str(v.dtype) for v in flat.values()} == {"float32"}


@pytest.mark.parametrize("preset", PRESETS)
def test_hf_orbax_hf_and_orbax_hf_orbax_bit_exact(hf_dirs, preset, tmp_path, monkeypatch):
    from jaxmoe.checkpoint import checkpointer as checkpoint

    # orbax: destinations stream leaves in chunks; make the tiny leaves multi-chunk too
    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 32768)
    cfg, d = hf_dirs[preset]
    convert(ep(f"hf:{d}"), ep(f"orbax:{tmp_path}/run"))
    convert(ep(f"orbax:{tmp_path}/run"), ep(f"hf:{tmp_path}/back"))
    assert _same_tensors(d, tmp_path / "back") == len(hf_map.entries(cfg))

    # a jaxmoe-native checkpoint: random values for every leaf of the layout (the layout itself
    # is checked against init_params by test_table_leaves_match_init_params), buffers included
    rng = np.random.default_rng(1)
    tree = hf_map.unflatten({k: rng.standard_normal(s).astype(np.float32)
                             for k, s in hf_map.leaf_shapes(cfg).items()})
    params, buffers = tree["params"], tree.get("buffers", {})
    checkpoint.save_model(str(tmp_path / "run0"), cfg, params, buffers, step=0)
    convert(ep(f"orbax:{tmp_path}/run0"), ep(f"hf:{tmp_path}/hf1"))
    convert(ep(f"hf:{tmp_path}/hf1"), ep(f"orbax:{tmp_path}/run1"))
    _cfg, p1, b1, _meta = checkpoint.load_model(str(tmp_path / "run1"))
    want, got = _flat_leaves(params, buffers), _flat_leaves(p1, b1)
    assert sorted(want) == sorted(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), k


@pytest.mark.parametrize("preset", PRESETS)
def test_transformers_model_to_jaxmoe_logits_match(hf_dirs, preset, tmp_path):
    """HF random-init model -> `jaxmoe convert` -> `jaxmoe logits` (jax) == HF's own logits."""
    from jaxmoe.cli import main

    cfg, d = hf_dirs[preset]
    assert main(["convert", "--from", f"hf:{d}", "--to", f"orbax:{tmp_path}/run"]) == 0
    tokens = np.random.default_rng(5).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tok.npy", tokens)
    assert main(["logits", "--ckpt", f"orbax:{tmp_path}/run", "--tokens",
                 str(tmp_path / "tok.npy"), "--out", str(tmp_path / "lg.npy")]) == 0
    f = compare_logits(_hf_reference_logits(d, tokens), np.load(tmp_path / "lg.npy"))
    assert f["kl"] <= 1e-6 and f["max_abs"] <= 1e-4, f


def test_bad_source_to_orbax_writes_nothing(hf_dirs, tmp_path):
    bad = _bad_copy(hf_dirs["tiny-mla"][1], tmp_path / "bad",
                    lambda t, c: c.__setitem__("kv_lora_rank", 16))
    with pytest.raises(UserError, match=r"kv_a_proj_with_mqa\.weight has shape \[40, 64\] in the "
                                        r"checkpoint but config\.json implies \[24, 64\]"):
        convert(ep(f"hf:{bad}"), ep(f"orbax:{tmp_path}/run"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]
