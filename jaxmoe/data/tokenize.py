"""Tokenizers: bytes (vocab 256) or a HuggingFace ``tokenizers`` file; :class:`Tokenize`, the
picklable text -> ids map the data pipeline runs in its workers; the ``jaxmoe tokenizer`` command.

A text document becomes its ids followed by ``<|endoftext|>`` when the tokenizer has that token
(the byte tokenizer has none), so documents stay separated in a token stream.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from jaxmoe.data.sources import first_line, open_source
from jaxmoe.errors import UserError
from jaxmoe.extras import require

EOT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255)."""

    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.int64).astype(np.uint8).tolist()).decode(
            "utf-8", errors="replace"
        )


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (a ``tokenizer.json``) with :class:`ByteTokenizer`'s interface;
    ``encode`` adds no special tokens."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size())
        self.eot_id = tok.token_to_id(EOT)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)


def load_tokenizer(path: str | None):
    """``None`` (or ``""``): :class:`ByteTokenizer`; else the ``tokenizers`` JSON file at ``path``
    as an :class:`HFTokenizer`. Either has ``encode(str) -> int32 ids``, ``vocab_size``, ``eot_id``."""
    if not path:
        return ByteTokenizer()
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"tokenizer file {p} does not exist (data.tokenizer)")
    Tokenizer = require("tokenizers", "data.tokenizer").Tokenizer  # late: the optional [text] extra
    try:
        return HFTokenizer(Tokenizer.from_file(str(p)))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on bad JSON)
        raise UserError(f"tokenizer file {p} is not a valid tokenizer.json: {first_line(e)}") from None


class Tokenize:
    """Text document -> ``np.int32`` ids (+ ``eot_id`` when the tokenizer has one), for a Grain
    ``.map``. The tokenizer is loaded here once (checks, ``vocab_size``, ``eot_id``) and again,
    lazily, in each process the callable is pickled to. Text data needs a tokenizer file (as
    before the Grain pipeline): no path is an error, not a silent byte-level vocabulary."""

    def __init__(self, tokenizer_path: str | None):
        if not tokenizer_path:
            raise UserError("text data needs a tokenizer: --set data.tokenizer=PATH/tokenizer.json "
                            "(make one with `jaxmoe tokenizer`)")
        self.tokenizer_path = tokenizer_path
        self._tok = load_tokenizer(self.tokenizer_path)
        self.vocab_size, self.eot_id = self._tok.vocab_size, self._tok.eot_id

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tok"}

    def __setstate__(self, state):
        self.__dict__.update(state, _tok=None)

    def __call__(self, text: str) -> np.ndarray:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        ids = self._tok.encode(text)
        return ids if self.eot_id is None else np.append(ids, np.int32(self.eot_id))

    def __repr__(self) -> str:
        return f"Tokenize({self.tokenizer_path!r})"


# --------------------------------------------------------------------------------------------
# `jaxmoe tokenizer`
# --------------------------------------------------------------------------------------------


def add_args_tokenizer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", required=True, metavar="PATH",
                   help=".txt/.jsonl file, directory or glob (repeatable); JSONL field 'text'")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (>= 257)")
    p.add_argument("--out", required=True, help="where to write tokenizer.json")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")


def train_tokenizer(inputs, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with special token ``<|endoftext|>``, trained on
    the documents of ``inputs`` (``text:`` paths), streamed one at a time."""
    tk = require("tokenizers", "jaxmoe tokenizer")  # late: the optional [text] extra
    Tokenizer, decoders, models = tk.Tokenizer, tk.decoders, tk.models
    pre_tokenizers, trainers = tk.pre_tokenizers, tk.trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(f"--vocab-size={vocab_size} must be >= {len(alphabet) + 1} "
                        "(256 byte tokens + <|endoftext|>)")
    sources = [open_source(f"text:{path}") for path in inputs]  # every path checked before training
    seen = []

    def documents():
        for src in sources:
            for i in range(len(src)):
                doc = src[i]
                if not seen and doc.strip():
                    seen.append(True)
                yield doc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(documents(), trainer=trainer)
    if not seen:
        raise UserError(f"tokenizer: no text in {', '.join(map(str, inputs))}")
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
    "EOT",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenize",
    "add_args_tokenizer",
    "load_tokenizer",
    "run_tokenizer",
    "train_tokenizer",
]
