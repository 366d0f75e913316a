"""Training data: sources, tokenization and the Grain pipeline that turns them into batches.

* :mod:`jaxmoe.data.sources` -- ``data.source`` sources (``default``: the standard library's ``.py``
  files as bytes, vocab 256; ``tokens:PATH``; ``text:PATH``; ...), :mod:`jaxmoe.data.tokenize` --
  tokenizers.
* :mod:`jaxmoe.data.mixture` -- ``mix:W*SPEC,...`` mixtures.
* :mod:`jaxmoe.data.packing` -- rows: fixed windows (``data.packing="windows"``) or documents
  packed first-fit with ``segment_ids``/``positions`` (``"documents"``).
* :mod:`jaxmoe.data.pipeline` -- order, per-process sharding, batches, worker processes and the
  resumable iterator state (:class:`DataIterator`).

Grain is imported only when batches are made, so ``import jaxmoe`` and ``jaxmoe tokenizer`` work
without it. ``jaxmoe tokenizer`` (train a byte-level BPE tokenizer) is in :mod:`jaxmoe.data.tokenize`.
"""

from __future__ import annotations

from jaxmoe.extras import require


def make_data(cfg, split: str = "train", *, process_index: int = 0, process_count: int = 1,
              workers: int | None = None):
    """The :class:`~jaxmoe.data.pipeline.DataIterator` of ``cfg.data.source`` for this process
    (``workers``: override ``data.workers``); every check that can be made up front is made
    here (nothing is read past the sources' headers and token ranges)."""
    require("grain", "training data")
    from jaxmoe.data.pipeline import DataIterator

    return DataIterator(cfg, split, process_index=process_index, process_count=process_count,
                        workers=workers)


def gather_states(state: dict, process_count: int) -> dict:
    """Every process's data state, for the checkpoint (see :func:`jaxmoe.data.pipeline.gather_states`)."""
    from jaxmoe.data.pipeline import gather_states as gather

    return gather(state, process_count)


__all__ = ["gather_states", "make_data"]
