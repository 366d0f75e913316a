"""Training data: a token stream cut into fixed-length windows, served in a seeded, resumable order.

Sources (``train.data``):

* ``default``: the Python standard library's own ``.py`` sources (every machine has them; nothing
  is downloaded), bytes as tokens (:class:`ByteTokenizer`, vocab 256).
* ``tokens:PATH``: a pre-tokenized file, memory-mapped. ``.npy`` (dtype uint16 or uint32, read
  from the header) or raw ``.bin``: little-endian **uint16**, or **uint32** when the name ends in
  ``.u32.bin`` (the dtype is part of the file name so that a file cannot be read with the wrong
  width by accident).
* ``text:PATH``: a ``.txt`` / ``.jsonl`` file, or a directory holding them (searched
  recursively, sorted). A ``.txt`` file is one document; each JSONL line is one document, its
  ``"text"`` field. Tokenized with the HuggingFace ``tokenizers`` file ``train.tokenizer``;
  documents are joined with ``<|endoftext|>`` when the tokenizer has that token.

How batches are made (all sources): the token stream ``t`` of ``N`` tokens is split into a
training part and a held-out tail (``split="eval"``): the last ``max(N // 50, S + 1)`` tokens.
A part holds ``W = (len - 1) // S`` windows; window ``w`` gives ``inputs = t[w*S : w*S+S]`` and
``targets = t[w*S+1 : w*S+S+1]``. The training split visits windows epoch by epoch, each epoch
in the order ``np.random.default_rng([seed, epoch]).permutation(W)``; the eval split in order
0, 1, 2, ... (wrapping). Global row ``r`` (counting rows of all batches so far) is window
``order[r % W]`` of epoch ``r // W``. Batch ``b`` is rows ``b*B ... b*B+B-1``; process ``i`` of
``n`` takes rows ``i*B/n ... (i+1)*B/n - 1`` of it, and reads only those windows from disk. The
position is just ``b``, so ``state()``/``restore()`` are exact and cheap.
"""

from __future__ import annotations

import argparse
import functools
import json
import sysconfig
from pathlib import Path

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.extras import require

EOT = "<|endoftext|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# --------------------------------------------------------------------------------------------
# Tokenizers and corpora
# --------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255)."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.int64).astype(np.uint8).tolist()).decode(
            "utf-8", errors="replace"
        )


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (``sysconfig`` "stdlib"), sorted by relative path.

    Installed packages (``site-packages``) and the test suites (which some distributions strip)
    are left out, so the corpus depends only on the Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(
            f"default corpus: the Python standard library source directory {root} is missing; "
            "use --set train.data=tokens:PATH or text:PATH"
        )
    files = [
        p
        for p in root.rglob("*.py")
        if not (_SKIP_DIRS & set(p.relative_to(root).parts[:-1])) and p.is_file()
    ]
    if not files:
        raise UserError(
            f"default corpus: no .py files under {root}; use --set train.data=tokens:PATH or text:PATH"
        )
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=1)
def _default_tokens() -> np.ndarray:
    """The default corpus as one uint8 byte stream (files joined with a blank line)."""
    parts = [p.read_bytes() + b"\n\n" for p in default_corpus_files()]
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


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
    """Yield the documents of a .txt/.jsonl file or directory (see the module docstring)."""
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


def _load_tokenizer(path_str: str):
    if not path_str:
        raise UserError(
            "text data needs a tokenizer: --set train.tokenizer=PATH/tokenizer.json "
            "(make one with `jaxmoe tokenizer`)"
        )
    path = Path(path_str)
    if not path.is_file():
        raise UserError(f"tokenizer file {path} does not exist (train.tokenizer)")
    # late: tokenizers is the optional [text] extra
    Tokenizer = require("tokenizers", "--data text:").Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on bad JSON)
        raise UserError(f"tokenizer file {path} is not a valid tokenizer.json: {e}") from None


def _text_tokens(path: Path, tokenizer) -> np.ndarray:
    eot = tokenizer.token_to_id(EOT)
    docs = list(iter_documents(path))
    ids: list[np.ndarray] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.append(np.asarray(enc.ids, dtype=np.uint32))
        if eot is not None:
            ids.append(np.asarray([eot], dtype=np.uint32))
    return np.concatenate(ids) if ids else np.zeros(0, np.uint32)


def _token_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise UserError(f"token file {path} does not exist (train.data=tokens:PATH)")
    if path.suffix == ".npy":
        try:  # object arrays need pickle (refused), truncated files fail to map: both bad input
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise UserError(f"token file {path}: not a readable .npy token array "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
            raise UserError(
                f"token file {path}: expected a 1-D uint16 or uint32 array, got {arr.ndim}-D {arr.dtype}"
            )
        return arr
    if path.suffix == ".bin":
        dtype = np.dtype("<u4") if path.name.endswith(".u32.bin") else np.dtype("<u2")
        if path.stat().st_size % dtype.itemsize:
            raise UserError(
                f"token file {path}: size {path.stat().st_size} is not a multiple of "
                f"{dtype.itemsize} bytes ({dtype.name}; name it *.u32.bin for uint32)"
            )
        if path.stat().st_size == 0:
            return np.zeros(0, dtype)
        return np.memmap(path, dtype=dtype, mode="r")
    raise UserError(f"token file {path}: expected a .bin or .npy file")


# --------------------------------------------------------------------------------------------
# DataSource
# --------------------------------------------------------------------------------------------


class DataSource:
    """Serves ``{"inputs", "targets", "mask"}`` batches of this process's rows; resumable.

    ``vocab_size`` is the tokenizer's (byte: 256; text: the tokenizer's vocabulary) or, for token
    files, the largest id in the file + 1. ``max_id`` is the largest id the data can contain.
    """

    def __init__(self, tokens: np.ndarray, *, name: str, vocab_size: int, max_id: int,
                 split: str, seq_len: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if split not in ("train", "eval"):
            raise UserError(f"data split {split!r} must be 'train' or 'eval'")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise UserError(f"process_index={process_index} must be in [0, {process_count})")
        if batch_size % process_count:
            raise UserError(
                f"train.batch_size={batch_size} is not divisible by the {process_count} processes"
            )
        S = seq_len
        n = len(tokens)
        n_eval = max(n // 50, S + 1)
        if n < n_eval + S + 1:
            raise UserError(
                f"data {name} has {n} tokens, too few for one train and one eval sequence of "
                f"train.seq_len={S} (needs >= {2 * (S + 1)}); use more data or a shorter seq_len"
            )
        self.tokens = tokens[n - n_eval:] if split == "eval" else tokens[: n - n_eval]
        self.name, self.split, self.seq_len, self.seed = name, split, S, int(seed)
        self.vocab_size, self.max_id = int(vocab_size), int(max_id)
        self.batch_size = batch_size
        self.local_batch = batch_size // process_count
        self.process_index, self.process_count = process_index, process_count
        self.n_windows = (len(self.tokens) - 1) // S
        self.batch_index = 0
        self._epoch, self._order = -1, None

    def _window_order(self, epoch: int) -> np.ndarray:
        if self.split == "eval":
            return np.arange(self.n_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        return self._order

    def next_batch(self) -> dict:
        """The next batch: int32 ``inputs``/``targets`` and float32 ``mask``, ``[B_local, S]``."""
        S = self.seq_len
        first = self.batch_index * self.batch_size + self.process_index * self.local_batch
        rows = []
        for r in range(first, first + self.local_batch):
            w = int(self._window_order(r // self.n_windows)[r % self.n_windows])
            rows.append(np.asarray(self.tokens[w * S: w * S + S + 1], dtype=np.int32))
        self.batch_index += 1
        block = np.stack(rows)
        return {
            "inputs": block[:, :-1],
            "targets": block[:, 1:],
            "mask": np.ones((self.local_batch, S), np.float32),
        }

    def _fingerprint(self) -> dict:
        return {"data": self.name, "split": self.split, "seed": self.seed,
                "seq_len": self.seq_len, "batch_size": self.batch_size,
                "n_windows": self.n_windows}

    def state(self) -> dict:
        """JSON-serialisable position (the number of batches served) plus what it depends on."""
        return {"batch_index": self.batch_index, **self._fingerprint()}

    def restore(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; refuses a state of different data."""
        mine = self._fingerprint()
        diff = [k for k in mine if k in state and state[k] != mine[k]]
        if diff or "batch_index" not in state:
            what = ", ".join(f"{k}: saved {state.get(k)!r} vs now {mine[k]!r}" for k in diff)
            raise UserError(f"data position does not match this data ({what or 'no batch_index'}); "
                            "resume with the same train.data, seed, seq_len and batch_size")
        self.batch_index = int(state["batch_index"])

    def reset(self) -> None:
        """Back to the first batch (e.g. to evaluate on the same eval batches every time)."""
        self.batch_index = 0


def validate_vocab(source: DataSource, cfg) -> None:
    """UserError when the data can hold a token id the model cannot embed."""
    if source.max_id >= cfg.model.vocab_size:
        raise UserError(
            f"data {source.name} has token id {source.max_id} but model.vocab_size="
            f"{cfg.model.vocab_size}; set --set model.vocab_size={source.max_id + 1} or larger"
        )


def make_data(cfg, split: str = "train", *, process_index: int = 0,
              process_count: int = 1) -> DataSource:
    """The :class:`DataSource` of ``cfg.train.data`` (see the module docstring), vocab-checked."""
    t = cfg.train
    spec = t.data
    common = dict(split=split, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                  process_index=process_index, process_count=process_count)
    if spec == "default":
        src = DataSource(_default_tokens(), name="default", vocab_size=256, max_id=255, **common)
    elif spec.startswith("tokens:"):
        path = Path(spec[len("tokens:"):]).expanduser()
        tokens = _token_file(path)
        if len(tokens) == 0:
            raise UserError(f"token file {path} is empty")
        top = int(tokens.max())
        src = DataSource(tokens, name=spec, vocab_size=top + 1, max_id=top, **common)
    elif spec.startswith("text:"):
        path = Path(spec[len("text:"):]).expanduser()
        if not path.exists():
            raise UserError(f"text data: {path} does not exist (train.data=text:PATH)")
        tok = _load_tokenizer(t.tokenizer)
        tokens = _text_tokens(path, tok)
        if len(tokens) == 0:
            raise UserError(f"text data {path} is empty")
        vocab = tok.get_vocab_size()
        src = DataSource(tokens, name=spec, vocab_size=vocab, max_id=vocab - 1, **common)
    else:
        raise UserError(
            f"train.data={spec!r} is not 'default', 'tokens:PATH' or 'text:PATH'"
        )
    validate_vocab(src, cfg)
    return src


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
    "DataSource",
    "add_args_tokenizer",
    "default_corpus_files",
    "iter_documents",
    "make_data",
    "run_tokenizer",
    "train_tokenizer",
    "validate_vocab",
]
