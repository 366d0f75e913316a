"""Documents from dataset files: one :class:`Source` per ``--data`` spec (Grain random-access sources).

A :class:`Source` is a sequence of documents: ``src[i]`` is document ``i``, either a 1-D ``np.int32``
array of token ids (``src.text`` False) or its text (``src.text`` True, tokenized later by
:class:`jaxmoe.data.tokenize.Tokenize` in the pipeline's workers). Nothing reads a whole corpus
into memory: files are memory-mapped and indexed lazily, in chunks, on first use. A source pickles
small (no mapped data, no open files), so Grain worker processes each get a cheap copy.

Specs (``PATH``: one file, a directory -- its shard files, recursively, sorted by relative path --
or a glob, matches sorted):

* ``default``: the Python standard library's ``.py`` files as one UTF-8 byte stream (each file
  followed by a blank line, ``max_id`` 255); a document is one file (with its blank line).
* ``tokens:PATH``: flat token files, ``.npy`` (uint16/uint32, from the header), raw ``.bin``
  little-endian uint16, ``.u32.bin`` uint32; every shard of one dtype. ``stream`` is their
  concatenation. With ``doc_sep`` a document ends at (and includes) each ``doc_sep`` token, and
  at the end of a shard; without it each shard is one document.
* ``text:PATH``: ``.txt`` (one document per file) and ``.jsonl`` (one document per non-blank
  line: its string field ``"text"``).
* ``parquet:PATH[#COLUMN]``: one row per document; COLUMN holds token ids (a list of integers) or
  text (a string). Without ``#COLUMN``: ``input_ids``, ``tokens`` or ``text``, the first present.
* ``arrayrecord:PATH``: array_record files, one record per document: the bytes :func:`numpy.save`
  writes for a 1-D integer array (:func:`write_arrayrecord` writes them).
* ``hfds:DIR[#COLUMN]``: a HuggingFace ``datasets`` ``save_to_disk`` folder (one split), read
  directly with pyarrow (its ``state.json`` names the Arrow files); column rules as parquet.
"""

from __future__ import annotations

import functools
import json
import mmap
import sysconfig
from pathlib import Path

import numpy as np

from jaxmoe.data import columnar
from jaxmoe.data.columnar import write_arrayrecord
from jaxmoe.data.shards import Source, TokenStream, first_line, shard_files
from jaxmoe.errors import UserError

SCHEMES = ("default", "tokens", "text", "parquet", "arrayrecord", "hfds")
CHUNK = 1 << 24  # elements per step of a lazy scan (index building never holds a whole file)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_WS = np.zeros(256, bool)  # ASCII whitespace, by byte value: a JSONL line of only these is blank
_WS[[9, 10, 11, 12, 13, 32]] = True


# --------------------------------------------------------------------------------------------
# Flat token streams: tokens: and default
# --------------------------------------------------------------------------------------------


def _map_tokens(path: Path, spec: str) -> np.ndarray:
    """One token shard memory-mapped (read-only), its format checked."""
    if path.suffix == ".npy":
        try:  # object arrays need pickle (refused), truncated files fail to map: both bad input
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise UserError(f"data {spec}: {path} is not a readable .npy token array ({first_line(e)})") from None
        if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
            raise UserError(f"data {spec}: {path} holds a {arr.ndim}-D {arr.dtype} array; "
                            "expected 1-D uint16 or uint32")
        return arr
    dtype = np.dtype("<u4") if path.name.endswith(".u32.bin") else np.dtype("<u2")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise UserError(f"data {spec}: {path} has {size} bytes, not a multiple of {dtype.itemsize} "
                        f"({dtype.name}; name it *.u32.bin for uint32)")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _scan_tokens(arr, doc_sep: int | None) -> tuple[int, np.ndarray]:
    """(largest id or -1, positions of ``doc_sep``) of one shard, CHUNK tokens at a time."""
    top, seps = -1, []
    for a in range(0, len(arr), CHUNK):
        chunk = np.asarray(arr[a: a + CHUNK])
        top = max(top, int(chunk.max()))
        if doc_sep is not None:
            seps.append(np.flatnonzero(chunk == doc_sep) + a)
    return top, (np.concatenate(seps) if seps else np.zeros(0, np.int64)).astype(np.int64)


class FlatSource(Source):
    """``tokens:`` shards as one stream; documents cut at ``doc_sep`` and at shard ends."""

    _transient = ("_maps", "_stream")

    def __init__(self, spec: str, files: list[Path], doc_sep: int | None):
        self.name, self.files, self.doc_sep = spec, files, doc_sep
        maps = [_map_tokens(f, spec) for f in files]
        dtypes = {np.dtype(m.dtype).newbyteorder("<") for m in maps}
        if len(dtypes) > 1:
            first = np.dtype(maps[0].dtype)
            k = next(k for k, m in enumerate(maps) if np.dtype(m.dtype) != first)
            raise UserError(f"data {spec}: shards mix dtypes: {files[0]} is {first.name} but {files[k]} "
                            f"is {np.dtype(maps[k].dtype).name}; convert them to one dtype")
        self.dtype = np.dtype(maps[0].dtype)
        self.sizes = [len(m) for m in maps]
        if sum(self.sizes) == 0:
            raise UserError(f"data {spec}: the source is empty (0 tokens in {len(files)} shard file(s))")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._maps, self._stream, self._bounds, self._max = maps, None, None, None

    def _shard(self, k: int):
        if getattr(self, "_maps", None) is None:
            self._maps = [None] * len(self.files)
        if self._maps[k] is None:
            self._maps[k] = _map_tokens(self.files[k], self.name)
        return self._maps[k]

    @property
    def stream(self):
        if getattr(self, "_stream", None) is None:
            parts = [self._shard(k) for k in range(len(self.files))]
            self._stream = parts[0] if len(parts) == 1 else TokenStream(parts, self.dtype)
        return self._stream

    def _scan(self) -> None:
        """One chunked pass over every shard: the largest id and the ``doc_sep`` positions."""
        cuts, top = [np.zeros(1, np.int64)], -1
        for k in range(len(self.files)):
            t, seps = _scan_tokens(self._shard(k), self.doc_sep)
            top = max(top, t)
            cuts += [seps + 1 + self.offsets[k], self.offsets[k + 1: k + 2]]
        self._max = top
        if self.doc_sep is not None:
            self._bounds = np.unique(np.concatenate(cuts))

    def _index(self) -> np.ndarray:
        """Document boundaries (global token offsets, first 0, last the stream length)."""
        if self._bounds is None:
            if self.doc_sep is None:  # a document per non-empty shard: no pass over the data
                self._bounds = np.unique(self.offsets)
            else:
                self._scan()
        return self._bounds

    @property
    def max_id(self) -> int:
        if self._max is None:
            self._scan()
        return self._max

    def __len__(self) -> int:
        return len(self._index()) - 1

    def __getitem__(self, i):
        i = self._check_index(i)
        a, b = (int(x) for x in self._index()[i: i + 2])
        k = int(np.searchsorted(self.offsets, a, side="right")) - 1
        base = int(self.offsets[k])
        return np.asarray(self._shard(k)[a - base: b - base], dtype=np.int32)


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (``sysconfig`` "stdlib"), sorted by relative path.

    Installed packages (``site-packages``) and the test suites (which some distributions strip)
    are left out, so the corpus depends only on the Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(f"default corpus: the Python standard library source directory {root} is "
                        "missing; use --set data.source=tokens:PATH or text:PATH")
    files = [p for p in root.rglob("*.py")
             if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])) and p.is_file()]
    if not files:
        raise UserError(f"default corpus: no .py files under {root}; use --set data.source=tokens:PATH or text:PATH")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=1)
def default_stream() -> tuple[np.ndarray, np.ndarray]:
    """The default corpus as one uint8 byte stream (each file + ``b"\\n\\n"``) and its file
    boundaries (byte offsets, first 0, last the length). Read once per process."""
    parts = [p.read_bytes() + b"\n\n" for p in default_corpus_files()]
    bounds = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    return np.frombuffer(b"".join(parts), dtype=np.uint8), bounds


class DefaultSource(Source):
    """``default``: the stdlib byte stream; a document is a file. Pickles without the bytes."""

    name, max_id = "default", 255

    def __init__(self):
        default_stream()  # fail (UserError) now, not in a worker

    @property
    def stream(self) -> np.ndarray:
        return default_stream()[0]

    def __len__(self) -> int:
        return len(default_stream()[1]) - 1

    def __getitem__(self, i):
        i = self._check_index(i)
        data, bounds = default_stream()
        return data[bounds[i]: bounds[i + 1]].astype(np.int32)


# --------------------------------------------------------------------------------------------
# text: .txt and .jsonl
# --------------------------------------------------------------------------------------------


def _jsonl_lines(mm) -> np.ndarray:
    """Start offsets of the non-blank lines of a mapped JSONL file, CHUNK // 4 bytes at a time."""
    n, step = len(mm), max(1, CHUNK // 4)
    ends, counts, carry = [], [], 0  # newline positions; non-blank bytes seen up to each of them
    arr = np.frombuffer(mm, dtype=np.uint8) if n else np.zeros(0, np.uint8)
    for a in range(0, n, step):
        chunk = arr[a: a + step]
        filled = np.cumsum(~_WS[chunk], dtype=np.int32)
        nl = np.flatnonzero(chunk == 10)
        ends.append(nl + a)
        counts.append(filled[nl] + np.int64(carry))
        carry += int(filled[-1])
    del arr
    ends = np.concatenate(ends or [np.zeros(0, np.int64)]).astype(np.int64)
    seen = np.concatenate(counts or [np.zeros(0, np.int64)])
    if n and (not len(ends) or ends[-1] != n - 1):  # a last line without its newline
        ends, seen = np.append(ends, n), np.append(seen, carry)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    return starts[np.diff(np.concatenate([[0], seen])) > 0]


class TextSource(Source):
    """``text:``: a ``.txt`` file is a document, a ``.jsonl`` line is one (its ``"text"``)."""

    text = True
    _transient = ("_mm",)

    def __init__(self, spec: str, files: list[Path]):
        self.name, self.files = spec, files
        self._starts: list | None = None
        if not any(self._has_document(f) for f in files):
            raise UserError(f"data {spec}: the source is empty (no documents: the files are empty or blank)")

    def _has_document(self, f: Path) -> bool:
        if f.suffix == ".txt":
            return f.stat().st_size > 0
        with open(f, "rb") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    self._parse(f, line, lambda n=n: n)  # a malformed file fails now, not in a worker
                    return True
        return False

    def _parse(self, f: Path, line: bytes, line_no) -> str:
        """The ``"text"`` of one JSONL line; ``line_no()`` is called only for an error message."""
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"data {self.name}: {f}:{line_no()} is not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise UserError(f'data {self.name}: {f}:{line_no()} has no string field "text"')
        return rec["text"]

    def _map(self, k: int):
        if getattr(self, "_mm", None) is None:
            self._mm = {}
        if k not in self._mm:
            with open(self.files[k], "rb") as fh:
                size = self.files[k].stat().st_size
                self._mm[k] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return self._mm[k]

    def _index(self):
        if self._starts is None:
            starts = [np.zeros(1, np.int64) if f.suffix == ".txt" else _jsonl_lines(self._map(k))
                      for k, f in enumerate(self.files)]
            self._starts = starts
            self._cum = np.cumsum([0] + [len(s) for s in starts]).astype(np.int64)
        return self._starts

    def __len__(self) -> int:
        self._index()
        return int(self._cum[-1])

    def __getitem__(self, i) -> str:
        i = self._check_index(i)
        starts = self._index()
        k = int(np.searchsorted(self._cum, i, side="right")) - 1
        f, mm = self.files[k], self._map(k)
        if f.suffix == ".txt":
            return bytes(mm).decode("utf-8", errors="replace")
        a = int(starts[k][i - self._cum[k]])
        b = mm.find(b"\n", a)
        line = mm[a: b if b >= 0 else len(mm)]
        return self._parse(f, line, lambda: mm[:a].count(b"\n") + 1)


def iter_documents(path):
    """The documents (str) of a ``.txt``/``.jsonl`` file, directory or glob, one at a time
    (``text:PATH``'s source, read in order)."""
    src = open_source(f"text:{path}")
    for i in range(len(src)):
        yield src[i]


# --------------------------------------------------------------------------------------------
# open_source
# --------------------------------------------------------------------------------------------

SYNTAX = ("default", "tokens:PATH", "text:PATH", "parquet:PATH[#COLUMN]", "arrayrecord:PATH",
          "hfds:DIR[#COLUMN]")


def _is_token_file(p: Path) -> bool:
    return p.suffix in (".npy", ".bin")


def _is_text_file(p: Path) -> bool:
    return p.suffix in (".txt", ".jsonl")


def open_source(spec: str, *, doc_sep: int | None = None) -> Source:
    """The :class:`Source` of a ``--data`` spec (see the module docstring); every check that does
    not need a whole pass over the data (paths, formats, headers, columns, emptiness) runs here.

    ``doc_sep`` (a token id) splits ``tokens:`` streams into documents; the other formats carry
    their own document boundaries and ignore it.
    """
    if doc_sep is not None and (isinstance(doc_sep, bool) or not isinstance(doc_sep, (int, np.integer))
                                or doc_sep < 0):
        raise UserError(f"document separator {doc_sep!r} must be a token id >= 0")
    doc_sep = None if doc_sep is None else int(doc_sep)
    if spec == "default":
        return DefaultSource()
    scheme, colon, rest = spec.partition(":")
    if not colon or scheme not in SCHEMES or scheme == "default":
        raise UserError(f"data {spec!r} is not 'default' or a known scheme: {', '.join(SYNTAX[1:])}")
    path, column = rest, None
    if scheme in ("parquet", "hfds") and "#" in rest:
        path, _, column = rest.rpartition("#")
        if not column:
            raise UserError(f"data {spec}: nothing after '#'; name a column or drop the '#'")
    if not path:
        raise UserError(f"data {spec}: no path; use {scheme}:PATH")
    if scheme == "tokens":
        return FlatSource(spec, shard_files(spec, path, _is_token_file, ".npy/.bin"), doc_sep)
    if scheme == "text":
        return TextSource(spec, shard_files(spec, path, _is_text_file, ".txt/.jsonl"))
    if scheme == "parquet":
        return columnar.ParquetSource(spec, shard_files(spec, path, columnar.is_parquet, ".parquet"), column)
    if scheme == "arrayrecord":
        return columnar.ArrayRecordSource(
            spec, shard_files(spec, path, columnar.is_arrayrecord, ".array_record"))
    return columnar.HFDatasetSource(spec, Path(path).expanduser(), column)


__all__ = [
    "SCHEMES",
    "SYNTAX",
    "DefaultSource",
    "FlatSource",
    "Source",
    "TextSource",
    "TokenStream",
    "default_corpus_files",
    "default_stream",
    "first_line",
    "iter_documents",
    "open_source",
    "write_arrayrecord",
]
