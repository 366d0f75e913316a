"""``jaxmoe convert --verify`` checks the mapping: jaxmoe (JAX) runs one side, PyTorch the other.

An error injected into what a conversion writes -- two experts swapped, one weight transposed --
must fail ``--verify`` (exit 1) in both directions (orbax -> hf: JAX on the source vs transformers
on the written files; hf -> orbax: transformers on the source vs JAX on the written run dir).
``--verify-layers N`` checks a model truncated to N layers, reading only those layers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.checkpoint import checkpointer as checkpoint
from jaxmoe.cli import main
from jaxmoe.config import load_config
from jaxmoe.port.commands.convert import convert
from jaxmoe.port.formats import parse_endpoint
from jaxmoe.port.formats.hf import HfTensorSink
from jaxmoe.port.formats.orbax import OrbaxSink
from jaxmoe.port.maps import hf_map

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXPERT_LEAF = "params/moe/experts/gate_proj"


def make_run(path, preset="tiny", scale=8.0, seed=0):
    """A jaxmoe run dir (step 0) with random weights scaled so that logits are far from uniform
    (a wrong tensor then moves them well past the fp32 tolerance)."""
    cfg = load_config(preset)
    rng = np.random.default_rng(seed)
    flat = {}
    for k, s in hf_map.leaf_shapes(cfg).items():
        if "norm" in k:
            flat[k] = (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32)
        else:
            flat[k] = (scale * 0.02 * rng.standard_normal(s)).astype(np.float32)
    tree = hf_map.unflatten(flat)
    checkpoint.save_model(str(path), cfg, tree["params"], tree.get("buffers", {}), step=0)
    return cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify") / "run"
    make_run(d)
    return d


def _convert_verify(capsys, src, dst, *extra):
    rc = main(["convert", "--from", src, "--to", dst, "--verify", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)["verify"]


def _corrupt(mode):
    """Wrap a sink's write_leaf so that the expert leaf it writes is wrong."""
    def bad(arr):
        if not isinstance(arr, np.ndarray):  # a source's lazy view: read it layer by layer
            arr = np.stack([np.asarray(arr[(i,)]) for i in range(arr.shape[0])])
        arr = np.array(arr)
        if mode == "swap":  # experts 0 and 1 of MoE layer 0 trade places
            arr[0, [0, 1]] = arr[0, [1, 0]]
        else:  # expert 0 of MoE layer 0 transposed (a square [D, I] matrix in `tiny`)
            assert arr.shape[-1] == arr.shape[-2]
            arr[0, 0] = arr[0, 0].T.copy()
        return arr
    return bad


def test_orbax_to_hf_runs_jax_against_transformers(run_dir, tmp_path, capsys):
    rc, v = _convert_verify(capsys, f"orbax:{run_dir}", f"hf:{tmp_path}/hf")
    assert (v["src_framework"], v["dst_framework"]) == ("jax", "hf")
    assert rc == 0 and v["ok"] and v["max_abs"] <= 1e-4 and v["kl"] <= 1e-6, v
    assert len(v["hidden_rel_max_abs"]) == 1  # tiny: 2 layers -> layer 0's output compared


def test_orbax_to_orbax_says_both_sides_are_jax(run_dir, tmp_path, capsys):
    rc = main(["convert", "--from", f"orbax:{run_dir}", "--to", f"orbax:{tmp_path}/copy", "--verify", "--json"])
    cap = capsys.readouterr()
    v = json.loads(cap.out)["verify"]
    assert rc == 0 and (v["src_framework"], v["dst_framework"]) == ("jax", "jax")
    note = [n for n in v["notes"] if "both sides run in jaxmoe" in n]
    assert len(note) == 1 and note[0] in cap.err and "not the mapping" in note[0]


@pytest.mark.parametrize("mode", ["swap", "transpose"])
def test_orbax_to_hf_mapping_error_is_caught(run_dir, tmp_path, capsys, monkeypatch, mode):
    orig = HfTensorSink.write_leaf
    fix = _corrupt(mode)

    def write_leaf(self, key, arr):
        orig(self, key, fix(arr) if key == EXPERT_LEAF else arr)

    monkeypatch.setattr(HfTensorSink, "write_leaf", write_leaf)
    rc, v = _convert_verify(capsys, f"orbax:{run_dir}", f"hf:{tmp_path}/hf")
    assert rc == 1 and not v["ok"] and v["max_abs"] > 1e-3, v


@pytest.mark.parametrize("mode", ["swap", "transpose"])
def test_hf_to_orbax_mapping_error_is_caught(run_dir, tmp_path, capsys, monkeypatch, mode):
    convert(parse_endpoint(f"orbax:{run_dir}"), parse_endpoint(f"hf:{tmp_path}/hf"))
    orig = OrbaxSink.write_leaf
    fix = _corrupt(mode)

    def write_leaf(self, key, arr):
        orig(self, key, fix(arr) if key == EXPERT_LEAF else arr)

    rc, v = _convert_verify(capsys, f"hf:{tmp_path}/hf", f"orbax:{tmp_path}/ok")
    assert (v["src_framework"], v["dst_framework"]) == ("hf", "jax")
    assert rc == 0 and v["ok"], v
    monkeypatch.setattr(OrbaxSink, "write_leaf", write_leaf)
    rc, v = _convert_verify(capsys, f"hf:{tmp_path}/hf", f"orbax:{tmp_path}/bad")
    assert rc == 1 and not v["ok"] and v["max_abs"] > 1e-3, v


def test_verify_layers_truncates_and_still_catches_errors(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    make_run(run, "mixtral-tiny")
    rc, v = _convert_verify(capsys, f"orbax:{run}", f"torch:{tmp_path}/m.safetensors",
                            "--verify-layers", "1")
    assert (v["src_framework"], v["dst_framework"], v["layers"]) == ("jax", "torch", 1)
    assert rc == 0 and v["ok"], v
    rc, v = _convert_verify(capsys, f"orbax:{run}", f"hf:{tmp_path}/hf", "--verify-layers", "2")
    assert rc == 0 and v["ok"] and v["layers"] == 2 and len(v["hidden_rel_max_abs"]) == 1, v

    orig = HfTensorSink.write_leaf
    fix = _corrupt("swap")
    monkeypatch.setattr(HfTensorSink, "write_leaf",
                        lambda self, key, arr: orig(self, key, fix(arr) if key == EXPERT_LEAF else arr))
    rc, v = _convert_verify(capsys, f"orbax:{run}", f"hf:{tmp_path}/bad", "--verify-layers", "1")
    assert rc == 1 and not v["ok"], v


def test_verify_layers_without_verify_is_one_line(run_dir, tmp_path, capsys):
    rc = main(["convert", "--from", f"orbax:{run_dir}", "--to", f"hf:{tmp_path}/x",
               "--verify-layers", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--verify" in err
    assert not (tmp_path / "x").exists()
