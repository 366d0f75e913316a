"""jaxmoe.data: determinism, resume, host sharding, token files, text + tokenizer, errors."""

import json

import numpy as np
import pytest

from jaxmoe.cli import main as cli_main
from jaxmoe.config import load_config
from jaxmoe.data import make_data
from jaxmoe.data.sources import default_corpus_files, iter_documents
from jaxmoe.data.tokenize import ByteTokenizer
from jaxmoe.errors import UserError


def cfg_for(data="default", **train):
    sets = [f"data.source={data}", "train.seq_len=16", "train.batch_size=4"]
    sets += [f"train.{k}={v}" for k, v in train.items()]
    return load_config("tiny", overrides=sets)


def batches(src, n):
    return [src.next_batch() for _ in range(n)]


def same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in ("inputs", "targets", "mask"))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\n")
    assert ids.dtype == np.int32 and ids.max() < 256 and len(ids) == 7
    assert tok.decode(ids) == "héllo\n"


def test_default_corpus_is_stdlib_sorted():
    files = default_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == default_corpus_files()


def test_default_batches_shapes_and_shift():
    src = make_data(cfg_for())
    assert src.vocab_size == 256
    b = src.next_batch()
    assert b["inputs"].shape == (4, 16) and b["inputs"].dtype == np.int32
    assert b["targets"].dtype == np.int32 and b["mask"].dtype == np.float32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert b["mask"].min() == 1.0
    # rows are real text windows of the corpus
    text = ByteTokenizer().decode(np.concatenate([b["inputs"][0], b["targets"][0, -1:]]))
    assert len(text) > 0


def test_deterministic_and_seeded():
    a = batches(make_data(cfg_for(seed=1)), 3)
    b = batches(make_data(cfg_for(seed=1)), 3)
    c = batches(make_data(cfg_for(seed=2)), 3)
    assert same(a, b)
    assert not same(a, c)


def test_resume_gives_the_same_next_batches():
    src = make_data(cfg_for())
    batches(src, 2)
    state = json.loads(json.dumps(src.state()))  # must survive JSON
    expected = batches(src, 3)
    fresh = make_data(cfg_for())
    fresh.restore(state)
    assert same(batches(fresh, 3), expected)
    with pytest.raises(UserError, match="seed"):
        make_data(cfg_for(seed=5)).restore(state)


def test_eval_split_is_held_out_and_fixed(tmp_path):
    # tokens 0..N-1 are distinct, so held-out rows can be told apart from training rows
    np.save(tmp_path / "t.npy", np.arange(3000, dtype=np.uint16))
    cfg = cfg_for(f"tokens:{tmp_path}/t.npy")
    cfg.model.vocab_size = 4096
    ev = make_data(cfg, "eval")
    tr = make_data(cfg, "train")
    e = batches(ev, 2)
    t = batches(tr, 30)
    eval_ids = np.concatenate([b["inputs"].ravel() for b in e])
    train_ids = np.concatenate([b["targets"].ravel() for b in t])
    assert eval_ids.min() >= 3000 - max(3000 // 50, 17)
    assert train_ids.max() < 3000 - max(3000 // 50, 17)
    ev.reset()
    assert same(batches(ev, 2), e)


@pytest.mark.parametrize("count", [2, 4])
def test_host_sharding_rows_partition_the_global_batch(count):
    full = batches(make_data(cfg_for()), 3)
    parts = [batches(make_data(cfg_for(), process_index=i, process_count=count), 3)
             for i in range(count)]
    for step in range(3):
        for k in ("inputs", "targets", "mask"):
            # process i's row j is row i + j * count of the one-process batch (pipeline doc, step 3)
            for i in range(count):
                np.testing.assert_array_equal(parts[i][step][k], full[step][k][i::count])
        assert parts[0][step]["inputs"].shape == (4 // count, 16)


def test_epochs_wrap_and_reshuffle(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(500, dtype=np.uint16))  # train split: 30 windows
    cfg = cfg_for(f"tokens:{tmp_path}/t.npy")
    cfg.model.vocab_size = 512
    src = make_data(cfg)
    assert src.n_windows == (500 - 17 - 1) // 16
    W = src.n_windows
    starts = [int(r[0]) for b in batches(src, (2 * W) // 4) for r in b["inputs"]]
    first, second = starts[:W], starts[W:2 * W]
    assert sorted(first) == sorted(second) == [16 * w for w in range(W)]
    assert first != second


@pytest.mark.parametrize("name,dtype", [("t.bin", np.uint16), ("t.u32.bin", np.uint32),
                                        ("t.npy", np.uint16), ("u.npy", np.uint32)])
def test_token_file_round_trip(tmp_path, name, dtype):
    rng = np.random.default_rng(0)
    top = 70000 if dtype == np.uint32 else 60000
    toks = rng.integers(0, top, size=2000).astype(dtype)
    toks[5] = top - 1
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, toks)
    else:
        toks.tofile(path)
    cfg = cfg_for(f"tokens:{path}")
    cfg.model.vocab_size = top
    src = make_data(cfg)
    assert src.vocab_size == top
    b = src.next_batch()
    S = 16
    for row_in, row_t in zip(b["inputs"], b["targets"]):
        # each row is a window of the file, at a multiple of S
        starts = np.flatnonzero(toks[: len(toks) - S].astype(np.int64) == row_in[0])
        assert any(np.array_equal(toks[s:s + S + 1], np.r_[row_in, row_t[-1]]) and s % S == 0
                   for s in starts)


def test_text_and_tokenizer(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (docs / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} of the story, the end."})
                                            for i in range(200)))
    tok_path = tmp_path / "tok.json"
    assert cli_main(["tokenizer", "--input", str(docs), "--vocab-size", "300",
                     "--out", str(tok_path)]) == 0
    assert cli_main(["tokenizer", "--input", str(docs), "--vocab-size", "300",
                     "--out", str(tok_path)]) == 2  # refuses to overwrite
    assert cli_main(["tokenizer", "--input", str(docs), "--vocab-size", "300",
                     "--out", str(tok_path), "--force"]) == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    assert tok.get_vocab_size() == 300
    cfg = cfg_for(f"text:{docs}", tokenizer=str(tok_path))
    cfg.model.vocab_size = 300
    src = make_data(cfg)
    assert src.vocab_size == 300
    b = src.next_batch()
    assert b["inputs"].max() < 300
    text = tok.decode(np.r_[b["inputs"][0], b["targets"][0, -1]].tolist(), skip_special_tokens=False)
    assert any(w in text for w in ("the", "line", "fox", "end"))
    cfg.model.vocab_size = 256
    with pytest.raises(UserError, match="vocab_size=256"):
        make_data(cfg)


def test_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        make_data(cfg_for(f"tokens:{tmp_path}/nope.bin"))
    with pytest.raises(UserError, match="does not exist"):
        make_data(cfg_for(f"text:{tmp_path}/nope.txt"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(UserError, match="empty"):
        make_data(cfg_for(f"tokens:{tmp_path}/empty.bin"))
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "short.bin")
    with pytest.raises(UserError, match="too few"):
        make_data(cfg_for(f"tokens:{tmp_path}/short.bin"))
    np.array([1, 2, 999] * 100, dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(UserError, match="token id 999 but model.vocab_size=256"):
        make_data(cfg_for(f"tokens:{tmp_path}/big.bin"))
    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    with pytest.raises(UserError, match="uint16 or uint32"):
        make_data(cfg_for(f"tokens:{tmp_path}/f.npy"))
    (tmp_path / "x.txt").write_text("hello " * 100)
    with pytest.raises(UserError, match="needs a tokenizer"):
        make_data(cfg_for(f"text:{tmp_path}/x.txt"))
    with pytest.raises(UserError, match="tokenizer file"):
        make_data(cfg_for(f"text:{tmp_path}/x.txt", tokenizer=f"{tmp_path}/none.json"))
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(UserError, match='bad.jsonl:1 has no string field "text"'):
        list(iter_documents(tmp_path / "bad.jsonl"))
    with pytest.raises(UserError, match="not 'default'"):
        make_data(cfg_for("s3://bucket"))
    with pytest.raises(UserError, match="divisible"):
        make_data(cfg_for(), process_count=3)
    with pytest.raises(UserError) as e:
        make_data(cfg_for(f"tokens:{tmp_path}/nope.bin"))
    assert "\n" not in str(e.value)
