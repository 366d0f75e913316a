"""The Grain input pipeline behind :func:`jaxmoe.data.make_data`: order, sharding, rows, batches.

For each source of ``data.source`` (one, or the parts of a ``mix:`` spec, :mod:`.mixture`):

1. **split**: flat token streams (``default``, ``tokens:``): the last ``max(N // 50, S + 1)``
   tokens are the eval split, the rest the train split. Document sources (``text:`` and the
   document formats; flat streams in ``documents`` packing, cut at ``data.doc_sep_id``): the last
   ``ceil(n_docs / 50)`` documents are the eval split (at least one document each side).
2. **order**: the train split's elements (flat windows: window indices; else documents) in a global
   order drawn per epoch by Grain's index shuffle from ``train.seed`` (the seed combined with the
   epoch, so each epoch is reshuffled; epochs follow each other without end); the eval split in
   file order, repeated.
3. **sharding**: process ``i`` of ``n`` takes elements ``i, i + n, i + 2n, ...`` of that order, so it
   reads only its own windows/documents. Flat windows: process ``i``'s row ``k`` of batch ``b`` is
   row ``i + k*n`` of the one-process batch ``b`` (the ``n`` processes' rows together are exactly that
   batch). Packed or concatenated documents: each process packs its own documents, so the processes'
   rows together hold the same documents as one process would read, in different rows.
4. **rows** (:mod:`.packing`): text is tokenized (``Tokenize``, in the workers), then windows or
   first-fit packed documents.
5. **mixture**: the sources' rows interleaved by weight (Grain ``IterDataset.mix``).
6. **batches** of ``B_local = train.batch_size / n`` rows, prepared by ``data.workers`` Grain
   worker processes (``mp_prefetch``; 0 = in this process). For a single flat stream in windows
   packing the batches are formed before the workers (each worker makes whole batches), so the data
   are the same for any worker count; elsewhere each worker packs its own slice of the documents,
   so the rows depend on ``data.workers`` (still deterministic; a resume must keep it).

:class:`DataIterator` serves the batches; ``state()`` is the Grain iterator state (JSON) plus the
batch count, the per-source token counts and a fingerprint of what the data depend on, saved in
every checkpoint and given back to ``restore()`` on ``--resume`` (a state of other data is refused).
A single flat stream in windows packing is *portable*: batch ``b`` depends on ``b`` only, so its
position is the batch count and the pipeline restarts at that batch (any worker or process count;
a multi-process checkpoint resumes in one process). Elsewhere each process restores its own Grain
state (:func:`gather_states` collects them for the checkpoint), with the same worker and process count.
"""

from __future__ import annotations

import json
import math

import numpy as np

from jaxmoe.data.mixture import parse_data_spec
from jaxmoe.data.packing import CheckIds, Window, concat_split, pack
from jaxmoe.data.sources import open_source
from jaxmoe.data.tokenize import Tokenize
from jaxmoe.errors import UserError

EVAL_DOC_FRACTION = 50  # the eval split: 1/50 of the tokens (flat) or documents
READ_THREADS, READ_BUFFER = 2, 4  # per process/worker: Grain's read threads and elements ahead


class _Part:
    """One source of ``data.source``: opened, checked and split (no Grain objects yet)."""

    def __init__(self, spec: str, index: int, cfg, split: str):
        d = cfg.data
        S = cfg.train.seq_len
        docs_mode = d.packing == "documents"
        sep = d.doc_sep_id if d.doc_sep_id >= 0 else None
        self.spec, self.index = spec, index
        self.src = open_source(spec, doc_sep=sep if docs_mode else None)
        self.tokenize = Tokenize(d.tokenizer) if self.src.text else None
        self.flat = self.src.stream is not None and not docs_mode
        # `default` has its documents (one per standard-library file); a tokens: file has none
        # without its separator (a whole shard would be one document)
        if docs_mode and self.src.stream is not None and sep is None and spec != "default":
            raise UserError(f"data.packing=documents needs document boundaries in the flat token "
                            f"stream {spec}: set data.doc_sep_id to its separator token id")
        if self.tokenize is not None:
            self.vocab_size = self.tokenize.vocab_size
            self.max_id = self.vocab_size - 1
        elif self.src.stream is not None:
            top = self.src.max_id
            self.max_id = int(np.max(self.src.stream)) if top is None else int(top)
            self.vocab_size = self.max_id + 1
        else:
            self.max_id = self.vocab_size = None  # checked per document at read time
        if self.max_id is not None and self.max_id >= cfg.model.vocab_size:
            raise UserError(f"data {spec} has token id {self.max_id} but model.vocab_size="
                            f"{cfg.model.vocab_size}; set --set model.vocab_size={self.max_id + 1} "
                            "or larger")
        if self.flat:
            n = len(self.src.stream)
            n_eval = max(n // EVAL_DOC_FRACTION, S + 1)
            if n < n_eval + S + 1:
                raise UserError(f"data {spec} has {n} tokens, too few for one train and one eval "
                                f"sequence of train.seq_len={S} (needs >= {2 * (S + 1)}); use more "
                                "data or a shorter seq_len")
            lo, hi = (n - n_eval, n) if split == "eval" else (0, n - n_eval)
            self.start, self.n_elements = lo, (hi - lo - 1) // S
        else:
            n = len(self.src)
            n_eval = max(1, math.ceil(n / EVAL_DOC_FRACTION))
            if n < n_eval + 1:
                raise UserError(f"data {spec} has {n} document(s), too few for a train and an eval "
                                "split (needs >= 2); use more documents")
            self.start, self.n_elements = (n - n_eval, n_eval) if split == "eval" else (0, n - n_eval)

    def rows(self, cfg, split: str, pidx: int, pcount: int, seed: int, read):
        """This process's rows: a MapDataset (flat windows) or an IterDataset."""
        import grain

        t = cfg.train
        if self.flat:
            ds = grain.MapDataset.range(self.n_elements)
        else:
            ds = grain.MapDataset.source(self.src)
            if self.tokenize is None and self.max_id is None:
                ds = ds.map_with_index(CheckIds(self.spec, cfg.model.vocab_size))
            ds = ds[self.start:self.start + self.n_elements]
        ds = ds.shuffle(seed).repeat() if split == "train" else ds.repeat()
        ds = ds[pidx::pcount]
        if self.flat:
            return ds.map(Window(self.src, self.start, t.seq_len, self.index))
        if self.tokenize is not None:
            ds = ds.map(self.tokenize)
        it = ds.to_iter_dataset(read)
        if cfg.data.packing == "documents":
            bins = max(8, t.batch_size // pcount)
            return pack(it, t.seq_len, bins, cfg.data.mask_doc_start, self.index)
        return concat_split(it, t.seq_len, self.index)


class DataIterator:
    """``next_batch()`` -> this process's ``[B_local, S]`` numpy batch (see the module doc)."""

    def __init__(self, cfg, split: str = "train", *, process_index: int = 0, process_count: int = 1,
                 workers: int | None = None):
        t, d = cfg.train, cfg.data
        if split not in ("train", "eval"):
            raise UserError(f"data split {split!r} must be 'train' or 'eval'")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise UserError(f"process_index={process_index} must be in [0, {process_count})")
        if t.batch_size % process_count:
            raise UserError(f"train.batch_size={t.batch_size} is not divisible by the "
                            f"{process_count} processes")
        if d.workers < 0:
            raise UserError(f"data.workers={d.workers} must be >= 0 (0: no worker processes)")
        if d.packing not in ("windows", "documents"):
            raise UserError(f"data.packing={d.packing!r} is not 'windows' or 'documents'")
        if d.mask_doc_start and d.packing != "documents":
            raise UserError("data.mask_doc_start needs data.packing=documents (windows have no "
                            "document starts)")
        self.cfg, self.split = cfg, split
        self.name, self.seq_len, self.seed, self.batch_size = d.source, t.seq_len, int(t.seed), t.batch_size
        self.process_index, self.process_count = process_index, process_count
        self.local_batch = t.batch_size // process_count
        self.workers = d.workers if workers is None else workers
        self.weights = parse_data_spec(d.source)
        self.parts = [_Part(spec, i, cfg, split) for i, (_, spec) in enumerate(self.weights)]
        known = [p.vocab_size for p in self.parts if p.vocab_size is not None]
        self.vocab_size = max(known) if known else 0
        self.max_id = max((p.max_id for p in self.parts if p.max_id is not None), default=-1)
        self.n_windows = self.parts[0].n_elements if len(self.parts) == 1 else None
        # one flat stream in windows: batch b is a pure function of b, the same for any worker count,
        # and the processes' rows are the one-process batch: a position is just b (any process count)
        self.portable = len(self.parts) == 1 and self.parts[0].flat
        self._start = 0  # portable: the batch the pipeline starts at
        self._it = None
        self.batch_index = 0
        self.tokens = {p.spec: 0 for p in self.parts}

    # -- the Grain pipeline -------------------------------------------------------------------
    def dataset(self):
        """The Grain ``IterDataset`` of this process's batches."""
        import grain

        cfg, Bl = self.cfg, self.local_batch
        read = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=READ_BUFFER)
        rows = [p.rows(cfg, self.split, self.process_index, self.process_count,
                       (self.seed + 7919 * p.index) % 2**32, read) for p in self.parts]
        if self.portable:
            ds = rows[0].batch(Bl)
            ds = (ds[self._start:] if self._start else ds).to_iter_dataset(read)
        else:
            rows = [r.to_iter_dataset(read) if isinstance(r, grain.MapDataset) else r for r in rows]
            ds = rows[0] if len(rows) == 1 else grain.IterDataset.mix(rows, [w for w, _ in self.weights])
            ds = ds.batch(Bl)
        if self.workers > 0:
            from absl import flags  # grain's workers read absl flags; a non-absl program parses none

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        return ds

    def _iterator(self):
        if self._it is None:
            self._it = iter(self.dataset())
        return self._it

    def next_batch(self) -> dict:
        """The next batch: int32 ``inputs``/``targets``, float32 ``mask`` (+ ``segment_ids``,
        ``positions`` in documents packing), ``[B_local, S]``."""
        # plain arrays: a worker's batch lives in shared memory that must be released now, not at exit
        b = {k: np.array(v) for k, v in next(self._iterator()).items()}
        src = b.pop("source")
        real = (b["segment_ids"] > 0).sum(axis=1) if "segment_ids" in b else np.full(len(src), self.seq_len)
        for p in self.parts:
            self.tokens[p.spec] += int(real[src == p.index].sum())
        self.batch_index += 1
        return b

    # -- position -------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        d = self.cfg.data  # the keys are those of the checkpoints written before the config split
        fp = {"data": self.name, "split": self.split, "seed": self.seed, "seq_len": self.seq_len,
              "batch_size": self.batch_size, "packing": d.packing, "mask_doc_start": d.mask_doc_start,
              "doc_sep_id": d.doc_sep_id}
        if not self.portable:
            fp.update(data_workers=self.workers, process_count=self.process_count)
        return fp

    def state(self) -> dict:
        """JSON-serialisable position: Grain's iterator state, batches served, token counts."""
        grain_state = None if self._it is None else self._it.get_state()
        return {"batch_index": self.batch_index, "grain": grain_state, "tokens": dict(self.tokens),
                **self._fingerprint()}

    def restore(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; refuses a state of different data.

        ``{"seek_batch": b}``: a position known only as a batch count (a run continued from
        another framework's checkpoint, :mod:`jaxmoe.train.titan_resume`): served from batch ``b``
        on, which only a portable pipeline (one flat stream in windows packing) can do."""
        if "seek_batch" in state:
            if not self.portable:
                raise UserError(f"data {self.name}: this run continues at batch {state['seek_batch']} of another "
                                "framework's run, a position that only one tokens:/default source in "
                                "data.packing=windows can take; use such a source for the resumed run")
            self.close()
            self.batch_index = self._start = int(state["seek_batch"])
            self.tokens = {p.spec: 0 for p in self.parts}
            return
        if "processes" in state:  # a multi-process checkpoint: one state per process
            procs = state["processes"]
            if self.portable:
                procs = procs[:1] * self.process_count  # the same batch count on every process
            if len(procs) != self.process_count:
                raise UserError(f"data position was saved by {len(procs)} processes, this run has "
                                f"{self.process_count}; resume with the same number of processes")
            state = procs[self.process_index]
        mine = self._fingerprint()
        diff = [k for k in mine if state.get(k) != mine[k]]
        if diff or "grain" not in state:
            what = ", ".join(f"{k}: saved {state.get(k)!r} vs now {mine[k]!r}" for k in diff)
            what = what or "no Grain state: saved by an older jaxmoe"
            raise UserError(f"data position does not match this data ({what}); resume with the same "
                            "data.source, seed, seq_len, batch_size, packing and data_workers")
        self.close()
        self.batch_index = int(state["batch_index"])
        self.tokens = {p.spec: int(state["tokens"].get(p.spec, 0)) for p in self.parts}
        if self.portable:
            self._start = self.batch_index  # the pipeline restarts at that batch
        elif state["grain"] is not None:
            self._iterator().set_state(state["grain"])

    def reset(self) -> None:
        """Back to the first batch (e.g. to evaluate on the same eval batches every time)."""
        self.close()
        self.batch_index = self._start = 0
        self.tokens = {p.spec: 0 for p in self.parts}

    def close(self) -> None:
        """Stop the worker processes (if any); the next batch starts them again."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None


def gather_states(state: dict, process_count: int) -> dict:
    """Every process's data state (a collective when there are several processes): what a
    checkpoint saves, since process 0 writes the checkpoint's JSON for all of them."""
    if process_count == 1:
        return state
    from jax.experimental import multihost_utils  # late: the pipeline itself never needs jax

    raw = np.frombuffer(json.dumps(state).encode(), dtype=np.uint8)
    n = int(np.max(multihost_utils.process_allgather(np.int32(len(raw)))))
    padded = np.zeros(n, np.uint8)
    padded[:len(raw)] = raw
    every = np.asarray(multihost_utils.process_allgather(padded))
    return {"processes": [json.loads(bytes(r).rstrip(b"\0").decode()) for r in every]}


__all__ = ["DataIterator", "gather_states"]
