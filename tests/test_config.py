import json
import subprocess
import sys

import pytest

from jaxmoe.config import ConfigError, list_presets, load_config
from jaxmoe.config.counting import count_params

PUBLISHED = {
    # name: (total, active, total tolerance, active tolerance)
    "mixtral-8x7b": (46.7e9, 12.9e9, 0.015, 0.03),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.015, 0.03),
    "deepseek-v3-671b": (671e9, 37e9, 0.015, 0.03),
    "kimi-k2": (1.03e12, 32e9, 0.015, 0.03),
    "europa-952b": (951.9e9, 32.8e9, 0.005, 0.005),
}


def test_config_does_not_import_jax():
    code = "import sys, jaxmoe.config; assert 'jax' not in sys.modules, 'config imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_published(name):
    total, active, ttol, atol = PUBLISHED[name]
    c = count_params(load_config(name))
    assert abs(c["total_params"] / total - 1) <= ttol, c["total_params"]
    assert abs(c["active_params"] / active - 1) <= atol, c["active_params"]


def test_all_presets_validate_and_count():
    names = list_presets()
    for required in ("tiny", "tiny-mla", "small", *PUBLISHED):
        assert required in names
    for n in names:
        c = count_params(load_config(n))
        assert 0 < c["active_params"] <= c["total_params"]
    small = count_params(load_config("small"))["total_params"]
    assert 50e6 <= small <= 150e6


def test_tiny_counts_by_hand():
    # tiny: V=256 D=64, 2 MoE layers, GQA H=4 KV=2 hd=16 qk_norm, E=8 I=64 top-2, untied
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16
    expert = 3 * 64 * 64
    layer_total = attn + 2 * 64 + 64 * 8 + 8 * expert
    layer_active = attn + 2 * 64 + 64 * 8 + 2 * expert
    base = 2 * 256 * 64 + 64
    c = count_params(load_config("tiny"))
    assert c["total_params"] == base + 2 * layer_total
    assert c["active_params"] == base + 2 * layer_active


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["moe.top_k=9"], "moe.top_k"),
        (["moe.n_groups=3"], "moe.n_groups"),
        (["moe.n_groups=2", "moe.topk_groups=3"], "moe.topk_groups"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["model.bogus=1"], "model.bogus"),
        (["moe.top_k=two"], "moe.top_k"),
        (["nosection.x=1"], "nosection"),
        (["train.micro_batches=3"], "train.micro_batches"),
        (["model.first_k_dense=5"], "model.first_k_dense"),
        (["moe.compute_path=magic"], "moe.compute_path"),
        (["model.head_dim=15"], "model.head_dim"),
        (["compute.scan_unroll=-1"], "compute.scan_unroll"),
    ],
)
def test_bad_configs_one_line_errors(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=overrides)
    msg = str(err.value)
    assert "\n" not in msg and key in msg


def test_mla_group_checks():
    with pytest.raises(ConfigError, match="moe.top_k"):
        load_config("tiny-mla", overrides=["moe.top_k=5"])  # 2 groups of 2 experts hold only 4
    with pytest.raises(ConfigError, match="model.qk_rope_head_dim"):
        load_config("tiny-mla", overrides=["model.qk_rope_head_dim=7"])


def test_unknown_preset_and_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="not found"):
        load_config(path=tmp_path / "missing.toml")
    f = tmp_path / "c.toml"
    f.write_text('preset = "tiny"\n[moe]\ntop_k = 1\n')
    assert load_config(path=f).moe.top_k == 1
    f.write_text("[moe]\ntop_k = \n")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(path=f)


def test_overrides_are_typed():
    cfg = load_config("tiny", overrides=["optim.lr=0.5", "moe.norm_topk_prob=false", "train.steps=7"])
    assert cfg.optim.lr == 0.5 and cfg.moe.norm_topk_prob is False and cfg.train.steps == 7
    roundtrip = json.loads(cfg.to_json())
    assert roundtrip["train"]["steps"] == 7


def test_old_train_keys_still_work_with_one_notice(tmp_path, capsys):
    """train.* keys that moved to compute/optim/data/checkpoint keep working in --set, in a config
    file and in the dict of a saved run, each with one line of notice per process."""
    from jaxmoe.config import config_from_dict, parse_override
    from jaxmoe.config import load as load_mod
    from jaxmoe.config.schema import MOVED_KEYS

    load_mod._NOTICED.clear()
    cfg = load_config("tiny", overrides=["train.lr=0.25", "train.dtype=bfloat16", "train.data=tokens:x.npy",
                                         "train.checkpoint_every=7", "train.data_workers=2"])
    assert (cfg.optim.lr, cfg.compute.dtype, cfg.data.source, cfg.checkpoint.every, cfg.data.workers) == (
        0.25, "bfloat16", "tokens:x.npy", 7, 2)
    err = capsys.readouterr().err.splitlines()
    assert "note: train.lr is now optim.lr (the old key still works)" in err
    assert "note: train.data is now data.source (the old key still works)" in err
    assert len(err) == 5, err
    load_config("tiny", overrides=["train.lr=0.5"])  # the second use: no new line
    assert capsys.readouterr().err == ""
    f = tmp_path / "old.toml"
    f.write_text('preset = "tiny"\n[train]\nremat = "full"\nkeep_checkpoints = 5\nsteps = 3\n')
    cfg = load_config(path=f)
    assert (cfg.compute.remat, cfg.checkpoint.keep, cfg.train.steps) == ("full", 5, 3)
    assert len(capsys.readouterr().err.splitlines()) == 2
    old = config_from_dict({"train": {"muon_lr": 0.1, "seed": 4}})  # a checkpoint's saved config
    assert (old.optim.muon_lr, old.train.seed) == (0.1, 4)
    assert parse_override("train.grad_clip=2")[:2] == ("optim", "grad_clip")  # --set keys, where they live now
    # every moved key lands on a field that exists, and the new section has no train.* twin
    for (_, k), (s, nk) in MOVED_KEYS.items():
        assert hasattr(getattr(load_config("tiny"), s), nk), (k, s, nk)
        assert not hasattr(load_config("tiny").train, k), k
    with pytest.raises(ConfigError, match="unknown config key train.lrr"):
        load_config("tiny", overrides=["train.lrr=1"])


def test_the_model_reads_no_train_section():
    """The model's modules read compute.* (dtype, kernels, remat), never train.*."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "jaxmoe" / "model"
    bad = [f"{f.name}:{n.lineno}" for f in root.glob("*.py") for n in ast.walk(ast.parse(f.read_text()))
           if isinstance(n, ast.Attribute) and n.attr == "train"]
    assert not bad, bad
