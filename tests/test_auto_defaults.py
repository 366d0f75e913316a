"""`auto` config values (jaxmoe.config.autoconf): the resolution table per backend and shape, explicit
values left alone, and what ran recorded in the run directory."""

import json
import tomllib

import pytest

from jaxmoe.cli import main
from jaxmoe.config import ConfigError, autoconf, config_to_toml, load_config
from jaxmoe.config.autoconf import auto_choices, resolve_auto


def _cfg(*sets, preset="tiny"):
    return load_config(preset, overrides=list(sets))


# bench/train_step.py's shape: 8 x 256 = 2048 tokens x vocab 8192 = 2^24 logits (the threshold),
# 4 layers; the tiny preset sets moe.compute_path=blocked, so it is set back to auto here
BENCH = ("moe.compute_path=auto", "train.batch_size=8", "train.seq_len=256", "model.max_seq_len=256",
         "model.vocab_size=8192", "model.n_layers=4", "model.first_k_dense=0")


@pytest.mark.parametrize("backend, path, attn, unroll", [
    ("cpu", "blocked", "explicit", 0), ("cuda", "blocked", "dot_product", 1), ("gpu", "blocked", "dot_product", 1),
    ("rocm", "blocked", "dot_product", 1), ("tpu", "ragged", "explicit", 1), ("METAL", "blocked", "explicit", 0),
])
def test_resolution_table_per_backend(backend, path, attn, unroll, monkeypatch):
    cfg = _cfg(*BENCH)
    assert (cfg.moe.compute_path, cfg.compute.attention_kernel, cfg.compute.scan_unroll,
            cfg.compute.ce_chunk_tokens) == ("auto", "auto", "auto", "auto")
    monkeypatch.setattr(autoconf, "tokamax_importable", lambda: False)  # the core install
    want = {"moe.compute_path": path, "moe.ragged_kernel": "xla", "compute.attention_kernel": attn,
            "compute.scan_unroll": unroll, "compute.ce_chunk_tokens": 1024}
    assert auto_choices(cfg, backend) == want
    got = resolve_auto(cfg, backend)
    assert (got.moe.compute_path, got.compute.attention_kernel, got.compute.scan_unroll,
            got.compute.ce_chunk_tokens) == (path, attn, unroll, 1024)
    assert cfg.moe.compute_path == "auto"  # the asked config is not mutated
    import jax  # backend=None asks jax

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert auto_choices(cfg) == want


@pytest.mark.parametrize("sets, unroll, chunk", [
    (("model.vocab_size=8191",), 0, 0),  # 2048 x 8191 logits < 2^24: whole
    (("train.micro_batches=2",), 0, 0),  # 1024 tokens per micro-batch: not more than one chunk
    (("train.batch_size=16", "train.micro_batches=2"), 0, 1024),  # 2048 per micro-batch
    (("model.n_layers=8",), 0, 1024),  # the deepest unrolled stack
    (("model.n_layers=9",), 1, 1024),  # deeper: the rolled scan
    (("model.n_layers=9", "model.first_k_dense=1", "model.dense_ffn_dim=64"), 0, 1024),  # stacks 1 + 8
    (("model.n_layers=17", "model.first_k_dense=9", "model.dense_ffn_dim=64"), 1, 1024),  # 9 + 8
])
def test_resolution_by_shape(sets, unroll, chunk):
    got = auto_choices(_cfg(*BENCH, *sets), "cpu")
    assert (got["compute.scan_unroll"], got["compute.ce_chunk_tokens"]) == (unroll, chunk)


def test_explicit_values_untouched(monkeypatch):
    cfg = _cfg("moe.compute_path=dense", "moe.ragged_kernel=xla", "compute.attention_kernel=dot_product",
               "compute.scan_unroll=2",
               "compute.ce_chunk_tokens=512")
    for backend in ("cpu", "cuda", "tpu"):
        assert auto_choices(cfg, backend) == {}
        assert resolve_auto(cfg, backend) is cfg  # the very object: nothing to resolve
    tiny = _cfg()  # the preset sets moe.compute_path=blocked: kept on TPU, where auto is ragged
    assert tiny.moe.compute_path == "blocked" and "moe.compute_path" not in auto_choices(tiny, "tpu")
    assert resolve_auto(tiny, "tpu").moe.compute_path == "blocked"
    # ragged_kernel=mosaic_gpu applies to the ragged path: auto picks it, on any backend
    m = _cfg("moe.compute_path=auto", "moe.ragged_kernel=mosaic_gpu", "compute.dtype=bfloat16",
             "model.d_model=64", "moe.expert_ffn_dim=64")
    assert auto_choices(m, "cuda")["moe.compute_path"] == "ragged"
    # moe.ragged_kernel=auto: tokamax on GPU when it is installed, else xla; compute_path stays blocked
    t = _cfg("moe.compute_path=auto")
    for found, want in ((True, "tokamax"), (False, "xla")):
        monkeypatch.setattr(autoconf, "tokamax_importable", lambda found=found: found)
        got = auto_choices(t, "cuda")
        assert got["moe.ragged_kernel"] == want and got["moe.compute_path"] == "blocked", got
        assert auto_choices(t, "cpu")["moe.ragged_kernel"] == "xla"
        assert auto_choices(t, "tpu")["moe.ragged_kernel"] == "xla"
    tk = _cfg("moe.compute_path=auto", "moe.ragged_kernel=tokamax")
    assert auto_choices(tk, "cuda")["moe.compute_path"] == "ragged"


def test_auto_parsing_and_errors():
    cfg = _cfg("compute.scan_unroll=3", "compute.ce_chunk_tokens=auto")
    assert (cfg.compute.scan_unroll, cfg.compute.ce_chunk_tokens) == (3, "auto")
    back = tomllib.loads(config_to_toml(cfg))["compute"]
    assert (back["scan_unroll"], back["ce_chunk_tokens"]) == (3, "auto")
    for bad, key in (("compute.scan_unroll=fast", "compute.scan_unroll"),
                     ("compute.ce_chunk_tokens=-1", "ce_chunk_tokens"),
                     ("moe.compute_path=fastest", "moe.compute_path")):
        with pytest.raises(ConfigError, match=key):
            _cfg(bad)


def test_gpu_reason_printed_once(monkeypatch, capsys):
    monkeypatch.setattr(autoconf, "_said", set())
    cfg = _cfg(*BENCH)
    for _ in range(2):
        assert resolve_auto(cfg, "cuda").moe.compute_path == "blocked"
    assert capsys.readouterr().err.count("mosaic_gpu") == 1
    resolve_auto(cfg, "cpu")
    assert "mosaic_gpu" not in capsys.readouterr().err


def test_model_resolves_and_run_dir_records(tmp_path, capsys):
    from jaxmoe.model.transformer import Model

    cfg = _cfg("moe.compute_path=auto")
    assert Model(cfg).cfg.moe.compute_path == "blocked"  # this CPU backend's value
    out = tmp_path / "run"
    # --stop-after 0: the run is set up and recorded, no step is compiled (the test stays cheap)
    assert main(["train", "--preset", "tiny", "--steps", "1", "--stop-after", "0",
                 "--set", "moe.compute_path=auto", "--out", str(out)]) == 0
    rec = json.loads((out / "run.json").read_text())
    assert rec["resolved"] == {"backend": "cpu", "moe.compute_path": "blocked", "moe.ragged_kernel": "xla",
                               "compute.attention_kernel": "explicit", "compute.scan_unroll": 0,
                               "compute.ce_chunk_tokens": 0}
    saved = tomllib.loads((out / "config.toml").read_text())  # the asked config: auto stays auto
    assert saved["moe"]["compute_path"] == "auto" and saved["compute"]["scan_unroll"] == "auto"
    assert "auto (cpu): moe.compute_path=blocked" in capsys.readouterr().err
