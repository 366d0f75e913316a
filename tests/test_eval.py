"""`jaxmoe eval` against transformers' own loss: tiny random Qwen3-MoE and DeepSeek-V3 models (the
configs of tests/test_hf_reference.py, weights x8) saved with ``save_pretrained``, a ``tokens:``
file, the held-out windows the data pipeline serves: jaxmoe's CE equals the mean of
``model(input_ids=window, labels=window).loss`` within 1e-5 relative; ppl = exp(ce); expert load
per MoE layer sums to the routed tokens; bad flags get one line."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from jaxmoe.cli import main
from jaxmoe.errors import UserError
from jaxmoe.train.eval_cli import eval_config, expert_load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_generate_hf import _build  # noqa: E402 (the tiny HF models, shared)

S, B, N_BATCHES = 32, 2, 2


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("evaldata") / "ids.npy"
    np.save(f, np.random.default_rng(5).integers(0, 128, 5000).astype(np.uint16))
    return f


def _hf_ce(d, cfg):
    """transformers' mean loss over the first N_BATCHES batches the pipeline serves for ``cfg``."""
    from jaxmoe.data import make_data

    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    data = make_data(cfg, "eval", workers=0)
    losses = []
    for _ in range(N_BATCHES):
        b = data.next_batch()
        assert b["mask"].all()
        window = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1).astype(np.int64)
        np.testing.assert_array_equal(window[:, 1:], b["targets"])
        with torch.no_grad():
            ids = torch.from_numpy(window)
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    data.close()
    return float(np.mean(losses))


def _args(**kw):
    base = dict(data="default", tokens=S * B * N_BATCHES, split="eval", seq_len=S, batch_size=B,
                packing="windows", doc_sep_id=-1, tokenizer=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("name", ["qwen3-norm", "deepseek"])
def test_eval_ce_equals_transformers_loss(name, tmp_path, tokens_file, capsys):
    from jaxmoe.port.formats import open_source, parse_endpoint

    d = tmp_path / name
    _build(name, seed=3).save_pretrained(d)
    with open_source(parse_endpoint(f"hf:{d}")) as src:
        cfg = eval_config(src.cfg, _args(data=f"tokens:{tokens_file}"))
    ref = _hf_ce(d, cfg)
    rc = main(["eval", "--ckpt", f"hf:{d}", "--data", f"tokens:{tokens_file}", "--tokens", str(S * B * N_BATCHES),
               "--seq-len", str(S), "--batch-size", str(B), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"ce", "ppl", "tokens", "expert_load"}
    assert out["tokens"] == S * B * N_BATCHES
    assert abs(out["ce"] - ref) <= 1e-5 * ref, (out["ce"], ref)
    assert out["ppl"] == pytest.approx(math.exp(out["ce"]), rel=1e-12)
    load = out["expert_load"]
    top_k = cfg.moe.top_k
    assert load["layers"] == list(range(cfg.model.first_k_dense, cfg.model.n_layers))
    assert all(sum(c) == S * B * N_BATCHES * top_k for c in load["counts"])  # every routed token


def test_expert_load_table():
    cfg = argparse.Namespace(model=argparse.Namespace(first_k_dense=1))
    load = expert_load(cfg, np.array([[3, 1, 0, 0], [1, 1, 1, 1]]))
    assert load["layers"] == [1, 2] and load["dead"] == [[1, 2], [1, 3]]
    assert load["max_over_mean"] == [3.0, 1.0] and load["fraction"][0] == [0.75, 0.25, 0.0, 0.0]


def test_bad_eval_flags():
    from jaxmoe.config import load_config

    cfg = load_config("tiny")
    with pytest.raises(UserError, match="exceeds the model's context"):
        eval_config(cfg, _args(seq_len=cfg.model.max_seq_len + 1))
    with pytest.raises(UserError, match=">= 1"):
        eval_config(cfg, _args(tokens=0))
