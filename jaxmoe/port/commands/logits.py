"""Running a checkpoint: fp32 logits in jaxmoe, torch_ref or HF transformers; ``--verify``.

:func:`compute_logits` runs any checkpoint (see :mod:`jaxmoe.port.formats`) in one framework,
converted first (:func:`jaxmoe.port.commands.convert.convert`) when the framework's own loader cannot read
it as it is (a source says so: ``Source.hub_files`` for torch_ref, ``Source.hf_dir`` for
transformers).
``jaxmoe convert --verify`` (:mod:`jaxmoe.port.commands.verify`) runs the source and destination in two
frameworks on a fixed probe batch and compares logits (:func:`compare_logits`, :data:`TOLERANCES`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.extras import installed
from jaxmoe.port.commands.convert import convert, load_numpy_tree
from jaxmoe.port.formats import open_source, parse_endpoint
from jaxmoe.port.formats.base import Endpoint, shape_text
from jaxmoe.port.maps.hf_map import hf_layer_index

# Logit comparison tolerances for --verify. fp32 on both sides: the two frameworks compute the
# same math in a different order. bfloat16: the weights themselves are rounded to 8 mantissa
# bits (relative error up to 2**-9 per weight), which moves logits by ~1e-2 on the tiny presets;
# top-1 agreement is reported but not gated (random-init models have many near-ties).
TOLERANCES = {
    "float32": {"kl": 1e-6, "max_abs": 1e-4},
    "bfloat16": {"kl": 1e-3, "max_abs": 5e-2},
}
PROBE_SHAPE = (2, 16)
PROBE_SEED = 0


# --------------------------------------------------------------------------------------------
# Running a checkpoint: logits in jaxmoe, torch_ref or HF transformers
# --------------------------------------------------------------------------------------------


def check_tokens(tokens: np.ndarray, cfg: Config, what: str = "tokens") -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.size == 0:
        raise UserError(f"{what}: expected token ids of shape [batch, seq], got {shape_text(tokens.shape)}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"{what}: token ids must be integers, got {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.model.vocab_size:
        bad = lo if lo < 0 else hi
        raise UserError(f"{what}: token id {bad} is outside the vocabulary "
                        f"[0, {cfg.model.vocab_size}) of this checkpoint")
    if tokens.shape[1] > cfg.model.max_seq_len:
        raise UserError(f"{what}: sequence length {tokens.shape[1]} exceeds model.max_seq_len="
                        f"{cfg.model.max_seq_len}")
    return tokens.astype(np.int32)


def _jax_logits(ep: Endpoint, tokens: np.ndarray) -> np.ndarray:
    # late: each runner imports only its own framework (heavy; torch, transformers optional)
    import jax
    import jax.numpy as jnp

    from jaxmoe.model.transformer import apply_model

    cfg, params, buffers = load_numpy_tree(ep)
    check_tokens(tokens, cfg)
    params = jax.tree.map(jnp.asarray, params)
    buffers = jax.tree.map(jnp.asarray, buffers)
    logits, _aux = apply_model(cfg, params, buffers, jnp.asarray(tokens))
    return np.asarray(logits, dtype=np.float32)


def _readable(ep: Endpoint, get, copy_as: str):
    """``(cfg, get(source), endpoint)`` for ``ep``; when ``get`` gives None (the framework's
    loader cannot read ``ep`` as it is), for a float32 copy of ``ep`` converted to the endpoint
    ``copy_as``."""
    with open_source(ep) as source:
        cfg, got = source.cfg, get(source)
    if got is None:
        ep = parse_endpoint(copy_as)
        convert(source.ep, ep, dtype="float32", log=lambda m: None)
        with open_source(ep) as source:
            cfg, got = source.cfg, get(source)
    return cfg, got, ep


def torch_ref_model(cfg: Config, files: dict[str, Path], where: str):
    """torch_ref's model of ``cfg`` (fp32, eval mode) loaded by torch_ref's own loader from
    HF hub-named tensors (``Source.hub_files``: name -> file); tensors of layers past ``cfg``'s
    (a truncated model, multi-token-prediction layers) are skipped."""
    import torch

    from torch_ref import hf_io
    from torch_ref.transformer import TorchTransformer

    def skip(name):
        i = hf_layer_index(name)
        return i is not None and i >= cfg.model.n_layers

    model = TorchTransformer(cfg)
    hf_io._load_into(model, files, where, torch.float32, skip)
    return model.float().eval()


def _torch_logits(ep: Endpoint, tokens: np.ndarray) -> np.ndarray:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        # torch_ref reads the per-expert hub names; other checkpoints go through a torch: file
        cfg, files, ep = _readable(ep, lambda s: s.hub_files,
                                   f"torch:{Path(tmp) / 'model.safetensors'}")
        check_tokens(tokens, cfg)
        model = torch_ref_model(cfg, files, str(ep.path))
        with torch.no_grad():
            out = model(torch.from_numpy(np.asarray(tokens, np.int64)))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.float().numpy()


def _hf_logits(ep: Endpoint, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        cfg, hf_dir, _ = _readable(ep, lambda s: s.hf_dir, f"hf:{Path(tmp) / 'hf'}")
        check_tokens(tokens, cfg)
        cls = getattr(transformers, get_arch(cfg.model.hf_arch).hf_class)
        model = cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64))).logits
    return logits.float().numpy()


FRAMEWORKS = {"jax": _jax_logits, "torch": _torch_logits, "hf": _hf_logits}


# what each framework needs beyond jaxmoe's own dependencies (the `[ref]` extra installs them)
NEEDS = {"jax": (), "torch": ("torch",), "hf": ("torch", "transformers")}


def available(framework: str) -> bool:
    """Whether ``framework``'s packages are installed."""
    return all(installed(m) for m in NEEDS[framework])


def require(framework: str) -> None:
    """UserError naming the ``[ref]`` extra when ``framework``'s packages are not installed."""
    missing = [m for m in NEEDS[framework] if not installed(m)]
    if missing:
        raise UserError(f"--framework {framework} needs {' and '.join(missing)}, which is not "
                        "installed; install the reference extra: pip install 'jaxmoe[ref]'")


def compute_logits(ep: Endpoint, tokens: np.ndarray, framework: str = "jax") -> np.ndarray:
    """fp32 logits [batch, seq, vocab] of checkpoint ``ep`` on ``tokens`` in ``framework``:
    ``jax`` (jaxmoe), ``torch`` (torch_ref) or ``hf`` (transformers' own model class, loaded with
    ``from_pretrained`` from an HF directory, other kinds converted to one first)."""
    if framework not in FRAMEWORKS:
        raise UserError(f"--framework {framework!r}: choose {', '.join(FRAMEWORKS)}")
    require(framework)
    return FRAMEWORKS[framework](ep, np.asarray(tokens))


def compare_logits(ref: np.ndarray, out: np.ndarray) -> dict:
    """max |ref - out|, mean KL(softmax(ref) || softmax(out)) per position, top-1 agreement."""
    a = np.asarray(ref, np.float64)
    b = np.asarray(out, np.float64)
    if a.shape != b.shape:
        raise UserError(f"logit shapes differ: {shape_text(a.shape)} vs {shape_text(b.shape)}")
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return {
        "max_abs": float(np.abs(a - b).max()),
        "kl": float(max(kl.mean(), 0.0)),
        "top1": float((a.argmax(-1) == b.argmax(-1)).mean()),
    }


__all__ = [
    "PROBE_SEED", "PROBE_SHAPE", "TOLERANCES", "available", "check_tokens", "compare_logits",
    "compute_logits", "torch_ref_model",
]
