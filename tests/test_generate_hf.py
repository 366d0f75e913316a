"""`jaxmoe generate --greedy` against transformers' own ``generate(do_sample=False)``: tiny random
Qwen3-MoE, Mixtral and DeepSeek-V3 models (the configs of tests/test_hf_reference.py, weights x8
so that logits are decisive), saved with ``save_pretrained`` and read by jaxmoe from the folder.
Two prompts of different lengths in one batch (left-padded on the HF side, with its attention
mask), 32 new tokens: the same tokens, and per-token log-probabilities within 1e-4."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.cli import main

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_reference import MODELS  # noqa: E402 (the tiny HF configs, shared)

NAMES = ("qwen3-norm", "mixtral", "deepseek")
N_NEW = 32
PROMPTS = [np.random.default_rng(1).integers(1, 128, 7), np.random.default_rng(2).integers(1, 128, 4)]
TOL = 1e-4


def _build(name: str, seed: int):
    kind, kwargs, _drop, _scales = MODELS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForCausalLM")(getattr(transformers, kind + "Config")(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _hf_generate(d):
    """transformers' greedy tokens and log-probs [B, N] on PROMPTS, left-padded with a mask."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly N_NEW tokens, as --ignore-eos
    width = max(len(p) for p in PROMPTS)
    ids = np.zeros((len(PROMPTS), width), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    with torch.no_grad():
        out = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[:, width:].numpy()
    logp = torch.log_softmax(torch.stack(out.logits, 1).double(), -1).numpy()
    return toks, np.take_along_axis(logp, toks[..., None], -1)[..., 0]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.npy"
    rows = -np.ones((len(PROMPTS), max(len(p) for p in PROMPTS)), np.int64)  # -1: padding (right)
    for i, p in enumerate(PROMPTS):
        rows[i, :len(p)] = p
    np.save(f, rows)
    return f


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_matches_transformers(name, tmp_path, prompt_file, capsys):
    d = tmp_path / name
    _build(name, seed=NAMES.index(name)).save_pretrained(d)
    ref_toks, ref_lp = _hf_generate(d)
    rc = main(["generate", "--ckpt", f"hf:{d}", "--prompt-tokens", str(prompt_file),
               "--max-new-tokens", str(N_NEW), "--greedy", "--ignore-eos", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"tokens", "logprobs", "text"} and out["text"] == [None, None]  # no tokenizer
    toks, lps = np.array(out["tokens"]), np.array(out["logprobs"])
    assert toks.shape == (len(PROMPTS), N_NEW)
    np.testing.assert_array_equal(toks, ref_toks)
    assert np.abs(lps - ref_lp).max() <= TOL, np.abs(lps - ref_lp).max()
    assert len(set(toks[0].tolist())) > 1  # not a degenerate repetition of one token


def test_text_prompts_use_the_checkpoint_tokenizer(tmp_path, capsys):
    """With a tokenizer.json in the folder, ``--prompt TEXT`` (twice: a batch) gives the tokens of
    the same ids passed as ``--prompt-tokens``, and ``text`` is their decoding; an eos id in
    generation_config.json cuts a row after it."""
    tokenizers = pytest.importorskip("tokenizers")
    d = tmp_path / "qwen3"
    _build("qwen3-norm", seed=0).save_pretrained(d)
    vocab = {f"w{i}": i for i in range(128)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(d / "tokenizer.json"))
    prompts = [" ".join(f"w{i}" for i in p) for p in PROMPTS]
    base = ["generate", "--ckpt", f"hf:{d}", "--max-new-tokens", "8", "--greedy", "--json"]
    assert main(base + ["--ignore-eos", "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out = json.loads(capsys.readouterr().out)
    f = tmp_path / "p.npy"
    rows = -np.ones((2, 7), np.int64)
    for i, p in enumerate(PROMPTS):
        rows[i, :len(p)] = p
    np.save(f, rows)
    assert main(base + ["--ignore-eos", "--prompt-tokens", str(f)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == out["tokens"]
    assert out["text"] == [" ".join(f"w{i}" for i in t) for t in out["tokens"]]
    eos = out["tokens"][0][2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert main(base + ["--prompt-tokens", str(f)]) == 0
    cut = json.loads(capsys.readouterr().out)["tokens"]
    assert cut[0] == out["tokens"][0][: out["tokens"][0].index(eos) + 1]
