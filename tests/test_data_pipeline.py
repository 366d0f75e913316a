"""jaxmoe.data's Grain pipeline: packing (hand-computed), documents mode, host sharding, mixtures,
resume exactness with worker processes (batches and a stopped-and-resumed `jaxmoe train`), and the
bad-input table (one line each, nothing written)."""

import json
from pathlib import Path

import grain
import numpy as np
import pytest

from jaxmoe.cli import main as cli_main
from jaxmoe.config import load_config
from jaxmoe.data import make_data
from jaxmoe.data.packing import pack
from jaxmoe.errors import ConfigError, UserError

KEYS = ("inputs", "targets", "mask", "segment_ids", "positions")


def cfg_for(data, **train):
    sets = [f"data.source={data}", "train.seq_len=16", "train.batch_size=4", "model.vocab_size=512"]
    return load_config("tiny", overrides=sets + [f"train.{k}={v}" for k, v in train.items()])


def take(src, n):
    return [src.next_batch() for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory):
    """60 documents separated by 0: document i is (i + 1) repeated 3 + (5 * i) % 21 times, then 0."""
    d = tmp_path_factory.mktemp("docs")
    toks = np.concatenate([np.r_[np.full(3 + (5 * i) % 21, i + 1), 0] for i in range(60)])
    np.save(d / "docs.npy", toks.astype(np.uint16))
    np.save(d / "hi.npy", (np.arange(4000) % 100 + 100).astype(np.uint16))  # ids 100..199
    np.save(d / "lo.npy", (np.arange(4000) % 100).astype(np.uint16))  # ids 0..99
    return d


@pytest.mark.parametrize("mask_doc_start", [False, True])
def test_first_fit_packing_hand_computed(mask_doc_start):
    docs = [np.array([1, 2, 3, 4, 5], np.int32), np.array([6, 7, 8], np.int32),
            np.arange(10, 20, dtype=np.int32)]
    rows = list(pack(grain.MapDataset.source(docs).to_iter_dataset(), 6, 2, mask_doc_start, 0))
    # pieces: d1 4 pairs, d2 2 pairs, d3 6 + 3 pairs; first-fit into 2 rows of 6: [d1 d2] [d3a],
    # then d3b fits no open row: those two are emitted and d3b opens the next set
    want = [
        dict(inputs=[1, 2, 3, 4, 6, 7], targets=[2, 3, 4, 5, 7, 8], segment_ids=[1, 1, 1, 1, 2, 2],
             positions=[0, 1, 2, 3, 0, 1], mask=[0, 1, 1, 1, 0, 1] if mask_doc_start else [1] * 6),
        dict(inputs=[10, 11, 12, 13, 14, 15], targets=[11, 12, 13, 14, 15, 16], segment_ids=[1] * 6,
             positions=[0, 1, 2, 3, 4, 5], mask=[0, 1, 1, 1, 1, 1] if mask_doc_start else [1] * 6),
        dict(inputs=[16, 17, 18, 0, 0, 0], targets=[17, 18, 19, 0, 0, 0], segment_ids=[1, 1, 1, 0, 0, 0],
             positions=[0, 1, 2, 0, 0, 0], mask=[1, 1, 1, 0, 0, 0]),  # a continuation keeps its first target
    ]
    assert len(rows) == 3
    for got, w in zip(rows, want):
        for k in KEYS:
            np.testing.assert_array_equal(got[k], w[k], err_msg=k)
        assert got["inputs"].dtype == np.int32 and got["mask"].dtype == np.float32
        assert got["segment_ids"].dtype == np.int32 and got["positions"].dtype == np.int32


def test_documents_batches_are_documents(docs_file):
    src = make_data(cfg_for(f"tokens:{docs_file}/docs.npy", packing="documents", doc_sep_id=0))
    for b in take(src, 4):
        assert set(b) == set(KEYS) and b["inputs"].shape == (4, 16)
        seg, pos, inp, tgt = b["segment_ids"], b["positions"], b["inputs"], b["targets"]
        np.testing.assert_array_equal(b["mask"], (seg > 0).astype(np.float32))
        for r in range(4):
            for s in set(seg[r][seg[r] > 0].tolist()):
                idx = np.flatnonzero(seg[r] == s)
                np.testing.assert_array_equal(pos[r, idx], np.arange(len(idx)))  # restart at 0
                doc = inp[r, idx[0]]
                assert (inp[r, idx] == doc).all()  # one document per segment
                assert (tgt[r, idx[:-1]] == doc).all() and tgt[r, idx[-1]] in (doc, 0)  # ... ends in its separator


def test_documents_host_sharding_splits_the_documents(docs_file):
    cfg = cfg_for(f"tokens:{docs_file}/docs.npy", packing="documents", doc_sep_id=0)

    def docs_of(pidx, count, n):
        return [set(b["inputs"][b["segment_ids"] > 0].tolist()) for b in take(
            make_data(cfg, process_index=pidx, process_count=count), n)]

    p0, p1 = docs_of(0, 2, 3), docs_of(1, 2, 3)
    one = set().union(*docs_of(0, 1, 6))
    assert p0[0].isdisjoint(p1[0])  # the first batch of each: its own documents (epoch 1)
    assert len(set().union(*p0) | set().union(*p1)) > 10
    ev = set().union(*[set(b["inputs"][b["segment_ids"] > 0].tolist())
                       for b in take(make_data(cfg, "eval"), 3)])
    assert ev == {59, 60} and not ev & one  # eval: the last ceil(60 / 50) = 2 documents, held out


def test_mixture_proportions_tokens_and_resume(docs_file):
    cfg = cfg_for(f"mix:3*tokens:{docs_file}/lo.npy,1*tokens:{docs_file}/hi.npy")
    src = make_data(cfg)
    rows = np.concatenate([b["inputs"] for b in take(src, 8)])
    hi = (rows >= 100).all(axis=1)
    assert (hi | (rows < 100).all(axis=1)).all() and hi.sum() == 8  # exactly 24 : 8 rows
    st = json.loads(json.dumps(src.state()))
    assert st["tokens"] == {f"tokens:{docs_file}/lo.npy": 24 * 16, f"tokens:{docs_file}/hi.npy": 8 * 16}
    nxt = take(src, 3)
    again = make_data(cfg)
    again.restore(st)
    assert same(take(again, 3), nxt) and again.state()["tokens"] == src.state()["tokens"]
    assert same(take(make_data(cfg), 4), take(make_data(cfg), 4))  # deterministic


@pytest.mark.parametrize("data,train", [
    ("tokens:{d}/docs.npy", dict(packing="documents", doc_sep_id=0)),
    pytest.param("mix:1*tokens:{d}/lo.npy,1*tokens:{d}/docs.npy", {}, marks=pytest.mark.slow),
    pytest.param("default", {}, marks=pytest.mark.slow),
])
def test_resume_exact_with_two_workers(docs_file, data, train):
    data = data.format(d=docs_file)
    cfg = cfg_for(data, data_workers=2, **train)
    src = make_data(cfg)
    first = take(src, 3)
    st = json.loads(json.dumps(src.state()))
    expected = take(src, 4)
    src.close()
    again = make_data(cfg)
    again.restore(st)
    got = take(again, 4)
    again.close()
    assert same(got, expected)
    other = make_data(cfg_for(data, data_workers=0, **train))
    if data != "default":
        with pytest.raises(UserError, match="data_workers: saved 2 vs now 0"):
            other.restore(st)
    else:  # a single flat stream: batches made whole before the workers; any worker count resumes
        assert same(take(make_data(cfg_for(data)), 7), first + expected)
        other.restore(st)
        assert same(take(other, 4), expected)


def test_flat_windows_position_moves_between_process_counts():
    """A single flat stream's position is the batch count: a 2-process checkpoint resumes in 1."""
    one = make_data(cfg_for("default"))
    take(one, 2)
    states = []
    for i in range(2):
        p = make_data(cfg_for("default"), process_index=i, process_count=2)
        take(p, 2)
        states.append(json.loads(json.dumps(p.state())))
    resumed = make_data(cfg_for("default"))
    resumed.restore({"processes": states})
    assert same(take(resumed, 2), take(one, 2))


def test_read_time_vocab_check_names_the_document(monkeypatch):
    import jaxmoe.data.pipeline as pipeline

    class Docs:  # a document source of ids whose largest id is not known up front
        name, text, stream, max_id = "fake:docs", False, None, None

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return np.array([1, 2, 999 if i == 3 else 3, 4], np.int32)

    monkeypatch.setattr(pipeline, "open_source", lambda spec, doc_sep=None: Docs())
    src = make_data(cfg_for("fake:docs", packing="documents", seed=1))
    with pytest.raises(UserError, match="fake:docs: document 3 has token id 999 but model.vocab_size=512"):
        take(src, 3)


def _bad(tmp):
    np.arange(300, dtype=np.uint16).tofile(tmp / "big.bin")
    return [
        ([f"data.source=tokens:{tmp}/big.bin", "model.vocab_size=256"], "token id 299 but model.vocab_size=256"),
        ([f"data.source=mix:0*default,1*tokens:{tmp}/big.bin"], "weight 0 of default must be > 0"),
        (["data.source=mix:-1*default"], "must be > 0"),
        (["data.source=mix:0.5default"], "is not WEIGHT*SPEC"),
        (["data.source=mix:x*default"], "is not a number"),
        (["data.source=mix:1*default,1*default"], "twice"),
        (["data.packing=rows"], "data.packing"),
        ([f"data.source=tokens:{tmp}/big.bin", "data.packing=documents"], "set data.doc_sep_id"),
        (["data.workers=-1"], "data.workers=-1 must be >= 0"),
        (["data.mask_doc_start=true"], "needs data.packing=documents"),
    ]


def test_bad_input_table(tmp_path, capsys):
    for sets, msg in _bad(tmp_path):
        out = tmp_path / "run"
        args = ["train", "--quiet", "--preset", "tiny", "--steps", "1", "--out", str(out)]
        for s in sets:
            args += ["--set", s]
        assert cli_main(args) == 2, sets
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, (sets, err)
        assert not out.exists(), sets
        try:  # the same through the Python API: one UserError / ConfigError line
            make_data(load_config("tiny", overrides=sets))
        except (UserError, ConfigError) as e:
            assert msg in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(f"{sets} was accepted")


@pytest.mark.slow
def test_train_stopped_and_resumed_equals_uninterrupted_with_workers(tmp_path, docs_file):
    common = ["--preset", "tiny", "--set", "train.batch_size=4", "--set", "train.seq_len=16",
              "--set", f"data.source=mix:1*tokens:{docs_file}/lo.npy,1*tokens:{docs_file}/docs.npy",
              "--set", "data.workers=2", "--set", "train.eval_every=0", "--steps", "6",
              "--checkpoint-every", "3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli_main(["train", "--quiet", *common, "--out", str(full)]) == 0
    assert cli_main(["train", "--quiet", *common, "--stop-after", "3", "--out", str(part)]) == 0
    assert cli_main(["train", "--quiet", *common, "--resume", "--out", str(part)]) == 0
    rows = lambda d: [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["loss"] for r in rows(part)] == [r["loss"] for r in rows(full)]
    assert [r["data_tokens"] for r in rows(part)] == [r["data_tokens"] for r in rows(full)]
    assert rows(full)[-1]["data_tokens"][f"tokens:{docs_file}/lo.npy"] == 6 * 2 * 16


def test_text_documents_tokenized_in_the_pipeline(tmp_path):
    docs = [f"document {i}: " + "the cat sat on the mat. " * (1 + i % 4) for i in range(60)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    tok = tmp_path / "tok.json"
    assert cli_main(["tokenizer", "--input", str(tmp_path / "d.jsonl"), "--vocab-size", "300",
                     "--out", str(tok)]) == 0
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    eot = t.token_to_id("<|endoftext|>")
    cfg = cfg_for(f"text:{tmp_path}/d.jsonl", tokenizer=str(tok), packing="documents", seq_len=64)
    a, b = take(make_data(cfg), 3), take(make_data(cfg), 3)
    assert same(a, b)  # deterministic
    encoded = {tuple(t.encode(d, add_special_tokens=False).ids) + (eot,) for d in docs}
    whole = 0
    for batch in a:
        seg, inp, tgt = batch["segment_ids"], batch["inputs"], batch["targets"]
        for r in range(len(seg)):
            for s in range(1, int(seg[r].max()) + 1):
                idx = np.flatnonzero(seg[r] == s)
                ids = (*inp[r, idx].tolist(), int(tgt[r, idx[-1]]))
                if ids in encoded:  # a whole document (not a piece of a longer one): ends with EOT
                    whole += 1
                    assert ids[-1] == eot
    assert whole >= 6


def test_grain_is_imported_only_for_batches(monkeypatch):
    import subprocess
    import sys

    code = ("import sys, jaxmoe, jaxmoe.data, jaxmoe.data.mixture, jaxmoe.config; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'grain'], 'grain imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "grain", None)  # as if grain were not installed
    with pytest.raises(UserError, match=r"training data needs grain, which is not installed: pip install 'grain"):
        make_data(cfg_for("default"))


def test_default_corpus_packs_its_files_as_documents():
    """`default` has documents (one per standard-library file) without a separator id: documents
    packing gives segment ids and per-document positions, each row starting a document at 0."""
    b = make_data(cfg_for("default", packing="documents")).next_batch()
    assert {"segment_ids", "positions"} <= set(b)
    assert (b["segment_ids"][:, 0] == 1).all() and (b["positions"][:, 0] == 0).all()
    seg, pos = b["segment_ids"], b["positions"]
    same = seg[:, 1:] == seg[:, :-1]
    assert (pos[:, 1:][same & (seg[:, 1:] > 0)] == pos[:, :-1][same & (seg[:, 1:] > 0)] + 1).all()


def test_seek_batch_position_of_another_frameworks_run(docs_file):
    """{"seek_batch": b} (a torchtitan run continued in jaxmoe): a single flat stream in windows
    packing serves batch b next, as the uninterrupted pipeline would; other data is refused."""
    flat = f"tokens:{docs_file}/docs.npy"
    want = take(make_data(cfg_for(flat)), 4)[3]
    src = make_data(cfg_for(flat))
    src.restore({"seek_batch": 3})
    got = src.next_batch()
    assert all(np.array_equal(got[k], want[k]) for k in want)
    docs = make_data(cfg_for(flat, packing="documents", doc_sep_id=0))
    with pytest.raises(UserError, match="only one tokens:/default source in data.packing=windows"):
        docs.restore({"seek_batch": 3})
