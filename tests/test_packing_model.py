"""Packed documents in the model (issue 28, item 3, the model side): ``segment_ids`` /
``positions`` in a batch keep attention inside each document and give RoPE per-document
positions, in jaxmoe (both attention kernels, GQA and MLA) and in torch_ref.

(a) the mask of a small row, written by hand; (b) a packed row equals each of its documents run
alone in its own row (positions from 0), for the attention kernels and the whole model, jax and
torch_ref; (c) jax vs torch_ref on packed batches: logits, losses and every gradient through the
parity suite (``--packed``); (d) without the keys nothing changes: a batch whose rows are one
document each gives the unpacked results bit for bit, and the unpacked graph holds no segment mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxmoe.config import load_config
from jaxmoe.model.attention import attend, document_mask
from jaxmoe.model.transformer import Model, init_params
from jaxmoe.train.objective import model_loss
from parity.runner import RunOptions, run_suite
from parity.sides import to_hf
from torch_ref.attention import document_mask as torch_document_mask
from torch_ref.transformer import TorchTransformer

torch.backends.cuda.matmul.allow_tf32 = False


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# --------------------------------------------------------------------------------------------
# (a) the mask by hand
# --------------------------------------------------------------------------------------------

# segment_ids [1, 1, 1, 2, 2, 0]: document 1 = tokens 0-2, document 2 = tokens 3-4, token 5 padding.
# Row i lists the keys query i may see: causal and same segment; the padding token sees itself.
HAND_MASK = np.array([
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
    [0, 0, 0, 1, 0, 0],
    [0, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 1],
], bool)


def test_document_mask_by_hand():
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 0, 0]], np.int32)
    got = np.asarray(document_mask(jnp.asarray(seg)))
    np.testing.assert_array_equal(got[0], HAND_MASK)
    # second row: doc 1 = token 0, doc 2 = tokens 1-3, padding = tokens 4-5 (padding sees the
    # padding before it: one more segment, so no softmax row is all -inf)
    row2 = np.array([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], bool)
    np.testing.assert_array_equal(got[1], row2)
    np.testing.assert_array_equal(torch_document_mask(torch.from_numpy(seg).long()).numpy(), got)


def test_attention_kernels_use_the_hand_mask():
    """With v = one-hot of the key position (and equal scores: q = 0), the output row of query i
    is the uniform distribution over the keys it may see: the mask itself, normalised."""
    s = 6
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0]], jnp.int32)
    q = jnp.zeros((1, s, 2, 8))
    k = jax.random.normal(jax.random.key(0), (1, s, 1, 8))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (1, s, 1, s))
    want = HAND_MASK / HAND_MASK.sum(1, keepdims=True)
    for kernel in ("explicit", "dot_product"):
        out = np.asarray(attend(q, k, v, 0.5, kernel, jnp.asarray(seg)))
        for h in range(2):
            np.testing.assert_allclose(out[0, :, h], want, rtol=0, atol=1e-6, err_msg=kernel)


# --------------------------------------------------------------------------------------------
# (b) a packed row == each document alone
# --------------------------------------------------------------------------------------------


def _segments(lengths, s):
    seg, pos = np.zeros(s, np.int32), np.zeros(s, np.int32)
    start = 0
    for i, n in enumerate(lengths):
        seg[start:start + n], pos[start:start + n] = i + 1, np.arange(n)
        start += n
    pos[start:] = np.arange(s - start)
    return seg, pos


def _alone_rows(toks, lengths, s, seed=1):
    """One row per document: the document first (so it starts at position 0), random filler
    after it (causal attention: the filler cannot reach the document's tokens)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, int(toks.max()) + 1, (len(lengths), s)).astype(np.int32)
    start = 0
    for i, n in enumerate(lengths):
        rows[i, :n] = toks[0, start:start + n]
        start += n
    return rows


def test_attend_packed_equals_documents_alone(monkeypatch):
    """Both kernels, the explicit one with its causal query blocks (S=256 in blocks of 128, a
    document across the block edge), GQA head grouping and MLA's unequal q/k and v head dims; a
    segment of the whole row is plain causal attention, bit for bit."""
    from jaxmoe.model import attention

    monkeypatch.setattr(attention, "_Q_BLOCK", 128)
    s_len, lengths = 256, [100, 60, 81]
    seg, _ = _segments(lengths, s_len)
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (1, s_len, 4, 24))
    k = jax.random.normal(ks[1], (1, s_len, 2, 24))
    v = jax.random.normal(ks[2], (1, s_len, 2, 16))
    # row i: document i moved to the front, the rest of the row after it (plain causal attention)
    order = [np.r_[np.arange(a, a + n), np.delete(np.arange(s_len), np.arange(a, a + n))]
             for a, n in zip(np.cumsum([0] + lengths[:-1]), lengths)]
    qa, ka, va = (jnp.concatenate([t[:, o] for o in order]) for t in (q, k, v))
    for kernel in ("explicit", "dot_product"):
        fn = jax.jit(lambda q, k, v, seg=None, kernel=kernel: attend(q, k, v, 0.3, kernel, seg))
        packed = np.asarray(fn(q, k, v, jnp.asarray(seg[None])))
        alone = np.asarray(fn(qa, ka, va))
        assert np.isfinite(packed).all()
        start = 0
        for i, n in enumerate(lengths):
            assert _rel(packed[0, start:start + n], alone[i, :n]) <= 1e-6, (kernel, n)
            start += n
        whole = np.asarray(fn(q, k, v, jnp.ones((1, s_len), jnp.int32)))
        np.testing.assert_array_equal(whole, np.asarray(fn(q, k, v)))


# tiny + dot_product in the slow set (CI time): GQA with the dot_product kernel is covered in CI by the
# attention test above, torch_ref's masking by the MLA case (one attention function) and the
# half-layout RoPE with positions by test_positions_drive_rope
@pytest.mark.parametrize("preset,kernel", [pytest.param("tiny", "dot_product", marks=pytest.mark.slow),
                                           ("tiny-mla", "explicit")])
def test_model_packed_row_equals_documents_alone(preset, kernel):
    """The whole model (RoPE / YaRN from the per-document positions, every layer's attention
    masked, MoE per token): a packed row's logits are those of each document alone at the start
    of its own row (plain causal, positions 0..S-1), in jaxmoe and in torch_ref; jaxmoe's packed logits equal
    torch_ref's; padding gives finite logits. (The other kernel of each preset: the attention test
    above and the parity test below.)"""
    cfg = load_config(preset, overrides=[f"compute.attention_kernel={kernel}"])
    s, lengths = 24, [7, 10, 5]
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (1, s)).astype(np.int32)
    seg, pos = _segments(lengths, s)
    seg, pos = seg[None], pos[None]
    alone_rows = _alone_rows(toks, lengths, s)
    params, buffers = init_params(cfg, 0)
    model = Model(cfg)
    fwd = jax.jit(lambda t, **kw: model(params, buffers, t, **kw)[0])
    # three rows: the packed row, then two more copies (the same shape as the three alone rows)
    packed = np.asarray(fwd(jnp.asarray(np.repeat(toks, 3, 0)), segment_ids=jnp.asarray(np.repeat(seg, 3, 0)),
                            positions=jnp.asarray(np.repeat(pos, 3, 0))))[:1]
    alone = np.asarray(fwd(jnp.asarray(alone_rows)))
    assert np.isfinite(packed).all()

    tm = TorchTransformer(cfg)
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in to_hf(cfg, params, buffers).items()}, strict=False)
    with torch.no_grad():
        tpacked = tm(torch.from_numpy(toks).long(), segment_ids=torch.from_numpy(seg).long(),
                     positions=torch.from_numpy(pos).long())[0].numpy()
        talone = tm(torch.from_numpy(alone_rows).long())[0].numpy()
    assert np.isfinite(tpacked).all()
    assert _rel(packed, tpacked) <= 1e-4
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        assert _rel(packed[0, sl], alone[i, :n]) <= 1e-5, (n, _rel(packed[0, sl], alone[i, :n]))
        assert _rel(tpacked[0, sl], talone[i, :n]) <= 1e-5, (n, _rel(tpacked[0, sl], talone[i, :n]))
        start += n
    # the packing is not a no-op: unpacked, documents 2 and 3 see document 1 and other positions
    with torch.no_grad():
        plain = tm(torch.from_numpy(toks).long())[0].numpy()
    assert _rel(plain[0, 7:22], tpacked[0, 7:22]) > 1e-2


def test_positions_drive_rope():
    """RoPE reads ``positions``: scores depend on relative positions only, so a row at positions
    5..16 gives (nearly) the logits of positions 0..11, and a row whose positions restart at 6
    (one segment: attention still over the whole row) does not."""
    cfg = load_config("tiny")
    params, buffers = init_params(cfg, 0)
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 256, (1, 12)), jnp.int32)
    model = Model(cfg)
    fwd = jax.jit(lambda pos: model(params, buffers, jnp.repeat(toks, 2, 0), positions=pos)[0])
    base = jnp.arange(12, dtype=jnp.int32)
    out = np.asarray(fwd(jnp.stack([base, base + 5])))
    assert _rel(out[1], out[0]) <= 1e-4
    out2 = np.asarray(fwd(jnp.stack([base, jnp.where(base < 6, base, base - 6)])))
    np.testing.assert_array_equal(out2[1, :6], out2[0, :6])
    assert _rel(out2[1, 6:], out2[0, 6:]) > 1e-3


# --------------------------------------------------------------------------------------------
# (c) jax vs torch_ref on a packed batch: every gradient (the parity suite, --packed)
# --------------------------------------------------------------------------------------------


JAX_CACHE: dict = {}  # jaxmoe's weights and forward, shared by the packed parity runs below


@pytest.mark.parametrize("preset", [pytest.param("tiny", marks=pytest.mark.slow), "tiny-mla"])
def test_parity_packed_batch_every_gradient(preset):
    """Logits, every probe, the losses and every parameter's gradient (micro-batch accumulation:
    the training path) of jaxmoe vs torch_ref on a packed batch, at the parity tolerances."""
    rep = run_suite(RunOptions(preset=preset, profile="fast", packed=True, steps=0), jax_cache=JAX_CACHE)
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]][:5]
    names = {n for n, _ in TorchTransformer(load_config(preset), seed=0).named_parameters()}
    grads = {c["name"].split(":", 1)[1] for c in rep["checks"] if c["name"].startswith("grad:")}
    assert grads == names
    assert any(c["name"] == "logits" or c["name"].startswith("logits") for c in rep["checks"])


def test_parity_packed_catches_a_missing_document_mask(monkeypatch):
    """torch_ref attending across documents (plain causal mask) on the packed batch: the suite
    fails, first in layer 0's attention output."""
    import torch_ref.attention as tattn

    def causal_only(seg):
        s = seg.shape[-1]
        return torch.ones(s, s, dtype=torch.bool).tril().expand(seg.shape[0], s, s)

    monkeypatch.setattr(tattn, "document_mask", causal_only)
    rep = run_suite(RunOptions(preset="tiny-mla", profile="fast", packed=True, steps=0), jax_cache=JAX_CACHE,
                    with_grads=False, with_steps=False)
    assert not rep["passed"] and rep["first_divergence"]["name"] == "attn_out[0]", rep["first_divergence"]


def test_parity_packed_batches_hold_documents():
    from parity.runner import build_config
    from parity.sides import make_batches

    cfg = build_config(RunOptions(preset="tiny", profile="fast", packed=True))
    (b,) = make_batches(cfg, 1, 0, packed=True)
    seg, pos, mask = b["segment_ids"], b["positions"], b["mask"]
    assert seg.shape == pos.shape == mask.shape and seg.dtype == pos.dtype == np.int32
    np.testing.assert_array_equal(seg == 0, mask == 0)  # padding is segment 0 and loss-masked
    assert (seg.max(1) >= 2).all()  # every row holds several documents
    for r in range(seg.shape[0]):  # positions restart at 0 at every document start
        starts = np.flatnonzero(np.diff(np.r_[-1, seg[r]]) != 0)
        assert (pos[r, starts] == 0).all()
        assert (np.diff(pos[r])[np.diff(seg[r]) == 0] == 1).all()


def test_packed_flag_rejects_other_references():
    from jaxmoe.errors import UserError

    with pytest.raises(UserError, match="--packed"):
        run_suite(RunOptions(preset="tiny", profile="fast", packed=True, steps=0, reference="hf"))
    with pytest.raises(UserError, match="--steps 0"):  # torchtitan's flex: forward only on CPU
        run_suite(RunOptions(reference="torchtitan", titan="deepseek_v3/debugmodel", packed=True, steps=2))


# --------------------------------------------------------------------------------------------
# (d) without the keys nothing changes
# --------------------------------------------------------------------------------------------


def test_one_document_per_row_is_bitwise_the_unpacked_batch():
    """Rows of one document each (segment 1, positions 0..S-1) give the unpacked batch's loss and
    routing bit for bit in jaxmoe (GQA; the kernels alone: the attention test above) and its logits
    in torch_ref; the unpacked graph (GQA and MLA, both kernels) holds no
    segment mask (windows do not pay for packing: the unpacked jaxpr is the one from before packing
    existed, checked against the parent commit when this was written)."""
    cfg = load_config("tiny", overrides=["train.batch_size=2", "train.seq_len=16"])
    params, buffers = init_params(cfg, 0)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, cfg.model.vocab_size, (2, 17)).astype(np.int32)
    plain = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "mask": jnp.ones((2, 16), jnp.float32)}
    one_doc = {**plain, "segment_ids": jnp.ones((2, 16), jnp.int32),
               "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))}
    masks = ("bool[2,16,16]", "bool[2,1,16,16]", "bool[2,1,1,16,16]")
    loss = jax.jit(lambda x: model_loss(Model(cfg), params, buffers, x))
    (l0, (m0, a0)), (l1, (m1, a1)) = loss(plain), loss(one_doc)
    assert float(l0) == float(l1) and float(m0["ce"]) == float(m1["ce"])
    np.testing.assert_array_equal(np.asarray(a0["router"]["scores"]), np.asarray(a1["router"]["scores"]))
    for preset in ("tiny", "tiny-mla"):
        kp, kb = (params, buffers) if preset == "tiny" else init_params(load_config(preset), 0)
        for kernel in ("explicit", "dot_product"):
            kcfg = load_config(preset, overrides=["train.batch_size=2", "train.seq_len=16",
                                                  f"compute.attention_kernel={kernel}"])
            jp = str(jax.make_jaxpr(lambda x, c=kcfg, p=kp, b=kb: model_loss(Model(c), p, b, x)[0])(plain))
            jd = str(jax.make_jaxpr(lambda x, c=kcfg, p=kp, b=kb: model_loss(Model(c), p, b, x)[0])(one_doc))
            assert not any(m in jp for m in masks) and any(m in jd for m in masks), (preset, kernel)

    tm = TorchTransformer(cfg)
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in to_hf(cfg, params, buffers).items()}, strict=False)
    with torch.no_grad():
        t0 = tm(torch.from_numpy(toks[:, :-1]).long())[0]
        t1 = tm(torch.from_numpy(toks[:, :-1]).long(), segment_ids=torch.ones(2, 16, dtype=torch.long),
                positions=torch.arange(16).expand(2, 16))[0]
    assert torch.equal(t0, t1)


# --------------------------------------------------------------------------------------------
# torchtitan: its flex block-causal forward on a packed batch
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_titan_flex_block_causal_forward_on_packed_batch(monkeypatch):
    """jaxmoe's packed forward (segment_ids + per-document positions) against torchtitan's own
    FlexAttention with its document mask from the same per-document positions (which also drive
    its RoPE): routing, logits, loss within the fp32 tolerances. Control: jaxmoe run without the
    packing keys on the same batch fails (the comparison sees the masking)."""
    pytest.importorskip("torchtitan")
    import parity.sides
    from parity.titan_runner import TITAN_INIT_SCALE

    opts = RunOptions(reference="torchtitan", titan="deepseek_v3/debugmodel", packed=True, steps=0,
                      profile="fast", init_scale=TITAN_INIT_SCALE)
    rep = run_suite(opts)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["passed"], rep["first_divergence"]
    for k in ("logits", "logits_kl", "loss:ce"):
        assert checks[k]["passed"]
    assert sum(k.startswith("routing[") for k in checks) == 5
    assert not any(k.startswith("grad:") for k in checks)  # forward only: flex has no CPU backward

    monkeypatch.setattr(parity.sides, "packing_kwargs", lambda batch: {})  # jaxmoe ignores the documents
    bad = run_suite(opts)
    assert not bad["passed"]
