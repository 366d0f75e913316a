"""Cross-framework resume (issue 29, items 3 and 4): a jaxmoe run written back as a full torchtitan
checkpoint (``convert ... dcp: --with-optimizer``) that torchtitan's own ``CheckpointManager``
restores tensor for tensor and continues; a torchtitan run (its own model, AdamW, LR schedulers,
MoE bias hook, ``CheckpointManager``) continued in jaxmoe with ``train --resume-from dcp:``. In
both directions the M steps after the checkpoint agree with the framework that continues its own
run, within the torchtitan parity tolerance (``float32-adamw`` ``step_loss_rel``).

The model: torchtitan's DeepSeek-V3 ``debugmodel`` cut to its first layers (one dense layer, then
MoE), its router in DeepSeek-V3 mode (sigmoid scores, 4 groups of 2 with 2 kept, route_norm,
route_scale 2.5) and torchtitan's expert-bias hook on both sides (jaxmoe's ``sign_centred`` rule),
fp32, jaxmoe's default data (batch 2 x 32 tokens); schedule ``titan_wsd`` (warmup 2, decay 0.8,
linear) over the run's steps. torchtitan's side runs in a subprocess (``tests/titan_resume_side.py``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import free_port, needs_titan

from jaxmoe.cli import main

ROOT = Path(__file__).resolve().parents[1]
FLAVOR = "deepseek_v3/debugmodel"
SIGMOID = ["moe.router.score_func=sigmoid", "moe.router.num_expert_groups=4", "moe.router.num_limited_groups=2",
           "moe.router.route_norm=true", "moe.router.route_scale=2.5"]



pytestmark = needs_titan



def _toml(path: Path, layers: int, steps: int) -> Path:
    from jaxmoe.config import config_to_toml
    from jaxmoe.config.titan import config_from_titan

    cfg = config_from_titan(FLAVOR, SIGMOID).config
    cfg.model.n_layers = layers
    t = cfg.train
    t.steps, t.batch_size, t.seq_len, t.eval_every = steps, 2, 32, 0
    cfg.optim.warmup_steps, cfg.optim.titan_decay_ratio = 2, 0.8
    path.write_text(config_to_toml(cfg))
    return path


def _titan(folder: Path, toml: Path, layers: int, k: int, m: int, mode: str) -> dict:
    """torchtitan's side (see tests/titan_resume_side.py) -> its out.json."""
    spec = folder / "spec.json"
    folder.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"titan": FLAVOR, "titan_set": SIGMOID, "layers": layers, "toml": str(toml),
                                "folder": str(folder), "K": k, "M": m, "port": free_port(), "mode": mode}))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "titan_resume_side.py"), str(spec)],
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((folder / "out.json").read_text())


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _tol() -> float:
    from parity.tolerances import tolerances_for

    return tolerances_for("float32", "adamw").step_loss_rel


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error printed"
    return err[-1]


# --------------------------------------------------------------------------------------------
# jaxmoe -> torchtitan: one jaxmoe run (2 of 4 steps), written back with --with-optimizer
# --------------------------------------------------------------------------------------------

K, M, LAYERS = 2, 2, 2


@pytest.fixture(scope="module")
def titan_ckpt(tmp_path_factory):
    """(config toml, torchtitan's full step K of K+M, its out.json): torchtitan trains K steps of
    the LAYERS-layer model on jaxmoe's batches and saves with its CheckpointManager (~10 s)."""
    tmp = tmp_path_factory.mktemp("titan")
    toml = _toml(tmp / "m.toml", LAYERS, K + M)
    out = _titan(tmp / "titan", toml, LAYERS, K, 1, "train_save_resume")
    return toml, tmp / "titan" / f"step-{K}", out


def test_torchtitan_state_maps_into_jaxmoe(titan_ckpt):
    """What ``--resume-from`` starts from equals what torchtitan's CheckpointManager loads, bit for
    bit: every weight, expert bias, exp_avg, exp_avg_sq (through the one name table), the AdamW
    count, the step and the data position; the train section takes the checkpoint's AdamW fields."""
    import jax

    from jaxmoe.config import load_config
    from jaxmoe.model.transformer import abstract_params, declared_groups
    from jaxmoe.port.maps.titan_map import to_titan
    from jaxmoe.train.optim import build_optimizer
    from jaxmoe.train.titan_resume import open_resume

    toml, step, out = titan_ckpt
    res = open_resume(f"dcp:{step}", str(toml))
    assert (res.ts.step, res.ts.count, res.ts.last_epoch, res.ts.ntokens_seen) == (K, K, K, K * 64)
    cfg = load_config(path=toml)
    cfg.optim.lr, cfg.optim.weight_decay = 1.0, 0.0  # fixed from the checkpoint's AdamW group
    res.fix_config(cfg, set())
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.beta2) == (out["param_group"]["initial_lr"], 0.1, 0.95)
    tx = build_optimizer(cfg.optim, cfg.train.steps, abstract_params(cfg)[0], declared_groups(cfg))
    state, start, data = res.initial_state(cfg, tx, None)
    assert start == K and data == {"seek_batch": K} and int(state["step"]) == K
    got = np.load(step.parent / "loaded.npz")
    adam = state["opt_state"][1][0]
    assert int(adam.count) == K
    params = jax.tree.map(np.asarray, state["params"])
    named = to_titan(cfg, params, jax.tree.map(np.asarray, state["buffers"]))
    for name, a in named.items():
        assert np.array_equal(got[name], a), name
    assert any(n.endswith("expert_bias_E") and np.any(a != 0) for n, a in named.items())
    for which, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        for name, a in to_titan(cfg, jax.tree.map(np.asarray, tree), None, with_buffers=False).items():
            assert np.array_equal(got[f"state.{name}.{which}"], a), (which, name)


def test_round_trip_torchtitan_jaxmoe_torchtitan(titan_ckpt, tmp_path, capsys):
    """torchtitan's step K -> ``jaxmoe train --resume-from`` one step (its loss = torchtitan's own
    step K+1 from the same checkpoint) -> ``convert --with-optimizer`` -> torchtitan's
    CheckpointManager restores every weight, moment and AdamW step bit-exact, the param group, the
    scheduler position and the train state, and its step K+2 = jaxmoe's ``--resume`` step K+2."""
    toml, step, first = titan_ckpt
    run = tmp_path / "run"
    assert main(["train", "--resume-from", f"dcp:{step}", "--titan", str(toml), "--config", str(toml),
                 "--out", str(run), "--stop-after", str(K + 1), "--quiet"]) == 0, capsys.readouterr().err
    ours = _losses(run)
    assert list(ours) == [K + 1] and len(first["losses_after"]) == 1
    assert abs(ours[K + 1] - first["losses_after"][0]) <= _tol() * abs(ours[K + 1]), (ours, first)
    # a --resume-from run that lost its checkpoints starts over from its recorded torchtitan step
    lost = tmp_path / "lost"
    shutil.copytree(run, lost)
    shutil.rmtree(lost / "checkpoints")
    assert main(["train", "--resume", "--out", str(lost), "--stop-after", str(K + 1), "--quiet"]) == 0
    assert _losses(lost) == ours and json.loads((lost / "run.json").read_text())["start_step"] == K
    back = tmp_path / "back" / f"step-{K + 1}"
    assert main(["convert", "--from", f"orbax:{run}@{K + 1}", "--to", f"dcp:{back}", "--with-optimizer"]) == 0
    out = _titan(back.parent, toml, LAYERS, K + 1, 1, "resume")
    got = np.load(back.parent / "loaded.npz")
    cfg, params, mu, nu, count = _jaxmoe_state(run, K + 1)
    assert count == K + 1
    for name in params:
        assert np.array_equal(got[name], params[name]), name
        assert np.array_equal(got[f"state.{name}.exp_avg"], mu[name]), name
        assert np.array_equal(got[f"state.{name}.exp_avg_sq"], nu[name]), name
        assert float(got[f"state.{name}.step"]) == K + 1
    assert out["last_epoch"] == K + 1 and out["train_state"] == {"step": K + 1, "ntokens_seen": (K + 1) * 64}
    g = out["param_group"]
    assert (g["initial_lr"], g["betas"], g["eps"], g["weight_decay"]) == (cfg.optim.lr, [0.9, 0.95], 1e-8, 0.1)
    assert g["decoupled_weight_decay"] and not g["amsgrad"]
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0, capsys.readouterr().err
    ours = _losses(run)
    assert sorted(ours) == [K + 1, K + 2]
    assert abs(ours[K + 2] - out["losses_after"][0]) <= _tol() * abs(ours[K + 2]), (ours, out)
    print(f"\nround trip: torchtitan {first['losses_before']} | step {K + 1}: jaxmoe {ours[K + 1]} torchtitan "
          f"{first['losses_after'][0]} | step {K + 2}: jaxmoe {ours[K + 2]} torchtitan {out['losses_after'][0]}")


@pytest.fixture(scope="module")
def jaxmoe_run(tmp_path_factory):
    """(tmp dir, config toml, run dir at step K of K+M, its full dcp: step K)."""
    tmp = tmp_path_factory.mktemp("resume")
    toml = _toml(tmp / "m.toml", LAYERS, K + M)
    run = tmp / "run"
    assert main(["train", "--config", str(toml), "--out", str(run), "--stop-after", str(K), "--quiet"]) == 0
    step = tmp / "titan" / f"step-{K}"
    assert main(["convert", "--from", f"orbax:{run}@{K}", "--to", f"dcp:{step}", "--with-optimizer"]) == 0
    return tmp, toml, run, step


def _jaxmoe_state(run: Path, step: int):
    """(cfg, {torchtitan name: param}, {name: exp_avg}, {name: exp_avg_sq}, AdamW count) of a run's checkpoint."""
    from jaxmoe.checkpoint.orbax_read import LeafSlices, open_array
    from jaxmoe.config import load_config
    from jaxmoe.port.maps.titan_map import to_titan
    from jaxmoe.port.maps.titan_state import orbax_adam_prefix
    from jaxmoe.trees import unflatten

    cfg = load_config(path=run / "config.toml")
    state = run / "checkpoints" / str(step) / "state"
    prefix, _ = orbax_adam_prefix(state, "test")
    shapes = {k: v for k, v in _leaf_keys(cfg)}
    trees = {}
    for part in ("params", "mu", "nu"):
        base = "params" if part == "params" else f"{prefix}/{part}"
        trees[part] = unflatten({k: LeafSlices(open_array(state, f"{base}/{k}"), np.float32)[()] for k in shapes})
    count = int(np.asarray(open_array(state, f"{prefix}/count").read().result()))
    return (cfg, *(to_titan(cfg, trees[p], None, with_buffers=False) for p in ("params", "mu", "nu")), count)


def _leaf_keys(cfg):
    from jaxmoe.port.maps.titan_map import leaf_shapes

    return [(k.split("/", 1)[1], s) for k, s in leaf_shapes(cfg).items() if k.startswith("params/")]


@pytest.mark.slow  # ~80 s here under load: jaxmoe compiles and trains, torchtitan loads and trains
def test_jaxmoe_run_resumes_in_torchtitan(jaxmoe_run, capsys):
    """torchtitan's CheckpointManager restores the written step: every weight, exp_avg, exp_avg_sq
    and AdamW step bit-exact, the param group (lr = the schedule's next value), last_epoch and
    train_state; then torchtitan's M steps match jaxmoe continuing its own run (--resume)."""
    tmp, toml, run, step = jaxmoe_run
    out = _titan(step.parent, toml, LAYERS, K, M, "resume")
    got = np.load(step.parent / "loaded.npz")
    cfg, params, mu, nu, count = _jaxmoe_state(run, K)
    assert count == K and len(params) == sum(n.startswith("state.") and n.endswith(".step") for n in got.files)
    for name in params:
        assert np.array_equal(got[name], params[name]), name
        assert np.array_equal(got[f"state.{name}.exp_avg"], mu[name]), name
        assert np.array_equal(got[f"state.{name}.exp_avg_sq"], nu[name]), name
        assert float(got[f"state.{name}.step"]) == K
    assert all(np.any(a != 0) for a in nu.values())  # moments of a trained run, not zeros
    bias = [n for n in got.files if n.endswith("moe.expert_bias_E")]
    assert bias and all(np.any(got[n] != 0) for n in bias)  # the bias hook moved them in jaxmoe
    assert out["last_epoch"] == K and out["train_state"] == {"step": K, "ntokens_seen": K * 2 * 32}
    g = out["param_group"]
    assert (g["initial_lr"], g["betas"], g["eps"], g["weight_decay"]) == (cfg.optim.lr, [0.9, 0.95], 1e-8, 0.1)
    assert g["lr"] == pytest.approx(cfg.optim.lr * 1.0)  # update K=2: warmup over, stable (titan_wsd)
    assert g["decoupled_weight_decay"] and not g["amsgrad"]
    # jaxmoe continues its own run on the same batches
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0, capsys.readouterr().err
    ours = _losses(run)
    theirs = out["losses_after"]
    assert len(theirs) == M
    print(f"\njaxmoe->torchtitan K={K} M={M}: jaxmoe before {[ours[i] for i in range(1, K + 1)]}; after: "
          f"jaxmoe {[ours[i] for i in range(K + 1, K + M + 1)]} torchtitan {theirs}")
    for i, loss in enumerate(theirs):
        assert abs(ours[K + 1 + i] - loss) <= _tol() * abs(loss), (i, ours, theirs)


def test_resume_from_refusals_are_one_line(titan_ckpt, tmp_path, capsys):
    """--resume-from: a model-only step (suggests --init-from), with --resume / --init-from, another
    model, a schedule that does not give the checkpoint's learning rate, a --set of an AdamW field,
    an optimizer that is not AdamW: one line each, no run directory left."""
    toml, step, _ = titan_ckpt
    out = tmp_path / "o"

    def fails(*args) -> str:
        assert main(["train", *args, "--out", str(out), "--quiet"]) == 2
        assert not out.exists()
        return _one_line(capsys)

    rf = ["--resume-from", f"dcp:{step}", "--titan", str(toml)]
    model_only = tmp_path / "mo"
    assert main(["convert", "--from", f"dcp:{step}", "--titan", str(toml), "--to", f"dcp:{model_only}"]) == 0
    assert "--init-from" in fails("--resume-from", f"dcp:{model_only}", "--titan", str(toml))
    assert "drop --resume" in fails(*rf, "--resume")
    assert "drop --init-from" in fails(*rf, "--init-from", f"dcp:{step}")
    assert "--titan" in fails("--resume-from", f"dcp:{step}")
    assert "dcp:STEP_DIR" in fails("--resume-from", f"orbax:{tmp_path}", "--titan", str(toml))
    wider = _toml(tmp_path / "w.toml", LAYERS + 1, K + M)
    assert "missing tensor layers.2." in fails("--resume-from", f"dcp:{step}", "--titan", str(wider))
    msg = fails(*rf, "--set", "optim.warmup_steps=4")  # update 2 would be at 3/4 of the lr
    assert "next learning rate" in msg and "warmup 4" in msg, msg
    assert "optim.lr=0.001" in fails(*rf, "--set", "optim.lr=0.001")
    assert "pass --steps" in fails(*rf, "--steps", str(K))
    # not AdamW: the state of a parameter holds other fields (our own test checkpoint, rewritten)
    sgd = tmp_path / "sgd"
    shutil.copytree(step, sgd)
    md = pickle.loads((sgd / ".metadata").read_bytes())
    for d in (md.state_dict_metadata, md.planner_data):
        for k in [k for k in d if k.endswith(".exp_avg")]:
            d[k.replace(".exp_avg", ".momentum_buffer")] = d.pop(k)
    for idx in [i for i in md.storage_data if i.fqn.endswith(".exp_avg")]:
        info = md.storage_data.pop(idx)
        md.storage_data[type(idx)(idx.fqn.replace(".exp_avg", ".momentum_buffer"), idx.offset, idx.index)] = info
    (sgd / ".metadata").write_bytes(pickle.dumps(md))
    assert "not AdamW's exp_avg" in fails("--resume-from", f"dcp:{sgd}", "--titan", str(toml))


def test_a_planted_byte_item_is_refused_on_resume(titan_ckpt, tmp_path, capsys):
    """--resume-from reads byte items (lr_scheduler.last_epoch, ...) with the allow-list unpickler:
    a pickle that would create a file is refused, naming the class, and creates nothing."""
    import io
    import zipfile

    import torch.distributed.checkpoint.filesystem as fs

    toml, step, _ = titan_ckpt
    marker = tmp_path / "pwned"

    class Touch:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    forged = tmp_path / "forged"
    shutil.copytree(step, forged)
    md = pickle.loads((forged / ".metadata").read_bytes())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(Touch(), protocol=2))
    with open(forged / "__9_0.distcp", "wb") as f:
        f.write(buf.getvalue())
    idx = next(i for i in md.storage_data if i.fqn == "lr_scheduler.last_epoch")
    md.storage_data[idx] = fs._StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    (forged / ".metadata").write_bytes(pickle.dumps(md))
    rc = main(["train", "--resume-from", f"dcp:{forged}", "--titan", str(toml), "--out", str(tmp_path / "o")])
    msg = _one_line(capsys)
    assert rc == 2 and "lr_scheduler.last_epoch" in msg and "refusing to unpickle" in msg, msg
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_with_optimizer_refusals_are_one_line(titan_ckpt, tmp_path, capsys):
    """--with-optimizer needs a jaxmoe run's AdamW state: a dcp: source (weights only to jaxmoe), a
    run dir holding weights only, a Muon run, a run that decays only some parameters: one line
    each, nothing written."""
    toml, step, _ = titan_ckpt
    dst = tmp_path / "d"
    run = tmp_path / "run"  # a run dir with the weights only (step 0, no optimizer state)
    assert main(["convert", "--from", f"dcp:{step}", "--titan", str(toml), "--to", f"orbax:{run}"]) == 0

    def fails(src: str, *extra) -> str:
        assert main(["convert", "--from", src, *extra, "--to", f"dcp:{dst}", "--with-optimizer"]) == 2
        assert not dst.exists()
        return _one_line(capsys)

    assert "holds no optimizer state" in fails(f"dcp:{step}", "--titan", str(toml))
    assert "holds no optimizer state" in fails(f"orbax:{run}")
    for edit, word in (("optimizer = \"adamw\"", "Muon"), ("decay_norms = true", "every parameter")):
        other = tmp_path / word.replace(" ", "_")
        other.mkdir()
        (other / "checkpoints").symlink_to(run / "checkpoints")
        text = (run / "config.toml").read_text()
        assert edit in text
        repl = edit.replace("adamw", "muon").replace("true", "false")
        (other / "config.toml").write_text(text.replace(edit, repl))
        assert word in fails(f"orbax:{other}")
    assert main(["convert", "--from", f"orbax:{run}", "--to", f"hf:{dst}", "--with-optimizer"]) == 2
    assert "dcp:" in _one_line(capsys) and not dst.exists()


# --------------------------------------------------------------------------------------------
# torchtitan -> jaxmoe
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~1 min here: torchtitan trains 3 + 3 steps, jaxmoe compiles a 3-layer model
def test_torchtitan_run_resumes_in_jaxmoe(tmp_path, capsys):
    """torchtitan trains K=3 steps on jaxmoe's batches and saves (CheckpointManager); torchtitan
    loads that step and trains M=3 more; ``jaxmoe train --resume-from`` continues the same step:
    its M losses match torchtitan's, its first step is K+1 at torchtitan's learning rate, and the
    run record keeps the source and its step / tokens seen."""
    k, m, layers = 3, 3, 3
    toml = _toml(tmp_path / "m.toml", layers, k + m)
    out = _titan(tmp_path / "titan", toml, layers, k, m, "train_save_resume")
    assert len(out["losses_before"]) == k and out["train_state"] == {"step": k, "ntokens_seen": k * 64}
    run = tmp_path / "run"
    assert main(["train", "--resume-from", f"dcp:{tmp_path / 'titan'}/step-{k}", "--titan", str(toml),
                 "--config", str(toml), "--out", str(run), "--quiet"]) == 0, capsys.readouterr().err
    ours = _losses(run)
    assert sorted(ours) == list(range(k + 1, k + m + 1))
    print(f"\ntorchtitan->jaxmoe K={k} M={m}: torchtitan before {out['losses_before']}; after: "
          f"jaxmoe {[ours[i] for i in range(k + 1, k + m + 1)]} torchtitan {out['losses_after']}")
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["lr"] == pytest.approx(out["param_group"]["lr"], rel=1e-6)
    for i, loss in enumerate(out["losses_after"]):
        assert abs(ours[k + 1 + i] - loss) <= _tol() * abs(loss), (i, ours, out["losses_after"])
    rec = json.loads((run / "run.json").read_text())
    assert rec["resume_from"]["step"] == k and rec["resume_from"]["ntokens_seen"] == k * 64
    assert rec["start_step"] == k
