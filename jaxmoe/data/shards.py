"""What every data source shares: the :class:`Source` base (a Grain random-access source of
documents, small when pickled), shard-file discovery (a file, a directory, a glob) and
:class:`TokenStream` (several memory-mapped shards read as one array). The formats live in
:mod:`jaxmoe.data.sources` (flat tokens, text) and :mod:`jaxmoe.data.columnar` (parquet, HF
datasets, array_record)."""

from __future__ import annotations

import glob as globlib
from pathlib import Path

import numpy as np

from jaxmoe.errors import UserError


class Source:
    """A Grain random-access source of documents (the formats: :mod:`jaxmoe.data.sources`).

    ``stream``: for flat token sources the whole token stream (a memory map, or a
    :class:`TokenStream` over several shards), else None. ``max_id``: the largest token id when
    known without reading every document (flat streams), else None.
    """

    name: str
    text: bool = False
    _transient: tuple[str, ...] = ()  # per-process handles: dropped when pickled, reopened lazily

    @property
    def stream(self):
        return None

    @property
    def max_id(self) -> int | None:
        return None

    def __len__(self) -> int:
        raise NotImplementedError(type(self).__name__)

    def __getitem__(self, i: int):
        raise NotImplementedError(type(self).__name__)

    def _check_index(self, i) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"document {i} of {self.name} (it has {n})")
        return i % n

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._transient}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# --------------------------------------------------------------------------------------------
# Shard files
# --------------------------------------------------------------------------------------------


def shard_files(spec: str, path_str: str, accept, kinds: str) -> list[Path]:
    """The files of ``PATH`` (file, directory or glob) that ``accept(path)``; UserError if none.

    A directory contributes its accepted files (others are skipped); a file or a glob match that
    is not accepted is an error naming it (``kinds`` says what is expected)."""
    path = Path(path_str).expanduser()
    if any(c in path_str for c in "*?["):
        files = [Path(p) for p in sorted(globlib.glob(str(path), recursive=True)) if Path(p).is_file()]
        if not files:
            raise UserError(f"data {spec}: no shard files matched {path}")
    elif path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and accept(p)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise UserError(f"data {spec}: no {kinds} files in directory {path}")
        return files
    elif path.exists():
        files = [path]
    else:
        raise UserError(f"data {spec}: {path} does not exist")
    bad = [str(p) for p in files if not accept(p)]
    if bad:
        raise UserError(f"data {spec}: {bad[0]} is not a {kinds} file")
    return files


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


class TokenStream:
    """Several memory-mapped shards read as one 1-D array: ``len``, ``shape``, ``dtype``, ``s[i]``
    and ``s[a:b]`` (a fresh array; a slice may span shards). Never reads more than it returns."""

    ndim = 1

    def __init__(self, parts: list, dtype):
        self.parts, self.dtype = parts, np.dtype(dtype)
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.shape = (int(self.offsets[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            a, b, step = key.indices(n)
            if step != 1:
                raise IndexError("TokenStream slices take no step")
            if b <= a:
                return np.zeros(0, self.dtype)
            k0 = int(np.searchsorted(self.offsets, a, side="right")) - 1
            k1 = int(np.searchsorted(self.offsets, b, side="left"))
            out = [np.asarray(self.parts[k][max(a - self.offsets[k], 0): b - self.offsets[k]])
                   for k in range(k0, k1)]
            return np.concatenate(out) if len(out) > 1 else np.array(out[0])
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"token {i} of a stream of {n}")
        i %= n
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[k][i - self.offsets[k]]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[:], dtype=dtype)


