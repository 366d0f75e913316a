"""``jaxmoe train --init-from``: fine-tune a HuggingFace checkpoint, then convert it back.

The reference is transformers itself: a tiny ``Qwen3MoeForCausalLM`` made here (weights x8 so the
loss is far from uniform), saved with token ids, a generation config and tokenizer files.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.cli import main
from jaxmoe.config import load_config
from jaxmoe.config.hf import to_hf_config
from jaxmoe.data import make_data

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NO_AUX = ["--set", "moe.lb_coef=0", "--set", "moe.router_z_coef=0", "--set", "moe.seq_aux_coef=0"]
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
TOKENIZER = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}, "note": "for the test"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("initfrom") / "hf"
    hcfg_d = {**to_hf_config(load_config("tiny")), **TOKEN_IDS}
    hcfg = transformers.Qwen3MoeConfig.from_dict(hcfg_d)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    model.generation_config = transformers.GenerationConfig(**TOKEN_IDS, max_new_tokens=7)
    model.save_pretrained(str(d))
    (d / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return d


def _hf_loss(d, block: np.ndarray) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.from_numpy(block.astype(np.int64))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _hf_logits(d, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_finetune_hf_checkpoint_and_convert_back(hf_dir, tmp_path, capsys):
    from jaxmoe.port.commands.verify import jax_side
    from jaxmoe.port.formats import parse_endpoint

    run = tmp_path / "run"
    rc = main(["train", "--init-from", f"hf:{hf_dir}", "--steps", "8", "--out", str(run),
               "--quiet", *NO_AUX])
    assert rc == 0, capsys.readouterr().err[-2000:]
    cfg = load_config(path=run / "config.toml")
    assert cfg.model.hf_arch == "qwen3_moe" or "qwen3" in cfg.model.hf_arch.lower()

    # step 1's loss is HF's loss on the same batch (params before the first update)
    batch = make_data(cfg, "train").next_batch()
    block = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    rows = _metrics(run)
    first = rows[0]
    assert first["step"] == 1
    ref = _hf_loss(hf_dir, block)
    assert abs(first["loss"] - ref) <= 1e-5 * abs(ref), (first["loss"], ref)
    assert rows[-1]["loss"] < first["loss"]  # it trains

    rec = json.loads((run / "run.json").read_text())["init_from"]
    assert rec["source"] == f"hf:{hf_dir.absolute()}" and rec["fingerprint"].startswith("sha256:")

    # back to HF: transformers loads it, with jaxmoe's logits and the original metadata
    back = tmp_path / "back"
    assert main(["convert", "--from", f"orbax:{run}", "--to", f"hf:{back}"]) == 0
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
    ours, _ = jax_side(parse_endpoint(f"orbax:{run}"), tokens)
    theirs = _hf_logits(back, tokens)
    assert np.abs(ours - theirs).max() <= 1e-4
    assert np.abs(theirs - _hf_logits(hf_dir, tokens)).max() > 1e-3  # the weights did change
    out_cfg = json.loads((back / "config.json").read_text())
    for k, v in TOKEN_IDS.items():
        assert out_cfg[k] == v, k
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name


def test_hf_orbax_hf_carries_metadata(hf_dir, tmp_path):
    assert main(["convert", "--from", f"hf:{hf_dir}", "--to", f"orbax:{tmp_path}/run"]) == 0
    assert (tmp_path / "run" / "hf_meta" / "tokenizer.json").is_file()
    assert main(["convert", "--from", f"orbax:{tmp_path}/run", "--to", f"hf:{tmp_path}/hf"]) == 0
    out = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: out.get(k) for k in TOKEN_IDS} == TOKEN_IDS
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert not list((tmp_path / "hf").glob("hf_meta*"))


@pytest.mark.parametrize("extra, needle", [
    (["--set", "moe.expert_ffn_dim=32"], "moe/experts/"),
    (["--set", "model.d_model=32"], "[256, 32]"),
])
def test_shape_changing_override_is_one_line(hf_dir, tmp_path, capsys, extra, needle):
    rc = main(["train", "--init-from", f"hf:{hf_dir}", "--steps", "2", "--out",
               str(tmp_path / "r"), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert needle in err and "source" in err, err
    assert not (tmp_path / "r").exists()


def test_orbax_missing_step_is_one_line(hf_dir, tmp_path, capsys):
    assert main(["convert", "--from", f"hf:{hf_dir}", "--to", f"orbax:{tmp_path}/run"]) == 0
    capsys.readouterr()
    rc = main(["train", "--init-from", f"orbax:{tmp_path}/run@7", "--steps", "2", "--out",
               str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "no checkpoint at step 7" in err and len(err.splitlines()) == 1, err


def test_run_that_never_saved_restarts_from_its_recorded_source(hf_dir, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    run = tmp_path / "run"
    args = ["train", "--init-from", f"hf:{src}", "--steps", "8", "--out", str(run), "--quiet",
            *NO_AUX]
    assert main([*args, "--stop-after", "0"]) == 0  # recorded, never saved
    rec = json.loads((run / "run.json").read_text())["init_from"]
    assert rec["source"] == f"hf:{src.absolute()}"
    assert (run / "hf_meta" / "tokenizer.json").is_file()
    assert main(["train", "--resume", "--out", str(run), "--stop-after", "1", "--quiet"]) == 0
    cfg = load_config(path=run / "config.toml")
    batch = make_data(cfg, "train").next_batch()
    block = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    ref = _hf_loss(src, block)
    assert abs(_metrics(run)[0]["loss"] - ref) <= 1e-5 * abs(ref)

    # a source that changed since is refused (one line), not silently mixed in
    run2 = tmp_path / "run2"
    assert main(["train", "--init-from", f"hf:{src}", "--steps", "8", "--out", str(run2),
                 "--stop-after", "0", "--quiet", *NO_AUX]) == 0
    (src / "config.json").write_text((src / "config.json").read_text() + " ")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run2), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "changed" in err, err
