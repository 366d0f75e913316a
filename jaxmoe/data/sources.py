"""Document sources (TEMPORARY minimal version: ``default``, ``tokens:``, ``text:`` only).

Replaced at merge by branch ``src``'s module of the same contract: :class:`Source` (a picklable
random-access data source of documents, or a flat token ``stream``) and :func:`open_source`.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

import numpy as np

from jaxmoe.errors import UserError

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (``sysconfig`` "stdlib"), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(f"default corpus: the Python standard library source directory {root} is "
                        "missing; use --set train.data=tokens:PATH or text:PATH")
    files = [p for p in root.rglob("*.py")
             if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])) and p.is_file()]
    if not files:
        raise UserError(f"default corpus: no .py files under {root}; use --set "
                        "train.data=tokens:PATH or text:PATH")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise UserError(f"text data: no .txt or .jsonl files in directory {path}")
        return files
    if path.suffix not in (".txt", ".jsonl"):
        raise UserError(f"text data: {path} must be a .txt or .jsonl file or a directory of them")
    return [path]


def iter_documents(path: Path):
    """Yield the documents of a .txt/.jsonl file or directory (one per .txt file / JSONL line)."""
    if not path.exists():
        raise UserError(f"text data: {path} does not exist")
    for f in _text_files(path):
        if f.suffix == ".txt":
            yield f.read_text(encoding="utf-8", errors="replace")
            continue
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise UserError(f"text data: {f}:{n} is not valid JSON") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise UserError(f'text data: {f}:{n} has no string field "text"')
                yield rec["text"]


def _token_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise UserError(f"token file {path} does not exist (train.data=tokens:PATH)")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise UserError(f"token file {path}: not a readable .npy token array "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
            raise UserError(f"token file {path}: expected a 1-D uint16 or uint32 array, got "
                            f"{arr.ndim}-D {arr.dtype}")
        return arr
    if path.suffix == ".bin":
        dtype = np.dtype("<u4") if path.name.endswith(".u32.bin") else np.dtype("<u2")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise UserError(f"token file {path}: size {size} is not a multiple of {dtype.itemsize} "
                            f"bytes ({dtype.name}; name it *.u32.bin for uint32)")
        return np.zeros(0, dtype) if size == 0 else np.memmap(path, dtype=dtype, mode="r")
    raise UserError(f"token file {path}: expected a .bin or .npy file")


@functools.lru_cache(maxsize=1)
def _default_tokens() -> np.ndarray:
    return np.frombuffer(b"".join(p.read_bytes() + b"\n\n" for p in default_corpus_files()), np.uint8)


class Source:
    """Documents (``text``: str, else int32 ids) or a flat token ``stream``; picklable."""

    def __init__(self, spec: str, doc_sep: int | None = None):
        self.name, self.doc_sep = spec, doc_sep
        self._load()

    def _load(self):
        spec = self.name
        self.text, self.stream, self.max_id, self._docs = False, None, None, None
        if spec == "default":
            self.stream, self.max_id = _default_tokens(), 255
        elif spec.startswith("tokens:"):
            self.stream = _token_file(Path(spec[len("tokens:"):]).expanduser())
            if len(self.stream) == 0:
                raise UserError(f"token file {spec[len('tokens:'):]} is empty")
            self.max_id = int(self.stream.max())
        elif spec.startswith("text:"):
            path = Path(spec[len("text:"):]).expanduser()
            if not path.exists():
                raise UserError(f"text data: {path} does not exist (train.data=text:PATH)")
            self.text, self._docs = True, list(iter_documents(path))
            if not self._docs:
                raise UserError(f"text data {path} is empty")
        else:
            raise UserError(f"train.data={spec!r} is not 'default', 'tokens:PATH' or 'text:PATH'")
        if self.stream is not None and self.doc_sep is not None:
            ends = np.flatnonzero(np.asarray(self.stream) == self.doc_sep) + 1
            if not len(ends) or ends[-1] != len(self.stream):
                ends = np.r_[ends, len(self.stream)]
            self._bounds = np.r_[0, ends].astype(np.int64)

    def __getstate__(self):
        return {"name": self.name, "doc_sep": self.doc_sep}

    def __setstate__(self, st):
        self.name, self.doc_sep = st["name"], st["doc_sep"]
        self._load()

    def __len__(self) -> int:
        if self._docs is not None:
            return len(self._docs)
        return len(self._bounds) - 1 if self.doc_sep is not None else 1

    def __getitem__(self, i):
        if self._docs is not None:
            return self._docs[i]
        if self.doc_sep is None:
            return np.asarray(self.stream, dtype=np.int32)
        return np.asarray(self.stream[self._bounds[i]:self._bounds[i + 1]], dtype=np.int32)


def open_source(spec: str, *, doc_sep: int | None = None) -> Source:
    return Source(spec, doc_sep)
