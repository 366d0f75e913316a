"""jaxmoe.data.sources / tokenize: every format round-tripped on small files written here, document
boundaries, the default corpus stream, pickling (Grain workers get copies), Tokenize, bad input."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest

from jaxmoe.cli import COMMANDS
from jaxmoe.cli import main as cli_main
from jaxmoe.data import sources
from jaxmoe.data.sources import open_source, write_arrayrecord
from jaxmoe.data.tokenize import ByteTokenizer, Tokenize, load_tokenizer
from jaxmoe.errors import UserError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12], [1, 2]]
TEXTS = ["first doc", "zwei", "trois é", ""]


def docs_of(src):
    return [src[i].tolist() if not src.text else src[i] for i in range(len(src))]


def write_parquet(path, rows_per_group=2, **cols):
    pq.write_table(pa.table(cols), path, row_group_size=rows_per_group)


def write_hfds(path, num_shards=1, **cols):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(cols).save_to_disk(str(path), num_shards=num_shards)


# --------------------------------------------------------------------------------------------
# formats
# --------------------------------------------------------------------------------------------


def test_tokens_shards_doc_sep_and_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK", 3)  # the lazy scans cross chunk borders
    d = tmp_path / "toks"
    (d / "sub").mkdir(parents=True)
    np.array([1, 2, 0, 3, 4, 0, 5], np.uint16).tofile(d / "a.bin")
    (d / "aa.bin").write_bytes(b"")  # an empty shard holds no document
    np.save(d / "b.npy", np.array([6, 0, 0, 7], np.uint16))
    np.array([900, 8], np.uint16).tofile(d / "sub" / "c.bin")
    (d / "notes.md").write_text("skipped in a directory")
    src = open_source(f"tokens:{d}", doc_sep=0)
    assert src.name == f"tokens:{d}" and not src.text
    # each document ends with its separator; shard ends end documents too
    assert docs_of(src) == [[1, 2, 0], [3, 4, 0], [5], [6, 0], [0], [7], [900, 8]]
    assert src.max_id == 900 and src[0].dtype == np.int32 and src[-1].tolist() == [900, 8]
    stream = src.stream
    assert len(stream) == 13 and stream.dtype == np.uint16
    assert stream[5:10].tolist() == [0, 5, 6, 0, 0] and int(stream[11]) == 900
    assert np.asarray(stream).tolist() == sum(docs_of(src), [])
    # no doc_sep: a document per shard; a glob picks shards by name
    assert docs_of(open_source(f"tokens:{d}")) == [[1, 2, 0, 3, 4, 0, 5], [6, 0, 0, 7], [900, 8]]
    one = open_source(f"tokens:{d}/**/*.bin")
    assert docs_of(one) == [[1, 2, 0, 3, 4, 0, 5], [900, 8]]
    single = open_source(f"tokens:{d}/a.bin", doc_sep=4)
    assert isinstance(single.stream, np.memmap) and docs_of(single) == [[1, 2, 0, 3, 4], [0, 5]]
    np.array([70000, 3], np.uint32).tofile(tmp_path / "w.u32.bin")
    wide = open_source(f"tokens:{tmp_path}/w.u32.bin")
    assert wide.max_id == 70000 and wide.stream.dtype == np.uint32 and wide[0].tolist() == [70000, 3]


def test_default_stream_is_todays():
    src = open_source("default")
    files = sources.default_corpus_files()
    expected = b"".join(p.read_bytes() + b"\n\n" for p in files)
    assert src.stream.dtype == np.uint8 and src.stream.tobytes() == expected
    assert len(src) == len(files) and src.max_id == 255 and not src.text
    assert src[0].tobytes() != b"" and bytes(src[0].astype(np.uint8)) == files[0].read_bytes() + b"\n\n"
    import jaxmoe.data as old  # today's reader, while it is still there

    if hasattr(old, "_default_tokens"):
        assert np.array_equal(old._default_tokens(), src.stream)
        assert old.default_corpus_files() == files


def test_text_txt_and_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK", 5)
    d = tmp_path / "t"
    d.mkdir()
    (d / "a.txt").write_text("a whole file\nis one document")
    lines = [json.dumps({"text": TEXTS[0]}), "", "   ", json.dumps({"text": TEXTS[2], "id": 3}),
             json.dumps({"text": ""})]
    (d / "b.jsonl").write_text("\n".join(lines))  # no final newline
    (d / "c.parquet").write_bytes(b"not read: not a text file")
    src = open_source(f"text:{d}")
    assert src.text and src.stream is None and src.max_id is None
    assert docs_of(src) == ["a whole file\nis one document", TEXTS[0], TEXTS[2], ""]
    assert docs_of(open_source(f"text:{d}/*.jsonl")) == [TEXTS[0], TEXTS[2], ""]
    assert docs_of(pickle.loads(pickle.dumps(src))) == docs_of(src)


@pytest.mark.parametrize("spec_tail, want", [("", DOCS), ("#input_ids", DOCS), ("#text", TEXTS)])
def test_parquet_columns_and_shards(tmp_path, spec_tail, want):
    d = tmp_path / "pq"
    d.mkdir()
    write_parquet(d / "0.parquet", input_ids=DOCS[:3], text=TEXTS[:3])
    write_parquet(d / "1.parquet", input_ids=DOCS[3:], text=TEXTS[3:])
    write_parquet(d / "2.parquet", input_ids=pa.array([], pa.list_(pa.int32())), text=pa.array([], pa.string()))
    src = open_source(f"parquet:{d}{spec_tail}")
    assert src.text == (spec_tail == "#text") and docs_of(src) == want
    assert docs_of(open_source(f"parquet:{d}/[01].parquet{spec_tail}")) == want
    assert docs_of(pickle.loads(pickle.dumps(src))) == want


def test_parquet_out_of_order_reads_past_the_cache(tmp_path, monkeypatch):
    from jaxmoe.data import columnar

    monkeypatch.setattr(columnar, "CACHE_BYTES", 1)  # every new row group drops the one kept
    write_parquet(tmp_path / "x.parquet", rows_per_group=1, input_ids=DOCS)
    src = open_source(f"parquet:{tmp_path}")
    order = [3, 0, 2, 0, 1, 3]
    assert [src[i].tolist() for i in order] == [DOCS[i] for i in order] and len(src._cache) == 1


def test_parquet_picks_tokens_then_text(tmp_path):
    write_parquet(tmp_path / "t.parquet", text=TEXTS, tokens=pa.array(DOCS, pa.large_list(pa.uint16())))
    assert docs_of(open_source(f"parquet:{tmp_path}/t.parquet")) == DOCS
    write_parquet(tmp_path / "s.parquet", text=TEXTS, other=[1, 2, 3, 4])
    assert docs_of(open_source(f"parquet:{tmp_path}/s.parquet")) == TEXTS


def test_hf_datasets_folder(tmp_path):
    write_hfds(tmp_path / "ds", num_shards=2, input_ids=DOCS, text=TEXTS)
    src = open_source(f"hfds:{tmp_path}/ds")
    assert len(src.files) == 2 and docs_of(src) == DOCS
    assert docs_of(open_source(f"hfds:{tmp_path}/ds#text")) == TEXTS
    assert docs_of(pickle.loads(pickle.dumps(src))) == DOCS
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"tokens": DOCS}),
                                   "test": datasets.Dataset.from_dict({"tokens": DOCS[:1]})})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"holds several splits \(test, train\); name one: hfds:.*dd/SPLIT"):
        open_source(f"hfds:{tmp_path}/dd")
    assert docs_of(open_source(f"hfds:{tmp_path}/dd/test")) == DOCS[:1]


def test_arrayrecord_round_trip(tmp_path):
    d = tmp_path / "ar"
    d.mkdir()
    assert write_arrayrecord(d / "a.array_record-00000-of-00002", [np.array(x, np.int64) for x in DOCS[:3]]) == 3
    write_arrayrecord(d / "a.array_record-00001-of-00002", [np.array(DOCS[3], np.uint16)])
    src = open_source(f"arrayrecord:{d}")
    assert docs_of(src) == DOCS and src[1].dtype == np.int32
    assert docs_of(open_source(f"arrayrecord:{d}/*-00001-*")) == DOCS[3:]
    back = pickle.loads(pickle.dumps(src))
    assert docs_of(back) == DOCS
    with pytest.raises(UserError, match="document 1 is a 2-D"):
        write_arrayrecord(tmp_path / "x.array_record", [[1], [[1, 2]]])
    assert not (tmp_path / "x.array_record").exists()


def test_sources_pickle_small(tmp_path):
    np.arange(50_000, dtype=np.uint16).tofile(tmp_path / "big.bin")
    flat = open_source(f"tokens:{tmp_path}/big.bin", doc_sep=7)
    assert len(flat) == 2
    for src in (open_source("default"), flat):
        blob = pickle.dumps(src)
        assert len(blob) < 4096, (src, len(blob))  # no token data travels to a worker
        back = pickle.loads(blob)
        assert len(back) == len(src) and np.array_equal(back[-1], src[-1])
        assert np.array_equal(back.stream[:100], src.stream[:100])


# --------------------------------------------------------------------------------------------
# tokenize
# --------------------------------------------------------------------------------------------


def test_tokenize_equals_encode_plus_eot(tmp_path):
    pytest.importorskip("tokenizers")
    assert COMMANDS["tokenizer"][0] == "jaxmoe.data.tokenize"
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30)
    tok_path = tmp_path / "tok.json"
    assert cli_main(["tokenizer", "--input", str(tmp_path / "c.txt"), "--vocab-size", "280",
                     "--out", str(tok_path)]) == 0
    tok = load_tokenizer(str(tok_path))
    assert tok.vocab_size == 280 and tok.eot_id is not None
    t = Tokenize(str(tok_path))
    assert (t.vocab_size, t.eot_id) == (280, tok.eot_id)
    for text in ("the lazy fox", "", "ünïcode"):
        ids = t(text)
        assert ids.dtype == np.int32 and ids.tolist() == tok.encode(text).tolist() + [tok.eot_id]
        assert pickle.loads(pickle.dumps(t))(text).tolist() == ids.tolist()
    assert "_tok" not in pickle.loads(pickle.dumps(t)).__dict__ or pickle.loads(pickle.dumps(t))._tok is None
    assert tok.decode(t("the lazy fox")[:-1]) == "the lazy fox"
    b = load_tokenizer(None)
    assert isinstance(b, ByteTokenizer) and (b.vocab_size, b.eot_id) == (256, None)
    assert b.encode("hé").tolist() == [104, 195, 169] and b.decode([104, 195, 169]) == "hé"
    for none in (None, ""):
        with pytest.raises(UserError, match=r"text data needs a tokenizer: --set data.tokenizer="):
            Tokenize(none)
    with pytest.raises(UserError, match="tokenizer file .*none.json does not exist"):
        Tokenize(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError, match="tokenizer file .*bad.json is not a valid tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))


# --------------------------------------------------------------------------------------------
# bad input: one line, raised by open_source, nothing written
# --------------------------------------------------------------------------------------------


def _bad_npy(d):
    (d / "x.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")


def _truncated_npy(d):
    np.save(d / "x.npy", np.arange(1000, dtype=np.uint16))
    (d / "x.npy").write_bytes((d / "x.npy").read_bytes()[:300])


def _mixed(d):
    np.zeros(4, np.uint16).tofile(d / "a.bin")
    np.zeros(4, np.uint32).tofile(d / "b.u32.bin")


def _record_not_npy(d):
    ar = pytest.importorskip("array_record.python.array_record_module")
    w = ar.ArrayRecordWriter(str(d / "x.array_record"), "group_size:1")
    w.write(b"just bytes")
    w.close()


BAD = [
    ("missing path", None, "tokens:{d}/nope.bin", "nope.bin does not exist"),
    ("no glob match", None, "tokens:{d}/*.bin", r"no shard files matched .*\*\.bin"),
    ("empty directory", None, "parquet:{d}", "no .parquet files in directory"),
    ("unknown scheme", None, "s3://bucket/x", r"is not 'default' or a known scheme: tokens:PATH, text:PATH, parquet"),
    ("no path", None, "tokens:", "no path; use tokens:PATH"),
    ("glob of other files", lambda d: (d / "a.txt").write_text("x"), "tokens:{d}/*",
     r"a.txt is not a \.npy/\.bin file"),
    ("empty token file", lambda d: (d / "e.bin").write_bytes(b""), "tokens:{d}/e.bin", r"is empty \(0 tokens"),
    ("odd .bin size", lambda d: (d / "o.bin").write_bytes(b"abc"), "tokens:{d}/o.bin", "3 bytes, not a multiple of 2"),
    ("broken npy header", _bad_npy, "tokens:{d}/x.npy", "x.npy is not a readable .npy token array"),
    ("truncated npy", _truncated_npy, "tokens:{d}/x.npy", "x.npy is not a readable .npy token array"),
    ("float npy", lambda d: np.save(d / "f.npy", np.zeros(3, np.float32)), "tokens:{d}/f.npy", "1-D uint16 or uint32"),
    ("mixed dtypes", _mixed, "tokens:{d}", r"shards mix dtypes: .*a.bin is uint16 but .*b.u32.bin is uint32"),
    ("blank text", lambda d: (d / "b.jsonl").write_text("\n  \n"), "text:{d}", "is empty"),
    ("jsonl not json", lambda d: (d / "b.jsonl").write_text("\n{oops\n"), "text:{d}", "b.jsonl:2 is not valid JSON"),
    ("jsonl no text", lambda d: (d / "b.jsonl").write_text('{"txt": 1}\n'), "text:{d}/b.jsonl",
     'b.jsonl:1 has no string field "text"'),
    ("not parquet", lambda d: (d / "x.parquet").write_bytes(b"PAR1 nope"), "parquet:{d}",
     "not a readable parquet file"),
    ("no such column", lambda d: write_parquet(d / "x.parquet", input_ids=DOCS, text=TEXTS), "parquet:{d}#nope",
     r"has no column 'nope' \(it has: input_ids, text\)"),
    ("no default column", lambda d: write_parquet(d / "x.parquet", a=[1, 2]), "parquet:{d}",
     r"has no column input_ids, tokens, text \(it has: a\); name one: parquet:PATH#COLUMN"),
    ("column of floats", lambda d: write_parquet(d / "x.parquet", a=[1.0]), "parquet:{d}#a",
     "column 'a' of .* is double; expected a list of integers"),
    ("parquet 0 rows", lambda d: write_parquet(d / "x.parquet", text=pa.array([], pa.string())), "parquet:{d}",
     r"is empty \(0 rows"),
    ("not array_record", lambda d: (d / "x.array_record").write_bytes(b"\0" * 64), "arrayrecord:{d}",
     "not a readable array_record file"),
    ("record not npy", _record_not_npy, "arrayrecord:{d}", r"record 0 of .*x.array_record is not an np.save array"),
    ("array_record 0 records", lambda d: write_arrayrecord(d / "x.array_record", []), "arrayrecord:{d}",
     r"is empty \(0 records"),
    ("hfds without state", lambda d: (d / "x.arrow").write_bytes(b""), "hfds:{d}", "no state.json"),
    ("hfds of splits", lambda d: (d / "dataset_dict.json").write_text("{}"), "hfds:{d}", "several splits"),
    ("hfds no column", lambda d: write_hfds(d / "ds", a=[1]), "hfds:{d}/ds#b", r"no column 'b' \(it has: a\)"),
]


@pytest.mark.parametrize("what, setup, spec, message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_nothing_written(tmp_path, what, setup, spec, message):
    d = tmp_path / "in"
    d.mkdir()
    if setup:
        setup(d)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=message) as e:
        open_source(spec.format(d=d), doc_sep=0 if spec.startswith("tokens") else None)
    assert "\n" not in str(e.value)
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def test_bad_doc_sep_and_read_time_errors(tmp_path):
    np.zeros(4, np.uint16).tofile(tmp_path / "a.bin")
    with pytest.raises(UserError, match="document separator -1 must be a token id >= 0"):
        open_source(f"tokens:{tmp_path}/a.bin", doc_sep=-1)
    # a bad line or record past the first is found when read: the error names file and place
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n\n{"text": 3}\n')
    src = open_source(f"text:{tmp_path}/b.jsonl")
    with pytest.raises(UserError, match='b.jsonl:3 has no string field "text"'):
        src[1]
    ar = pytest.importorskip("array_record.python.array_record_module")
    good = io.BytesIO()
    np.save(good, np.array([1, 2], np.int32))
    w = ar.ArrayRecordWriter(str(tmp_path / "r.array_record"), "group_size:1")
    square, big_endian = io.BytesIO(), io.BytesIO()
    np.save(square, np.eye(2, dtype=np.int32))
    np.save(big_endian, np.array([1, 300], ">u2"))
    raws = (good.getvalue(), big_endian.getvalue(), pickle.dumps([3]), good.getvalue()[:-1], square.getvalue())
    for raw in raws:
        w.write(raw)
    w.close()
    src = open_source(f"arrayrecord:{tmp_path}/r.array_record")
    assert len(src) == 5 and src[0].tolist() == [1, 2] and src[1].tolist() == [1, 300]
    for i, msg in ((2, "is not an np.save array"), (3, "is not an np.save array"),
                   (4, "holds a 2-D int32 array; expected 1-D integer token ids")):
        with pytest.raises(UserError, match=rf"record {i} of .*r.array_record {msg}"):
            src[i]


def test_iter_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "b.txt").write_text("three")
    assert list(sources.iter_documents(tmp_path)) == ["one", "two", "three"]
    assert list(sources.iter_documents(str(tmp_path / "b.txt"))) == ["three"]


@pytest.mark.parametrize("scheme, blocked", [("parquet", "pyarrow"), ("hfds", "pyarrow"),
                                             ("arrayrecord", "array_record")])
def test_missing_data_extra_is_one_line(tmp_path, monkeypatch, scheme, blocked):
    import sys

    for name in [n for n in sys.modules if n.split(".")[0] == blocked] + [blocked]:
        monkeypatch.setitem(sys.modules, name, None)
    (tmp_path / "x.parquet").write_bytes(b"")
    (tmp_path / "x.array_record").write_bytes(b"")
    (tmp_path / "state.json").write_text("{}")
    with pytest.raises(UserError, match=rf"needs {blocked}, which is not installed: pip install 'jaxmoe\[data\]'"):
        open_source(f"{scheme}:{tmp_path}")


def test_grain_reads_a_source(tmp_path):
    grain = pytest.importorskip("grain")
    write_parquet(tmp_path / "t.parquet", text=TEXTS)
    ds = grain.MapDataset.source(open_source(f"parquet:{tmp_path}")).map(ByteTokenizer().encode)
    assert [ds[i].tolist() for i in range(len(ds))] == [ByteTokenizer().encode(t).tolist() for t in TEXTS]
