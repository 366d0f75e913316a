"""``jaxmoe convert --hf-layout per-expert|fused``: writing the fused HF expert layout.

The fused layout is what transformers' ``save_pretrained(..., save_original_format=False)``
writes: per MoE layer one ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and one
``experts.down_proj [E, H, I]`` (Mixtral's block under ``mlp.`` instead of
``block_sparse_moe.``). The reference for its names and shapes is transformers itself (a tiny
model of each family built from our preset's config and saved fused in-process); the reference
for its contents is transformers loading what jaxmoe wrote (logits vs jaxmoe's on the source)
and the bit-exact round trip back to the per-expert layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import UserError
from jaxmoe.port.commands.convert import convert
from jaxmoe.port.commands.logits import compare_logits, compute_logits
from jaxmoe.port.formats import open_source, parse_endpoint
from jaxmoe.port.io.safetensors_io import SafetensorsReader

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import random_hf_model, same_tensors  # noqa: E402

PRESETS = ["tiny", "mixtral-tiny", "tiny-mla"]
TOL = {"kl": 1e-6, "max_abs": 1e-4}


def _hf_model(cfg, seed: int):
    """A random transformers model of ``cfg``'s family; weights x4 so logits are decisive."""
    return random_hf_model(cfg, seed, weight_scale=4.0)


class _Saved(dict):
    models: dict


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """preset -> (dir saved per-expert by transformers, dir saved fused by transformers);
    ``.models[preset]``: the transformers model saved."""
    root = tmp_path_factory.mktemp("hflayout")
    out = _Saved()
    out.models = {}
    for i, preset in enumerate(PRESETS):
        model = _hf_model(load_config(preset), seed=i)
        per, fused = root / f"{preset}-per-expert", root / f"{preset}-fused"
        model.save_pretrained(per)  # the hub (per-expert) names
        model.save_pretrained(fused, save_original_format=False)
        out[preset] = (per, fused)
        out.models[preset] = model
    return out


def _shapes(d: Path) -> dict:
    r = SafetensorsReader(d)
    return {n: tuple(r.shape(n)) for n in r.names()}


_same_tensors = same_tensors


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_write_matches_transformers_and_round_trips(saved, preset, tmp_path):
    per, hf_fused = saved[preset]
    out, back = tmp_path / "fused", tmp_path / "back"
    stats = convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"hf:{out}"), hf_layout="fused")
    # names and shapes exactly those of transformers' own fused save
    want = _shapes(hf_fused)
    assert _shapes(out) == want and stats["tensors"] == len(want)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in want)  # really fused
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in want)
    src = open_source(parse_endpoint(f"hf:{out}"))  # every MoE layer is read back as fused
    m = src.cfg.model
    assert {src.layouts[i] for i in range(m.first_k_dense, m.n_layers)} == {"fused"}
    # the contents equal transformers' fused save, bit for bit (same weights, other writer)
    assert _same_tensors(out, hf_fused) == len(want)
    # and back: per-expert is the default layout
    convert(parse_endpoint(f"hf:{out}"), parse_endpoint(f"hf:{back}"))
    assert _same_tensors(per, back) == len(_shapes(per))


def _logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


# jaxmoe's side compiles a model per family (~10-20 s on 2 busy cores): Mixtral (the family whose
# module moves, block_sparse_moe. -> mlp.) in the fast tier, the other two in the slow tier
JAX_CASES = [pytest.param(p, marks=() if p == "mixtral-tiny" else pytest.mark.slow)
             for p in PRESETS]


@pytest.mark.parametrize("preset", PRESETS)
def test_fused_output_loads_in_transformers(saved, preset, tmp_path):
    """transformers loads jaxmoe's fused output and computes the model it was written from."""
    per, _ = saved[preset]
    out = tmp_path / "fused"
    convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"hf:{out}"), hf_layout="fused")
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = np.random.default_rng(11).integers(0, model.config.vocab_size, (2, 16))
    ref = _logits(saved.models[preset], tokens)  # the model saved_pretrained, in memory
    got = _logits(model, tokens)
    assert ref.std() > 0.3  # decisive weights: a misplaced half would move logits far
    assert np.abs(got - ref).max() <= 1e-6


@pytest.mark.parametrize("preset", JAX_CASES)
def test_fused_output_logits_equal_jaxmoe(saved, preset, tmp_path):
    """transformers on jaxmoe's fused output == jaxmoe on the per-expert source."""
    per, _ = saved[preset]
    out = tmp_path / "fused"
    convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"hf:{out}"), hf_layout="fused")
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = np.random.default_rng(12).integers(0, model.config.vocab_size, (2, 16))
    ref = _logits(model, tokens)
    got = compute_logits(parse_endpoint(f"hf:{per}"), tokens.astype(np.int32), "jax")
    f = compare_logits(ref, got)
    assert f["max_abs"] <= TOL["max_abs"] and f["kl"] <= TOL["kl"], f


def test_orbax_to_fused_reads_slices_and_matches(saved, tmp_path):
    """orbax -> hf fused goes through the sliced leaf reader; same bytes as hf -> hf fused."""
    per, hf_fused = saved["tiny-mla"]
    convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"orbax:{tmp_path}/run"))
    convert(parse_endpoint(f"orbax:{tmp_path}/run"), parse_endpoint(f"hf:{tmp_path}/fused"),
            dtype="float32", hf_layout="fused")
    assert _same_tensors(tmp_path / "fused", hf_fused) == len(_shapes(hf_fused))


def test_fused_write_keeps_bf16_and_fp32_router(saved, tmp_path):
    per, hf_fused = saved["mixtral-tiny"]
    out = tmp_path / "fused"
    convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"hf:{out}"), dtype="bfloat16",
            hf_layout="fused")
    r, ref = SafetensorsReader(out), SafetensorsReader(hf_fused)
    for n in r.names():
        if n.endswith("mlp.gate.weight"):  # the router stays fp32
            assert r.dtype(n) == np.float32 and np.array_equal(r.get(n), ref.get(n)), n
        else:
            assert str(r.dtype(n)) == "bfloat16", n
            x = ref.get(n).astype(np.float32)
            np.testing.assert_allclose(r.get(n).astype(np.float32), x, rtol=2**-8, atol=0)


def test_bad_hf_layout_is_one_line(saved, tmp_path, capsys):
    from jaxmoe.cli import main

    per, _ = saved["tiny"]
    with pytest.raises(SystemExit) as e:  # argparse: names the choices
        main(["convert", "--from", f"hf:{per}", "--to", f"hf:{tmp_path}/x", "--hf-layout", "packed"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'per-expert', 'fused'" in err and "packed" in err
    with pytest.raises(UserError, match="choose one of per-expert, fused"):
        convert(parse_endpoint(f"hf:{per}"), parse_endpoint(f"hf:{tmp_path}/x"), hf_layout="packed")
    for dst in (f"torch:{tmp_path}/m.safetensors", f"orbax:{tmp_path}/run"):
        rc = main(["convert", "--from", f"hf:{per}", "--to", dst, "--hf-layout", "fused"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "hf: destinations only" in err, err
    assert not any(tmp_path.iterdir())  # nothing written
