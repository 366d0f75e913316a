"""The KV cache (jaxmoe.model.decode) against the full forward, for every attention kind of the
presets: GQA with QK-norm (tiny, Qwen3-MoE layout), GQA without (mixtral-tiny), MLA with a
low-rank query and YaRN (tiny-mla, absorbed projections); rows left-padded to a common length;
sampling: hand-made distributions and seeded reproducibility; `jaxmoe generate`'s bad input."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import load_config
from jaxmoe.errors import UserError
from jaxmoe.model.decode import Decoder, bucket, init_cache, sample
from jaxmoe.model.transformer import apply_model, init_params
from jaxmoe.port.commands import generate as gen

PRESETS = ("tiny", "mixtral-tiny", "tiny-mla")
S, P = 12, 5  # sequence, prefill length
TOKENS = np.random.default_rng(0).integers(0, 256, (2, S)).astype(np.int32)


@pytest.fixture(scope="module")
def runs():
    """preset -> (cfg, params, buffers, Decoder, full-forward logits on TOKENS)."""
    out = {}
    for name in PRESETS:
        cfg = load_config(name, overrides=["moe.compute_path=dense"])
        params, buffers = init_params(cfg, 0)
        # weights x4: logits of std ~1, so a wrong cache entry is far past the tolerance
        params = jax.tree.map(lambda w: w * 4.0 if w.ndim >= 2 else w, params)
        full = jax.jit(lambda p, b, t, cfg=cfg: apply_model(cfg, p, b, t)[0])
        out[name] = (cfg, params, buffers, Decoder(cfg), full)
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_each_decode_step_equals_the_full_forward(runs, name):
    cfg, params, buffers, dec, full = runs[name]
    ref = np.asarray(full(params, buffers, jnp.asarray(TOKENS)))
    assert ref.std() > 0.5
    pad = jnp.zeros((2,), jnp.int32)
    cache = init_cache(dec.cfg, 2, 16)
    logits, cache = dec.logits(params, buffers, jnp.asarray(TOKENS[:, :P]), pad, cache, 0)
    got = [np.asarray(logits)]
    for i in range(P, S):  # one token per step, each at its own slot
        logits, cache = dec.logits(params, buffers, jnp.asarray(TOKENS[:, i:i + 1]), pad, cache, i)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), ref, atol=2e-5, rtol=0)
    # the cache holds the expected form: MLA the latent and the rope key, GQA per-KV-head k and v
    leaves = cache["moe"]
    if cfg.model.attention == "mla":
        assert set(leaves) == {"ckv", "krope"} and leaves["ckv"].shape[-1] == cfg.model.kv_lora_rank
    else:
        assert leaves["k"].shape[-2:] == (cfg.model.n_kv_heads, cfg.model.head_dim)


@pytest.mark.parametrize("name", PRESETS)
def test_left_padded_rows_see_their_own_positions(runs, name):
    """Row 1 holds a prompt of S-3 tokens after 3 padding slots: its logits (prefill and the next
    steps) equal the forward of that prompt alone; row 0 (no padding) is untouched."""
    cfg, params, buffers, dec, full = runs[name]
    short = TOKENS[1:, 3:]
    ref_short = np.asarray(full(params, buffers, jnp.asarray(short)))
    ref0 = np.asarray(full(params, buffers, jnp.asarray(TOKENS[:1])))
    t = TOKENS.copy()
    t[1, :3] = 7  # whatever the padding slots hold
    pad = jnp.asarray([0, 3], jnp.int32)
    cache = init_cache(dec.cfg, 2, 16)
    logits, cache = dec.logits(params, buffers, jnp.asarray(t[:, :P + 3]), pad, cache, 0)
    rows1, rows0 = [np.asarray(logits[1, 3:])], [np.asarray(logits[0])]
    for i in range(P + 3, S):
        logits, cache = dec.logits(params, buffers, jnp.asarray(t[:, i:i + 1]), pad, cache, i)
        rows1.append(np.asarray(logits[1]))
        rows0.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(rows1), ref_short[0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(rows0), ref0[0], atol=2e-5, rtol=0)


def test_greedy_generate_follows_the_argmax_of_the_full_forward(runs):
    """Decoder.generate's greedy tokens and log-probs against re-running the full forward on the
    growing sequence (two prompts of different lengths in one batch)."""
    cfg, params, buffers, dec, full = runs["tiny"]
    prompts = [list(TOKENS[0, :7]), list(TOKENS[1, :4])]
    toks, lps = dec.generate(params, buffers, prompts, 6)
    for row, prompt in enumerate(prompts):
        seq = list(prompt) + toks[row].tolist()  # causal: one forward gives every step's logits
        lg = np.asarray(full(params, buffers, jnp.asarray([seq])))[0, len(prompt) - 1:-1].astype(np.float64)
        logp = lg - lg.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        np.testing.assert_array_equal(toks[row], lg.argmax(-1))
        np.testing.assert_allclose(lps[row], np.take_along_axis(logp, toks[row][:, None], -1)[:, 0], atol=1e-5)


def test_seeded_sampling_is_reproducible(runs):
    cfg, params, buffers, dec, _ = runs["tiny"]
    prompts = [list(TOKENS[0, :5]), list(TOKENS[1, :3])]
    kw = dict(greedy=False, temperature=1.5, top_p=0.95, top_k=50)
    a = dec.generate(params, buffers, prompts, 8, seed=3, **kw)
    b = dec.generate(params, buffers, prompts, 8, seed=3, **kw)
    c = dec.generate(params, buffers, prompts, 8, seed=4, **kw)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])  # the seed matters


def test_sample_cuts():
    """probabilities [0.5, 0.3, 0.2]: top_k=1 and top_p <= 0.5 keep token 0 only; top_p=0.6 keeps
    {0, 1}; top_k=2 keeps {0, 1}; top_p=1 draws all three, near their frequencies."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]] * 4000, jnp.float32))
    key = jax.random.key(0)

    def drawn(**kw):
        tok, lp = sample(logits, key, greedy=False, **kw)
        np.testing.assert_allclose(np.asarray(lp), np.log([0.5, 0.3, 0.2])[np.asarray(tok)], rtol=1e-6)
        return np.bincount(np.asarray(tok), minlength=3) / len(tok)

    assert drawn(top_k=1)[0] == 1.0
    assert drawn(top_p=0.5)[0] == 1.0
    f = drawn(top_p=0.6)
    assert f[2] == 0 and abs(f[0] - 0.5 / 0.8) < 0.03
    assert drawn(top_k=2)[2] == 0
    f = drawn(top_p=1.0)
    assert np.all(np.abs(f - [0.5, 0.3, 0.2]) < 0.03)
    assert drawn(temperature=1e-3)[0] == 1.0  # a cold temperature is near-greedy
    tok, _ = sample(logits[:2], key, greedy=True)
    assert np.asarray(tok).tolist() == [0, 0]


def test_bucket():
    assert [bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


def _args(**kw):
    base = dict(ckpt="hf:/x", prompt=None, prompt_tokens=None, max_new_tokens=4, greedy=False,
                temperature=None, top_p=None, top_k=None, seed=None, ignore_eos=False, json=False, mesh=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw,needle", [
    (dict(top_p=0.0), "--top-p 0 is outside (0, 1]"),
    (dict(top_p=1.5), "--top-p 1.5 is outside (0, 1]"),
    (dict(temperature=0.0), "--temperature 0"),
    (dict(top_k=-1), "--top-k -1"),
    (dict(greedy=True, top_p=0.9), "--greedy takes no sampling flags (--top-p)"),
    (dict(max_new_tokens=0), "--max-new-tokens 0"),
])
def test_bad_sampling_flags(kw, needle):
    with pytest.raises(UserError, match=None) as e:
        gen.sampling_options(_args(**kw))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_prompts(runs, tmp_path):
    cfg = runs["tiny"][0]
    with pytest.raises(UserError, match="needs a tokenizer") as e:
        gen.read_prompts(_args(prompt=["hello"]), None)
    assert "--prompt-tokens" in str(e.value)
    with pytest.raises(UserError, match="longer than the model's context"):
        gen.check_prompts([np.zeros(cfg.model.max_seq_len + 1, np.int32)], cfg, 1)
    with pytest.raises(UserError, match="lower --max-new-tokens"):
        gen.check_prompts([np.zeros(cfg.model.max_seq_len - 2, np.int32)], cfg, 3)
    with pytest.raises(UserError, match="outside the vocabulary"):
        gen.check_prompts([np.array([1, 256], np.int32)], cfg, 1)
    f = tmp_path / "p.npy"
    np.save(f, np.array([[1, 2, 3], [4, 5, -1]]))  # negative ids: padding, removed
    got = gen.read_prompts(_args(prompt_tokens=str(f)), None)
    assert [p.tolist() for p in got] == [[1, 2, 3], [4, 5]]
    np.save(f, np.array([1.0, 2.0]))
    with pytest.raises(UserError, match="expected int ids"):
        gen.read_prompts(_args(prompt_tokens=str(f)), None)


def test_cut_at_eos():
    t, lp = gen.cut_at_eos(np.array([[5, 2, 7], [1, 1, 1]]), np.zeros((2, 3)), {2})
    assert t == [[5, 2], [1, 1, 1]] and [len(x) for x in lp] == [2, 3]


def test_generate_on_a_mesh_equals_one_device(runs):
    """`--mesh expert=4,replica=-1` (8 devices: experts sharded 4 ways, the trainer's dispatcher):
    the same greedy tokens and log-probs as one device, for a batch of 3 (filled up to 8 rows)."""
    cfg, params, buffers, dec, _ = runs["tiny"]
    prompts = [TOKENS[0, :7], TOKENS[1, :4], TOKENS[1, 2:9]]
    opts = dict(greedy=True)
    one = gen.generate(cfg, params, buffers, prompts, 5, opts)
    blocked = cfg.replace(moe=dataclasses.replace(cfg.moe, compute_path="blocked"))  # a path with a mesh form
    mesh = gen.generate(blocked, params, buffers, prompts, 5, opts, mesh="expert=4,replica=-1")
    assert mesh[0].shape == (3, 5)
    np.testing.assert_array_equal(mesh[0], one[0])
    np.testing.assert_allclose(mesh[1], one[1], atol=1e-5)
