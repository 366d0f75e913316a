"""``jaxmoe train --init-from SRC``: start a run from the weights of a checkpoint.

``SRC`` is ``hf:DIR`` (a HuggingFace checkpoint), ``orbax:DIR[@STEP]`` (a jaxmoe run directory,
its latest or the given step), ``torch:FILE.safetensors`` (torch_ref's file) or ``dcp:STEP_DIR``
(a torchtitan checkpoint step, with ``--titan`` naming its model): any source of
:data:`jaxmoe.port.formats.FORMATS`, with its format options (``--titan``). The run gets:

* the *model* -- the ``[model]`` and ``[moe]`` config sections -- from the source (its
  config.json / config.toml / metadata), with ``--set model.*`` / ``--set moe.*`` overrides
  allowed only where every parameter keeps its shape (a mismatch is one line naming the tensor
  and both shapes); training, mesh and data settings from ``--preset`` / ``--config`` / flags;
* the weights (and expert biases) from the source, read one leaf at a time and placed straight
  onto their shardings, so host memory holds about one leaf (jaxmoe.port's readers);
* a fresh optimizer state and learning-rate schedule (step 0).

The source and a fingerprint of its contents go into the run record (``run.json``), so an
interrupted run can be resumed -- or restarted from step 0 if it never saved -- and a source that
changed in between is refused rather than silently mixed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import jax
import numpy as np

from jaxmoe.config import SECTIONS, Config, apply_setting, parse_override, validate
from jaxmoe.errors import ConfigError, UserError
from jaxmoe.model.transformer import abstract_params, model_declarations
from jaxmoe.port.formats import bind_options, open_source, parse_endpoint
from jaxmoe.port.io.hf_meta import keep_in_run_dir, meta_files
from jaxmoe.port.maps.hf_map import flatten, unflatten

MODEL_SECTIONS = ("model", "moe")


# Sources up to this size are hashed in full; larger ones (a 671B checkpoint is 1.3 TB) by every
# file's name, size, safetensors header and 1 MiB at its start, middle and end.
FULL_HASH_BYTES = 4 * 2**30
_SAMPLE = 2**20


def fingerprint(src) -> str:
    """A content hash of the opened source's files (``Source.content_files``): ``sha256:<hex>``
    of every file's bytes (sources up to :data:`FULL_HASH_BYTES`), else
    ``sha256-sampled:<hex>`` over each file's name, size, safetensors header and three 1 MiB
    samples (cheap at any size; any re-save changes the headers or sizes, an in-place edit of a
    large file's middle may go unnoticed)."""
    files = src.content_files()
    root = Path(src.ep.path)
    total = sum(f.stat().st_size for f in files)
    full = total <= FULL_HASH_BYTES
    h = hashlib.sha256()
    for f in files:
        rel = f.name if root.is_file() else str(f.relative_to(root))
        size = f.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if full:
                for block in iter(lambda: fh.read(16 * 2**20), b""):
                    h.update(block)
                continue
            if f.suffix == ".safetensors" and size >= 8:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, size - 8)))
            for off in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return ("sha256:" if full else "sha256-sampled:") + h.hexdigest()


def open_init_source(spec: str, options: dict | None = None):
    """The opened source of ``--init-from SPEC`` (validated: config and tensor headers agree),
    with the source format options ``options`` (name -> value or None, e.g. ``{"titan": ...}``).
    ``orbax:DIR@STEP`` opens that checkpoint step (default: the newest). Its ``spec`` and
    ``ep.options`` are what the run record keeps: absolute, with the step actually read."""
    ep, _ = bind_options(dict(options or {}), source=parse_endpoint(spec, "--init-from"))
    return open_source(ep)


def record_source_files(src, run_dir) -> list[str]:
    """Copy the source's non-weight HF files (tokenizer, generation config, the original
    config.json with its token ids) into ``RUN_DIR/hf_meta/``, so that converting the run back
    to ``hf:`` restores them (see :mod:`jaxmoe.port.io.hf_meta`)."""
    return keep_in_run_dir(meta_files(src.meta_dir), Path(run_dir))


def config_from_source(base: Config, src, overrides) -> Config:
    """``base`` with its model sections taken from the source, then the user's model overrides,
    checked to keep every tensor's shape."""
    cfg = Config(**{s: dataclasses.replace(getattr(base, s)) for s in SECTIONS}, description=base.description)
    for s in MODEL_SECTIONS:
        setattr(cfg, s, dataclasses.replace(getattr(src.cfg, s)))
    for text in overrides:
        section, key, value = parse_override(text)
        if section in MODEL_SECTIONS:
            apply_setting(cfg, section, key, value)
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds the source model's "
                          f"max_position_embeddings={cfg.model.max_seq_len}; lower train.seq_len")
    validate(cfg)
    decl = model_declarations(cfg)
    for key, shape in src.shapes.items():
        path = key.split("/", 1)[1]
        d = decl.get(path)
        if d is None:
            raise UserError(f"--init-from {src.ep}: tensor {path} {list(shape)} has no place in the "
                            "model of the overridden config; drop the --set that removes it")
        if tuple(d.shape) != tuple(shape):
            raise UserError(f"--init-from {src.ep}: tensor {path} is {list(shape)} in the source but "
                            f"{list(d.shape)} with the --set overrides; only overrides that keep "
                            "every shape are allowed")
    return cfg


def load_weights(cfg: Config, src, shardings: dict | None = None) -> tuple[dict, dict]:
    """``(params, buffers)`` of ``cfg``'s model from the source, leaf by leaf: each leaf is read
    (fp32), placed on its sharding (``shardings``: ``{"params": ..., "buffers": ...}`` trees, or
    None for the default device) and released before the next. Declared buffers the source lacks
    (an expert bias for a model that had none) start at their declared init (zeros)."""
    decl = model_declarations(cfg)
    abs_params, abs_buffers = abstract_params(cfg)
    flat_shard = {}
    if shardings is not None:
        for top in ("params", "buffers"):
            flat_shard.update({f"{top}/{k}": v for k, v in flatten(dict(shardings.get(top) or {})).items()})
    out = {}
    for key in src.keys():
        arr = src.read_leaf(key, np.dtype(np.float32))
        sh = flat_shard.get(key)
        out[key] = _place(arr, sh)
        del arr
    for path, d in decl.items():
        key = ("params/" if d.trained else "buffers/") + path
        if key in out:
            continue
        if d.trained:
            raise UserError(f"--init-from {src.ep}: the source has no tensor for {path}")
        out[key] = _place(np.zeros(d.shape, np.float32), flat_shard.get(key))
    tree = unflatten(out)
    params, buffers = tree.get("params", {}), tree.get("buffers", {})
    want = jax.tree_util.tree_structure((abs_params, abs_buffers))
    if jax.tree_util.tree_structure((params, buffers)) != want:
        raise UserError(f"--init-from {src.ep}: the source's tensors do not form this model's layout")
    return params, buffers


def _place(arr: np.ndarray, sharding):
    if sharding is None:
        return jax.device_put(arr)
    if jax.process_count() == 1:
        return jax.device_put(arr, sharding)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


__all__ = ["config_from_source", "fingerprint", "load_weights", "open_init_source",
           "record_source_files"]
