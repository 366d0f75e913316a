"""Training data: sources, tokenization and the Grain pipeline that turns them into batches.

* :mod:`jaxmoe.data.sources` -- ``train.data`` sources (``default``: the standard library's ``.py``
  files as bytes, vocab 256; ``tokens:PATH``; ``text:PATH``; ...), :mod:`jaxmoe.data.tokenize` --
  tokenizers.
* :mod:`jaxmoe.data.mixture` -- ``mix:W*SPEC,...`` mixtures.
* :mod:`jaxmoe.data.packing` -- rows: fixed windows (``train.packing="windows"``) or documents
  packed first-fit with ``segment_ids``/``positions`` (``"documents"``).
* :mod:`jaxmoe.data.pipeline` -- order, per-process sharding, batches, worker processes and the
  resumable iterator state (:class:`DataIterator`).

Grain is imported only when batches are made, so ``import jaxmoe`` and ``jaxmoe tokenizer`` work
without it. This module also holds ``jaxmoe tokenizer`` (train a byte-level BPE tokenizer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxmoe.data.sources import default_corpus_files, iter_documents
from jaxmoe.data.tokenize import EOT, ByteTokenizer
from jaxmoe.errors import UserError
from jaxmoe.extras import require


def make_data(cfg, split: str = "train", *, process_index: int = 0, process_count: int = 1,
              workers: int | None = None):
    """The :class:`~jaxmoe.data.pipeline.DataIterator` of ``cfg.train.data`` for this process
    (``workers``: override ``train.data_workers``); every check that can be made up front is made
    here (nothing is read past the sources' headers and token ranges)."""
    require("grain", "training data")
    from jaxmoe.data.pipeline import DataIterator

    return DataIterator(cfg, split, process_index=process_index, process_count=process_count,
                        workers=workers)


def gather_states(state: dict, process_count: int) -> dict:
    """Every process's data state, for the checkpoint (see :func:`jaxmoe.data.pipeline.gather_states`)."""
    from jaxmoe.data.pipeline import gather_states as gather

    return gather(state, process_count)


# --------------------------------------------------------------------------------------------
# `jaxmoe tokenizer`
# --------------------------------------------------------------------------------------------


def add_args_tokenizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", required=True, metavar="PATH",
                   help=".txt/.jsonl file or directory (repeatable); JSONL field 'text'")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (>= 257)")
    p.add_argument("--out", required=True, help="where to write tokenizer.json")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")


def train_tokenizer(inputs, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with special token ``<|endoftext|>``."""
    tk = require("tokenizers", "jaxmoe tokenizer")  # late: the optional [text] extra
    Tokenizer, decoders, models = tk.Tokenizer, tk.decoders, tk.models
    pre_tokenizers, trainers = tk.pre_tokenizers, tk.trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(f"--vocab-size={vocab_size} must be >= {len(alphabet) + 1} "
                        "(256 byte tokens + <|endoftext|>)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet, show_progress=False)
    docs = [d for path in inputs for d in iter_documents(Path(path))]
    if not any(d.strip() for d in docs):
        raise UserError(f"tokenizer: no text in {', '.join(map(str, inputs))}")
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def run_tokenizer(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"{out} exists; pass --force to overwrite it")
    tok = train_tokenizer(args.input, args.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"wrote {out}: byte-level BPE, vocab {tok.get_vocab_size()}")
    return 0


__all__ = [
    "ByteTokenizer",
    "add_args_tokenizer",
    "default_corpus_files",
    "gather_states",
    "iter_documents",
    "make_data",
    "run_tokenizer",
    "train_tokenizer",
]
