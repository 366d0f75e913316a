"""Rows of ``S`` tokens from token streams and documents: fixed windows, or packed documents.

Every transform here is a picklable Grain map (they run in the ``data.workers`` processes).

``windows`` (``data.packing="windows"``, the default): a row is ``S + 1`` consecutive tokens
``w``: ``inputs = w[:-1]``, ``targets = w[1:]``, ``mask`` all 1. Flat streams are cut at
multiples of ``S`` (:class:`Window`: window ``k`` = ``t[k*S : k*S + S + 1]``, so neighbouring
windows share one token); document sources are concatenated, then split into ``S + 1``-token
windows (Grain's ``ConcatThenSplitIterDataset``); windows run across document boundaries, unmasked.

``documents`` (``data.packing="documents"``): a document ``d`` (ending with its separator /
end-of-text token when the source has one) gives the pairs ``inputs = d[:-1]``, ``targets = d[1:]``;
they are cut into pieces of at most ``S`` pairs (:class:`Pieces`: piece ``k`` holds pairs
``k*S ... k*S + S - 1``; a one-token document gives nothing). Each piece is its own segment: its
positions restart at 0 and it attends only to itself (the attention cannot reach the piece before
it, so continuing the positions would only shift RoPE). Pieces are packed **first-fit** (Grain's
``FirstFitPackIterDataset``): each piece goes into the first of ``bins`` open rows with room for
it; when none has room, the open rows are emitted (in order) and a new set is opened. First-fit
over a window of rows keeps the document order nearly intact and needs no look-ahead or sort, so the
packing is a pure function of the order (deterministic, resumable from Grain's state), and with
``bins`` >= 8 rows the padding is small for documents much shorter than ``S``. A packed row has
``segment_ids`` (pieces numbered 1, 2, ... within the row, 0 = padding), ``positions`` (0 at a
piece's first token) and ``mask`` (1 on every real target, 0 on padding; with
``data.mask_doc_start`` also 0 on the first target of each document, the prediction of its second
token from its first alone -- a continuation piece keeps its first target).
"""

from __future__ import annotations

import numpy as np

from jaxmoe.errors import UserError


class Window:
    """Flat stream window ``k`` as a row (see the module doc); ``source`` tags mixtures."""

    def __init__(self, src, start: int, seq_len: int, source_id: int = 0):
        self.src, self.start, self.S, self.source_id = src, int(start), int(seq_len), source_id

    def __call__(self, k: int) -> dict:
        a = self.start + int(k) * self.S
        w = np.asarray(self.src.stream[a:a + self.S + 1], dtype=np.int32)
        return {"inputs": w[:-1], "targets": w[1:], "mask": np.ones(self.S, np.float32),
                "source": np.int32(self.source_id)}


class CheckIds:
    """Refuses a document holding an id >= ``vocab`` (index-aware map, before the shuffle)."""

    def __init__(self, name: str, vocab: int):
        self.name, self.vocab = name, int(vocab)

    def __call__(self, i: int, doc):
        d = np.asarray(doc)
        if d.ndim != 1:
            raise UserError(f"data {self.name}: document {i} is a {d.ndim}-D array, expected 1-D ids")
        if len(d) and (int(d.max()) >= self.vocab or int(d.min()) < 0):
            bad = int(d.max()) if int(d.max()) >= self.vocab else int(d.min())
            raise UserError(f"data {self.name}: document {i} has token id {bad} but model.vocab_size="
                            f"{self.vocab}; set --set model.vocab_size={max(bad + 1, self.vocab)} "
                            "or larger")
        return d.astype(np.int32, copy=False)


class AsTokens:
    """A document as ``{"tokens": ids}`` for concat-then-split."""

    def __call__(self, doc) -> dict:
        return {"tokens": np.asarray(doc, dtype=np.int32)}


class SplitWindow:
    """A concat-then-split ``S + 1``-token window as a row."""

    def __init__(self, source_id: int = 0):
        self.source_id = source_id

    def __call__(self, el: dict) -> dict:
        w = el["tokens"]
        return {"inputs": w[:-1], "targets": w[1:], "mask": np.ones(len(w) - 1, np.float32),
                "source": np.int32(self.source_id)}


def pieces(doc, seq_len: int, mask_doc_start: bool) -> list[dict]:
    """The ``(inputs, targets, mask)`` pieces of one document (see the module doc)."""
    d = np.asarray(doc, dtype=np.int32)
    out = []
    for k in range(0, len(d) - 1, seq_len):
        inp = d[k:min(k + seq_len, len(d) - 1)]
        m = np.ones(len(inp), np.float32)
        if k == 0 and mask_doc_start:
            m[0] = 0.0
        out.append({"inputs": inp, "targets": d[k + 1:k + 1 + len(inp)], "mask": m})
    return out


def _flat_map_base():
    from grain import experimental as gx  # grain: only inside jaxmoe.data, imported late

    return gx.FlatMapTransform


class Pieces(_flat_map_base()):
    """Grain flat-map: document -> its pieces (any number: the iterator form has no fan-out cap)."""

    max_fan_out = 1 << 30

    def __init__(self, seq_len: int, mask_doc_start: bool):
        self.S, self.mask_doc_start = int(seq_len), bool(mask_doc_start)

    def flat_map(self, doc):
        return pieces(doc, self.S, self.mask_doc_start)


class PackedRow:
    """A packed Grain row -> the batch contract's row (``segment_ids``/``positions`` of inputs)."""

    def __init__(self, source_id: int = 0):
        self.source_id = source_id

    def __call__(self, el: dict) -> dict:
        return {"inputs": el["inputs"], "targets": el["targets"], "mask": el["mask"],
                "segment_ids": el["inputs_segment_ids"].astype(np.int32),
                "positions": el["inputs_positions"].astype(np.int32),
                "source": np.int32(self.source_id)}


def pack(ds, seq_len: int, bins: int, mask_doc_start: bool, source_id: int):
    """IterDataset of documents (int32 ids) -> IterDataset of packed rows."""
    from grain import experimental as gx

    ds = gx.FlatMapIterDataset(ds, Pieces(seq_len, mask_doc_start))
    S = int(seq_len)
    ds = gx.FirstFitPackIterDataset(ds, length_struct={"inputs": S, "targets": S, "mask": S},
                                    num_packing_bins=bins, shuffle_bins=False)
    return ds.map(PackedRow(source_id))


def concat_split(ds, seq_len: int, source_id: int):
    """IterDataset of documents -> IterDataset of ``S + 1``-token window rows."""
    from grain import experimental as gx

    ds = gx.ConcatThenSplitIterDataset(ds.map(AsTokens()), length_struct={"tokens": seq_len + 1})
    return ds.map(SplitWindow(source_id))


__all__ = ["AsTokens", "CheckIds", "PackedRow", "Pieces", "SplitWindow", "Window", "concat_split",
           "pack", "pieces"]
