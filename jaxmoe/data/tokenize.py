"""Tokenizers (TEMPORARY minimal version, replaced at merge by branch ``src``'s module)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
            "utf-8", errors="replace")


class _HFTokenizer:
    def __init__(self, tok):
        self.tok, self.vocab_size, self.eot_id = tok, tok.get_vocab_size(), tok.token_to_id(EOT)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def load_tokenizer(path: str | None):
    if not path:
        raise UserError("text data needs a tokenizer: --set train.tokenizer=PATH/tokenizer.json "
                        "(make one with `jaxmoe tokenizer`)")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"tokenizer file {p} does not exist (train.tokenizer)")
    Tokenizer = require("tokenizers", "--data text:").Tokenizer
    try:
        return _HFTokenizer(Tokenizer.from_file(str(p)))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on bad JSON)
        raise UserError(f"tokenizer file {p} is not a valid tokenizer.json: {e}") from None


class Tokenize:
    """Picklable map: str -> int32 ids (+ eot when the tokenizer has one); lazy per worker."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer_path = tokenizer_path
        tok = load_tokenizer(tokenizer_path)
        self.vocab_size, self.eot_id = tok.vocab_size, tok.eot_id
        self._tok = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tok"} | {"_tok": None}

    def __call__(self, text: str) -> np.ndarray:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        ids = self._tok.encode(text)
        return ids if self.eot_id is None else np.r_[ids, np.int32(self.eot_id)].astype(np.int32)
