"""``convert --verify`` with a ``dcp:`` endpoint runs torchtitan's own model of the flavor.

``dcp:`` as a source: torchtitan on the DCP step vs jaxmoe on the written run dir; as a
destination: jaxmoe on the source vs torchtitan on the written step (its flavor from the source's
config). An expert pair swapped in what either sink writes fails the check (exit 1); a model
torchtitan has no flavor of (a jaxmoe preset) falls back to jaxmoe with one ``note:`` line.

The run dir is torchtitan's DeepSeek-V3 ``debugmodel`` (``--titan deepseek_v3/debugmodel``: 6
layers, the first dense, 8 experts, ~120 MB fp32) with random weights of std 0.05 (logits of
order 1, so a wrong tensor moves them far past the fp32 tolerance); most checks use
``--verify-layers 2`` (the dense layer and the first MoE layer) to stay cheap.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import needs_titan

from jaxmoe.checkpoint import checkpointer as checkpoint
from jaxmoe.cli import main
from jaxmoe.port.formats.dcp import DcpSink
from jaxmoe.port.formats.orbax import OrbaxSink
from jaxmoe.port.maps import titan_map
from jaxmoe.trees import unflatten

pytest.importorskip("torch")
FLAVOR = "deepseek_v3/debugmodel"
EXPERT_LEAF = "params/moe/experts/gate_proj"





def _make_run(path, spec: str, std: float = 0.05):
    """A jaxmoe run dir (step 0) of the model ``spec`` names (as ``--titan`` does), random weights."""
    from jaxmoe.config import named_config

    cfg = named_config(spec)
    rng = np.random.default_rng(0)
    flat = {k: ((1.0 + 0.1 * rng.standard_normal(s)) if "norm" in k else std * rng.standard_normal(s))
            .astype(np.float32) for k, s in titan_map.leaf_shapes(cfg).items()}
    params = unflatten({k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("params/")})
    buffers = unflatten({k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("buffers/")})
    checkpoint.save_model(str(path), cfg, params, buffers, step=0)
    return cfg


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcpv") / "run"
    _make_run(d, FLAVOR)
    return d


def _verify(capsys, src, dst, *extra):
    rc = main(["convert", "--from", src, "--to", dst, "--verify", "--json", *extra])
    cap = capsys.readouterr()
    assert cap.out.strip(), cap.err
    return rc, json.loads(cap.out)["verify"], cap.err


def _swap_experts(arr):
    """Experts 0 and 1 of MoE layer 0 trade places (a lazy source view is read whole first)."""
    arr = np.array(arr if isinstance(arr, np.ndarray) else arr[()])
    arr[0, [0, 1]] = arr[0, [1, 0]]
    return arr


@needs_titan
def test_orbax_to_dcp_and_back_run_torchtitan(titan_run, tmp_path, capsys):
    rc, v, _ = _verify(capsys, f"orbax:{titan_run}", f"dcp:{tmp_path}/step-1", "--verify-layers", "2")
    assert (v["src_framework"], v["dst_framework"]) == ("jax", "titan") and v["notes"] == []
    assert rc == 0 and v["ok"] and v["max_abs"] <= 1e-4 and v["kl"] <= 1e-6, v
    assert len(v["hidden_rel_max_abs"]) == 1  # layer 0 compared; layer 1 by the logits
    # dcp: as the source: torchtitan on the step, jaxmoe on the run dir written from it
    rc, v, _ = _verify(capsys, f"dcp:{tmp_path}/step-1", f"orbax:{tmp_path}/back", "--titan", FLAVOR,
                       "--verify-layers", "2")
    assert (v["src_framework"], v["dst_framework"], v["layers"]) == ("titan", "jax", 2)
    assert rc == 0 and v["ok"] and len(v["hidden_rel_max_abs"]) == 1, v
    # dcp: -> dcp: torchtitan on both steps (neither read through jaxmoe's mapping)
    rc, v, _ = _verify(capsys, f"dcp:{tmp_path}/step-1", f"dcp:{tmp_path}/step-2", "--titan", FLAVOR,
                       "--verify-layers", "2")
    assert (v["src_framework"], v["dst_framework"]) == ("titan", "titan") and rc == 0 and v["ok"], v


@needs_titan
def test_a_swapped_expert_in_either_sink_fails_verify(titan_run, tmp_path, capsys, monkeypatch):
    orig_dcp, orig_orbax = DcpSink.write_leaf, OrbaxSink.write_leaf
    assert main(["convert", "--from", f"orbax:{titan_run}", "--to", f"dcp:{tmp_path}/good"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(DcpSink, "write_leaf", lambda self, key, arr: orig_dcp(
        self, key, _swap_experts(arr) if key == EXPERT_LEAF else arr))
    rc, v, _ = _verify(capsys, f"orbax:{titan_run}", f"dcp:{tmp_path}/bad", "--verify-layers", "2")
    assert (v["src_framework"], v["dst_framework"]) == ("jax", "titan")
    assert rc == 1 and not v["ok"] and v["max_abs"] > 1e-3, v
    monkeypatch.setattr(OrbaxSink, "write_leaf", lambda self, key, arr: orig_orbax(
        self, key, _swap_experts(arr) if key == EXPERT_LEAF else arr))
    rc, v, _ = _verify(capsys, f"dcp:{tmp_path}/good", f"orbax:{tmp_path}/bad-run", "--titan", FLAVOR,
                       "--verify-layers", "2")
    assert (v["src_framework"], v["dst_framework"]) == ("titan", "jax")
    assert rc == 1 and not v["ok"] and v["max_abs"] > 1e-3, v


def test_a_jaxmoe_preset_has_no_torchtitan_model_and_falls_back(tmp_path, capsys):
    """``tiny`` is no torchtitan flavor: both directions run jaxmoe, saying so in one note line."""
    _make_run(tmp_path / "run", "tiny", std=0.16)
    rc, v, err = _verify(capsys, f"orbax:{tmp_path}/run", f"dcp:{tmp_path}/step")
    assert rc == 0 and v["ok"] and (v["src_framework"], v["dst_framework"]) == ("jax", "jax"), v
    notes = [x for x in err.splitlines() if "torchtitan has no model" in x]
    assert len(notes) == 1 and notes == v["notes"] and "'tiny' is a jaxmoe config" in notes[0], err
    rc, v, err = _verify(capsys, f"dcp:{tmp_path}/step", f"orbax:{tmp_path}/back", "--titan", "tiny")
    assert rc == 0 and v["ok"] and (v["src_framework"], v["dst_framework"]) == ("jax", "jax"), v
    assert len(v["notes"]) == 1 and "not a torchtitan FAMILY/FLAVOR" in v["notes"][0], v["notes"]


@needs_titan
def test_a_config_changed_from_its_flavor_has_no_torchtitan_model():
    """``titan:FAMILY/FLAVOR`` names the flavor only while its forward fields are the flavor's."""
    import dataclasses

    from jaxmoe.config import named_config
    from jaxmoe.port.commands.verify_titan import titan_flavor

    cfg = named_config(FLAVOR)
    assert titan_flavor(cfg) == (FLAVOR, "")
    train_only = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, lb_coef=0.01, capacity_factor=1.25))
    assert titan_flavor(train_only) == (FLAVOR, "")
    sig = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, score_func="sigmoid"),
                              model=dataclasses.replace(cfg.model, mla_norm_eps=1e-6))
    spec, why = titan_flavor(sig)
    assert spec is None and why.endswith("in model.mla_norm_eps, moe.score_func"), why


@needs_titan
@pytest.mark.slow  # the whole 6-layer model on both sides: ~15 s more here
def test_whole_model_orbax_to_dcp_runs_torchtitan(titan_run, tmp_path, capsys):
    rc, v, _ = _verify(capsys, f"orbax:{titan_run}", f"dcp:{tmp_path}/step-1")
    assert (v["src_framework"], v["dst_framework"], v["layers"]) == ("jax", "titan", None)
    assert rc == 0 and v["ok"] and v["max_abs"] <= 1e-4 and v["kl"] <= 1e-6, v
    assert len(v["hidden_rel_max_abs"]) == 5  # 6 layers: layers 0..4 compared, 5 by the logits
