"""Row-per-document formats: parquet, HuggingFace ``datasets`` folders (Arrow), array_record.

* ``parquet:PATH[#COLUMN]`` and ``hfds:DIR[#COLUMN]``: one row is one document. COLUMN is a list of
  integers (token ids; ``text`` False) or a string (``text`` True). Without ``#COLUMN`` the first
  of ``input_ids``, ``tokens``, ``text`` the files have. Parquet files are memory-mapped and read
  one row group at a time (the last few kept); the ``datasets`` folder's Arrow files (IPC stream
  format, named by its ``state.json``) are memory-mapped whole, without the ``datasets`` library.
* ``arrayrecord:PATH``: one record is one document, stored as the bytes :func:`numpy.save` writes
  for a 1-D integer array (so the dtype travels with it; read back with ``allow_pickle=False``).
  :func:`write_arrayrecord` writes such files (``group_size:1``: one record per chunk, the layout
  random access wants).

The optional packages (pyarrow, array_record: the ``[data]`` extra) are imported when a source of
theirs is opened.
"""

from __future__ import annotations

import io
import json
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np

from jaxmoe.data.shards import Source, first_line
from jaxmoe.errors import UserError
from jaxmoe.extras import require

ID_COLUMNS = ("input_ids", "tokens", "text")  # the column taken when a spec names none, in order
CACHE_BYTES = 256 << 20  # decoded parquet row groups kept per process (a shuffled order revisits them)


def is_parquet(p: Path) -> bool:
    return p.suffix == ".parquet"


def is_arrayrecord(p: Path) -> bool:
    return ".array_record" in p.name or p.suffix == ".arrayrecord"


def _pa(spec: str):
    return require("pyarrow", f"--data {spec.partition(':')[0]}:")


def _column_kind(spec: str, f, schema, column: str | None) -> tuple[str, bool]:
    """(the column, whether it is text) in one file's Arrow schema; UserError naming the columns."""
    pa = _pa(spec)
    names = list(schema.names)
    have = ", ".join(names) or "none"
    if column is None:
        column = next((c for c in ID_COLUMNS if c in names), None)
        if column is None:
            raise UserError(f"data {spec}: {f} has no column {', '.join(ID_COLUMNS)} (it has: {have}); "
                            f"name one: {spec.partition(':')[0]}:PATH#COLUMN")
    elif column not in names:
        raise UserError(f"data {spec}: {f} has no column {column!r} (it has: {have})")
    t = schema.field(column).type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return column, True
    if ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and pa.types.is_integer(t.value_type)):
        return column, False
    raise UserError(f"data {spec}: column {column!r} of {f} is {t}; expected a list of integers "
                    "(token ids) or a string (text)")


class ArrowSource(Source):
    """Rows of Arrow data in ``pieces`` ``(file index, part, rows)``: a parquet row group, or a
    whole Arrow file. Subclasses read one piece's column (:meth:`read_piece`)."""

    _transient = ("_cache",)

    def _setup(self, spec: str, files: list[Path], column: str | None, schemas, pieces) -> None:
        self.name, self.files, self.pieces = spec, files, pieces
        self.column, self.text = _column_kind(spec, files[0], schemas[0], column)
        for f, schema in zip(files[1:], schemas[1:], strict=True):
            if _column_kind(spec, f, schema, self.column)[1] != self.text:
                raise UserError(f"data {spec}: column {self.column!r} is text in {files[0]} but not in {f}")
        self._cum = np.cumsum([0] + [n for _, _, n in pieces]).astype(np.int64)
        if self._cum[-1] == 0:
            raise UserError(f"data {spec}: the source is empty (0 rows in {len(files)} file(s))")

    def read_piece(self, k: int, part):
        raise NotImplementedError(type(self).__name__)

    def piece_bytes(self, col) -> int:
        """What keeping a read piece costs in memory (a mapped Arrow file costs ~nothing)."""
        return col.nbytes

    def _piece(self, p: int):
        """Piece ``p``'s column, decoded; kept while the kept ones hold <= CACHE_BYTES, oldest
        dropped first (safe under Grain's reader threads: a lost race only re-reads a piece)."""
        if getattr(self, "_cache", None) is None:
            self._cache = OrderedDict()
        cache = self._cache
        hit = cache.get(p)
        if hit is not None:
            return hit[0]
        k, part, _ = self.pieces[p]
        col = self.read_piece(k, part)
        cache[p] = (col, self.piece_bytes(col))
        try:
            while len(cache) > 1 and sum(b for _, b in list(cache.values())) > CACHE_BYTES:
                cache.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            pass
        return col

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __getitem__(self, i):
        i = self._check_index(i)
        p = int(np.searchsorted(self._cum, i, side="right")) - 1
        j = i - int(self._cum[p])
        value = self._piece(p)[j]
        f = self.files[self.pieces[p][0]]
        if not value.is_valid:
            raise UserError(f"data {self.name}: row {j} of piece {self.pieces[p][1]} of {f} is null")
        if self.text:
            return value.as_py()
        ids = value.values
        if ids.null_count:
            raise UserError(f"data {self.name}: row {j} of piece {self.pieces[p][1]} of {f} has null token ids")
        return ids.to_numpy(zero_copy_only=False).astype(np.int32)


class ParquetSource(ArrowSource):
    """``parquet:``: pieces are row groups, read when first needed (memory-mapped files)."""

    def __init__(self, spec: str, files: list[Path], column: str | None):
        pq = require("pyarrow.parquet", "--data parquet:")
        schemas, pieces = [], []
        for k, f in enumerate(files):
            try:
                meta = pq.ParquetFile(str(f), memory_map=True)
                schemas.append(meta.schema_arrow)
                pieces += [(k, g, meta.metadata.row_group(g).num_rows)
                           for g in range(meta.metadata.num_row_groups)]
            except (OSError, ValueError, _pa(spec).ArrowException) as e:
                raise UserError(f"data {spec}: {f} is not a readable parquet file ({first_line(e)})") from None
        self._setup(spec, files, column, schemas, [p for p in pieces if p[2]])

    _transient = ("_cache", "_open")

    def read_piece(self, k: int, part):
        if getattr(self, "_open", None) is None:
            self._open = {}
        pf = self._open.get(k)
        if pf is None:  # the footer is parsed once per file and process
            pq = require("pyarrow.parquet", "--data parquet:")
            pf = self._open[k] = pq.ParquetFile(str(self.files[k]), memory_map=True)
        return pf.read_row_group(part, columns=[self.column]).column(0)


class HFDatasetSource(ArrowSource):
    """``hfds:DIR``: a ``datasets`` ``save_to_disk`` folder; pieces are its Arrow files."""

    def __init__(self, spec: str, root: Path, column: str | None):
        pa = _pa(spec)
        if not root.is_dir():
            raise UserError(f"data {spec}: {root} is not a directory" if root.exists()
                            else f"data {spec}: {root} does not exist")
        if (root / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
            raise UserError(f"data {spec}: {root} holds several splits ({', '.join(splits)}); "
                            f"name one: hfds:{root}/SPLIT")
        try:
            state = json.loads((root / "state.json").read_text())
            names = [d["filename"] for d in state["_data_files"]]
        except FileNotFoundError:
            raise UserError(f"data {spec}: {root} is not a datasets save_to_disk folder (no state.json)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"data {spec}: {root}/state.json is not a datasets state file ({first_line(e)})") from None
        files, schemas, pieces = [root / n for n in names], [], []
        if not files:
            raise UserError(f"data {spec}: {root}/state.json names no data files")
        for k, f in enumerate(files):
            if not f.is_file():
                raise UserError(f"data {spec}: {f} (named by state.json) does not exist")
            try:
                with pa.memory_map(str(f)) as mm:
                    reader = pa.ipc.open_stream(mm)
                    schemas.append(reader.schema)
                    pieces.append((k, f.name, sum(b.num_rows for b in reader)))
            except (OSError, pa.ArrowException) as e:
                raise UserError(f"data {spec}: {f} is not a readable Arrow stream file ({first_line(e)})") from None
        self._setup(spec, files, column, schemas, [p for p in pieces if p[2]])

    def piece_bytes(self, col) -> int:
        return 1 << 20  # memory-mapped: keep up to CACHE_BYTES >> 20 files open

    def read_piece(self, k: int, part):
        pa = _pa(self.name)
        return pa.ipc.open_stream(pa.memory_map(str(self.files[k]))).read_all().column(self.column)


# --------------------------------------------------------------------------------------------
# array_record
# --------------------------------------------------------------------------------------------


def _ar_module():
    return require("array_record.python.array_record_module", "--data arrayrecord:")


_NPY_HEADER = re.compile(r"\{'descr': '([<>|=]?[iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), *\}")


def decode_record(raw: bytes, where: str) -> np.ndarray:
    """One array_record record (``np.save`` bytes of a 1-D integer array) as int32 ids.

    The header ``np.save`` writes for a 1-D integer array is matched directly (np.load parses
    it with ``ast``, ~10x the cost of the rest); anything else goes through ``np.load``."""
    head = raw[:10]
    if len(head) == 10 and head[:6] == b"\x93NUMPY" and head[6] == 1:
        n = int.from_bytes(head[8:10], "little")
        m = _NPY_HEADER.fullmatch(raw[10: 10 + n].decode("latin1").rstrip("\n "))
        if m:
            dtype, count = np.dtype(m[1]), int(m[2])
            if len(raw) - 10 - n != count * dtype.itemsize:
                raise UserError(f"{where} is not an np.save array (its {len(raw) - 10 - n} data bytes "
                                f"do not hold {count} x {dtype.name})")
            return np.frombuffer(raw, dtype, count, offset=10 + n).astype(np.int32)
    try:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{where} is not an np.save array ({first_line(e)})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise UserError(f"{where} holds a {arr.ndim}-D {arr.dtype} array; expected 1-D integer token ids")
    return arr.astype(np.int32)


class ArrayRecordSource(Source):
    """``arrayrecord:``: one record per document, read through array_record's own random-access
    source (a reader per file, opened lazily in each process)."""

    _transient = ("_data",)

    def __init__(self, spec: str, files: list[Path]):
        ar = _ar_module()
        self.name, self.files, counts = spec, files, []
        for f in files:
            try:
                reader = ar.ArrayRecordReader(str(f), "readahead_buffer_size:0")
                counts.append(int(reader.num_records()))
                reader.close()
            except Exception as e:  # noqa: BLE001 (the C++ module raises bare RuntimeError/ValueError)
                raise UserError(f"data {spec}: {f} is not a readable array_record file ({first_line(e)})") from None
        self._cum = np.cumsum([0] + counts).astype(np.int64)
        if self._cum[-1] == 0:
            raise UserError(f"data {spec}: the source is empty (0 records in {len(files)} file(s))")
        self._paths = [str(f) for f, n in zip(files, counts, strict=True) if n]  # global index order
        self._data = None
        self[0]  # a file of something else than np.save arrays fails now, not in a worker

    def _source(self):
        if getattr(self, "_data", None) is None:
            require("array_record.python.array_record_data_source", "--data arrayrecord:")
            from array_record.python.array_record_data_source import ArrayRecordDataSource

            self._data = ArrayRecordDataSource(self._paths)
        return self._data

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __getitem__(self, i) -> np.ndarray:
        i = self._check_index(i)
        k = int(np.searchsorted(self._cum, i, side="right")) - 1
        where = f"data {self.name}: record {i - int(self._cum[k])} of {self.files[k]}"
        return decode_record(self._source()[i], where)


def write_arrayrecord(path, docs) -> int:
    """Write ``docs`` (1-D integer arrays) to the array_record file ``path``, one ``np.save``
    record each (what ``arrayrecord:`` reads); returns the number written. Every document is
    checked before the file is created."""
    arrays = []
    for n, d in enumerate(docs):
        a = np.asarray(d)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise UserError(f"write_arrayrecord: document {n} is a {a.ndim}-D {a.dtype} array; "
                            "expected 1-D integer token ids")
        arrays.append(a)
    writer = _ar_module().ArrayRecordWriter(str(path), "group_size:1")
    try:
        for a in arrays:
            buf = io.BytesIO()
            np.save(buf, a, allow_pickle=False)
            writer.write(buf.getvalue())
    finally:
        writer.close()
    return len(arrays)


__all__ = [
    "ID_COLUMNS",
    "ArrayRecordSource",
    "ArrowSource",
    "HFDatasetSource",
    "ParquetSource",
    "decode_record",
    "is_arrayrecord",
    "is_parquet",
    "write_arrayrecord",
]
