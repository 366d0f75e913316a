"""``jaxmoe convert --verify``: run both sides of a conversion in *different* frameworks.

A conversion is only checked when the written files are read by something other than the mapping
that wrote them. So one side always runs in jaxmoe (JAX), reading its checkpoint through
jaxmoe's own readers, and the other side runs in PyTorch reading the HF / torch_ref files with its
own loader: HF transformers for ``hf:`` (``from_pretrained``, which knows nothing of jaxmoe's
mapping), torch_ref for ``torch:`` files (``torch_ref.hf_io``: state-dict names, no
:mod:`jaxmoe.port.maps.hf_map`). Each format names the frameworks that read it with their own loader
(``Format.verify_frameworks``: ``jax`` for jaxmoe's own ``orbax:``, ``titan`` -- torchtitan's own
model of the flavor, :mod:`jaxmoe.port.commands.verify_titan` -- for ``dcp:``), and :func:`sides` picks:

* a ``dcp:`` endpoint: each side in its own format's framework -- torchtitan on the DCP step,
  jaxmoe on a run dir, transformers / torch_ref on HF / torch files (``dcp: -> dcp:`` runs
  torchtitan on both), so the DCP side is never read through :mod:`jaxmoe.port.maps.titan_map`. A
  ``dcp:`` destination holds no config: it is run as the source's model (its torchtitan flavor,
  :func:`jaxmoe.port.commands.verify_titan.dcp_destination`). Where torchtitan has no model of the config
  (a jaxmoe preset / ``.toml`` as ``--titan``), that side runs in jaxmoe and a ``note:`` says so;
* destination read by jaxmoe itself (``orbax``): the source in its own framework (PyTorch for
  ``hf|torch``, jaxmoe for ``orbax``), jaxmoe on the written run dir;
* otherwise (``-> hf|torch``): jaxmoe on the source (through the mapping), PyTorch on the
  written files.

A transposed, swapped or misplaced tensor in the written files therefore changes one side's
logits and fails the check (``tests/test_convert_verify.py`` injects such errors).

``--verify-layers N`` runs both sides as a model truncated to its first ``N`` layers (same
embedding, final norm and head): only those layers' tensors are read (slices of the Orbax leaves,
see :mod:`jaxmoe.checkpoint.orbax_read`; only those tensors of the HF files), so a checkpoint far larger
than memory is verified on one machine (torchtitan builds the flavor with its first ``N`` layers).
Besides the truncated model's logits, the hidden state after each of the first ``N - 1`` layers is
compared where both sides give it -- jaxmoe, transformers (``output_hidden_states``) and torchtitan
(hooks on its layers); the last layer's output is checked through the logits.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxmoe.archs import get_arch
from jaxmoe.config import Config, validate
from jaxmoe.errors import UserError
from jaxmoe.extras import require
from jaxmoe.port.commands.logits import (
    PROBE_SEED,
    PROBE_SHAPE,
    TOLERANCES,
    available,
    check_tokens,
    compare_logits,
    torch_ref_model,
)
from jaxmoe.port.commands.verify_titan import TITAN, dcp_destination, titan_side, usable
from jaxmoe.port.formats import open_source
from jaxmoe.port.formats.base import Endpoint
from jaxmoe.port.maps.hf_map import unflatten


def truncated(cfg: Config, n_layers: int | None) -> Config:
    """``cfg`` for the first ``n_layers`` layers (None: unchanged), fp32 compute, dropless."""
    m = cfg.model
    if n_layers is not None:
        if n_layers < 1:
            raise UserError(f"--verify-layers {n_layers}: give a number of layers >= 1")
        n = min(int(n_layers), m.n_layers)
        m = dataclasses.replace(m, n_layers=n, first_k_dense=min(m.first_k_dense, n))
    moe = dataclasses.replace(cfg.moe, capacity_factor=0.0)  # HF and torch_ref are dropless
    compute = dataclasses.replace(cfg.compute, dtype="float32")
    return validate(dataclasses.replace(cfg, model=m, moe=moe, compute=compute))


def _rows(key: str, cfg: Config) -> int | None:
    """How many rows of leaf ``key`` the (truncated) ``cfg`` holds; None: a global leaf."""
    path = key.split("/", 1)[1]
    stack = path.split("/", 1)[0] if "/" in path else None
    if stack == "dense":
        return cfg.model.first_k_dense
    if stack == "moe":
        return cfg.model.n_moe_layers
    return None


def jax_side(ep: Endpoint, tokens: np.ndarray, n_layers: int | None = None):
    """jaxmoe on ``ep``: ``(logits, hidden [n-1, B, S, D])`` of the (truncated) model."""
    import jax.numpy as jnp  # late: jax only when a model runs

    from jaxmoe.model.transformer import apply_model

    source = open_source(ep)
    try:
        cfg = truncated(source.cfg, n_layers)
        check_tokens(tokens, cfg)
        flat = {}
        for key in source.keys():
            rows = _rows(key, cfg)
            if rows == 0:
                continue
            if n_layers is None or rows is None:
                flat[key] = source.read_leaf(key, np.dtype(np.float32))
            else:
                flat[key] = source.read_rows(key, rows, np.dtype(np.float32))
    finally:
        source.close()
    tree = unflatten({k: jnp.asarray(v) for k, v in flat.items()})
    del flat
    logits, aux = apply_model(cfg, tree.get("params", {}), tree.get("buffers", {}),
                              jnp.asarray(tokens), return_probes=True)
    pr = aux["probes"]
    ffn = jnp.concatenate([pr["ffn_out"], pr["moe_out"]], axis=0)  # layer order: dense, moe
    hidden = pr["embedding"][None] + jnp.cumsum(pr["attn_out"] + ffn, axis=0)
    return np.asarray(logits, np.float32), np.asarray(hidden[:-1], np.float32)


def _cfg_of(ep: Endpoint) -> Config:
    with open_source(ep) as source:
        return source.cfg


def hf_side(ep: Endpoint, tokens: np.ndarray, n_layers: int | None = None):
    """HF transformers on a checkpoint it reads as it is (``Source.hf_dir``):
    ``(logits, hidden [n-1, B, S, D])``."""
    torch = require("torch", "jaxmoe convert --verify")
    transformers = require("transformers", "jaxmoe convert --verify")
    with open_source(ep) as source:
        cfg, hf_dir = source.cfg, source.hf_dir
    check_tokens(tokens, cfg)
    quiet = getattr(getattr(transformers.utils, "logging", None), "disable_progress_bar", None)
    if quiet is not None:  # no "Loading weights" bar in the middle of convert's output
        quiet()
    cls = getattr(transformers, get_arch(cfg.model.hf_arch).hf_class)
    kw = {} if n_layers is None else {"num_hidden_layers": min(n_layers, cfg.model.n_layers)}
    tlog = transformers.utils.logging
    level = tlog.get_verbosity()
    tlog.set_verbosity_error()  # a truncated load lists every skipped layer's tensor as unexpected
    try:
        model = cls.from_pretrained(str(hf_dir), dtype=torch.float32, **kw).eval()
    finally:
        tlog.set_verbosity(level)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)),
                    output_hidden_states=True)
    n = model.config.num_hidden_layers
    # hidden_states: (embeddings, output of layer 0, ..., output of layer n-2, final norm(...))
    hidden = np.stack([h.float().numpy() for h in out.hidden_states[1:n]]) if n > 1 else None
    return out.logits.float().numpy(), hidden


def torch_ref_side(ep: Endpoint, tokens: np.ndarray, n_layers: int | None = None):
    """torch_ref on a checkpoint of HF hub-named tensors (``Source.hub_files``: an ``hf:`` dir in
    the per-expert layout, a ``torch:`` file), with its own loader: ``(logits, None)``."""
    torch = require("torch", "jaxmoe convert --verify")
    require("torch_ref.hf_io", "jaxmoe convert --verify")

    with open_source(ep) as source:
        cfg, files = truncated(source.cfg, n_layers), source.hub_files
    if files is None:
        raise UserError(f"{ep}: torch_ref reads per-expert HF tensor names only, which this "
                        "checkpoint does not have; install transformers to verify it")
    check_tokens(tokens, cfg)
    model = torch_ref_model(cfg, files, str(ep.path))
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(tokens, np.int64)))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.float().numpy(), None


def _framework(ep: Endpoint, notes: list[str] | None = None) -> str:
    """The first of the format's own frameworks that runs ``ep`` (installed; for ``titan``, a
    model torchtitan has: :func:`jaxmoe.port.commands.verify_titan.usable`, else a ``note:`` in ``notes``),
    else its last, whose runner then names what to install."""
    fws = ep.format.verify_frameworks
    for fw in fws:
        if fw == TITAN:
            ok, why = usable(ep)
            if ok:
                return fw
            if notes is not None:
                notes.append(f"note: {ep}: torchtitan has no model of it ({why}): --verify runs jaxmoe "
                             "on this side")
        elif available(fw):
            return fw
    return fws[-1]


def sides(src: Endpoint, dst: Endpoint, notes: list[str] | None = None) -> tuple[str, str]:
    """(source framework, destination framework): one jaxmoe, one PyTorch where a format allows;
    with torchtitan on either side (``dcp:``), each side in its own format's framework."""
    s, d = _framework(src, notes), _framework(dst, notes)
    if TITAN in (s, d) or d == "jax":
        return s, d
    return "jax", d


RUNNERS = {"jax": jax_side, "hf": hf_side, "torch": torch_ref_side, TITAN: titan_side}


def verify(src: Endpoint, dst: Endpoint, dtype: str, layers: int | None = None) -> dict:
    """Run both sides on a fixed probe batch; figures + pass/fail against TOLERANCES[dtype]
    (``note:`` lines, also printed on stderr, in ``notes``)."""
    with tempfile.TemporaryDirectory(prefix="jaxmoe-verify-") as scratch:
        if TITAN in dst.format.verify_frameworks and not dst.options.get("titan"):
            dst = dcp_destination(dst, _cfg_of(src), Path(scratch))  # a dcp: step holds no config
        notes: list[str] = []
        src_fw, dst_fw = sides(src, dst, notes)
        if src_fw == dst_fw == "jax" and not notes:  # (a torchtitan fallback note says it already)
            notes.append(f"note: {src} -> {dst}: both sides run in jaxmoe (jax) through its own readers, so "
                         "--verify checks that the copy reads back the same, not the mapping (a format "
                         "another framework reads, hf: / torch: / dcp:, is checked by that framework)")
        for note in notes:
            print(note, file=sys.stderr)
        figures = _run(src, dst, src_fw, dst_fw, dtype, layers)
    figures["notes"] = notes
    return figures


def _run(src: Endpoint, dst: Endpoint, src_fw: str, dst_fw: str, dtype: str, layers: int | None) -> dict:
    cfg = _cfg_of(dst)
    rng = np.random.default_rng(PROBE_SEED)
    tokens = rng.integers(0, cfg.model.vocab_size, PROBE_SHAPE).astype(np.int32)
    ref, ref_h = RUNNERS[src_fw](src, tokens, layers)
    out, out_h = RUNNERS[dst_fw](dst, tokens, layers)
    figures = compare_logits(ref, out)
    tol = TOLERANCES[dtype]
    ok = figures["kl"] <= tol["kl"] and figures["max_abs"] <= tol["max_abs"]
    if ref_h is not None and out_h is not None:
        if ref_h.shape != out_h.shape:
            raise UserError(f"hidden-state shapes differ: {list(ref_h.shape)} vs {list(out_h.shape)}")
        # per layer, relative to that layer's activation scale (the residual stream grows)
        scale = np.maximum(np.abs(ref_h).max(axis=(1, 2, 3)), 1.0)
        per_layer = np.abs(ref_h - out_h).max(axis=(1, 2, 3)) / scale
        figures["hidden_rel_max_abs"] = [float(x) for x in per_layer]
        ok = ok and bool(np.all(per_layer <= tol["max_abs"]))
    figures.update({
        "src_framework": src_fw, "dst_framework": dst_fw, "tokens": list(PROBE_SHAPE),
        "layers": layers if layers is None else min(layers, cfg.model.n_layers),
        "tolerance": tol, "ok": bool(ok),
    })
    return figures


__all__ = ["hf_side", "jax_side", "sides", "titan_side", "torch_ref_side", "truncated", "verify"]
