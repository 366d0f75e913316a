"""``jaxmoe train --init-from SRC``: start a run from the weights of a checkpoint.

``SRC`` is ``hf:DIR`` (a HuggingFace checkpoint), ``orbax:DIR[@STEP]`` (a jaxmoe run directory,
its latest or the given step) or ``torch:FILE.safetensors`` (torch_ref's file). The run gets:

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

import jax
import numpy as np

from jaxmoe.config import Config, _apply, parse_override, validate
from jaxmoe.errors import ConfigError, UserError
from jaxmoe.model.transformer import abstract_params, model_declarations
from jaxmoe.port import sources
from jaxmoe.port.convert import open_source, parse_endpoint
from jaxmoe.port.hf_map import flatten, unflatten

MODEL_SECTIONS = ("model", "moe")


def _fingerprint(src) -> str:
    """A content fingerprint of the source (cheap at any size)."""
    fn = getattr(sources, "source_fingerprint", None)
    if fn is not None:
        return fn(src.ep)
    import hashlib

    h = hashlib.sha256()
    for key in sorted(src.keys()):
        h.update(f"{key}:{src.shapes[key]}:{src.leaf_dtype(key)};".encode())
    for f in sorted(p for p in ([src.ep.path] if src.ep.path.is_file() else src.ep.path.rglob("*"))
                    if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)};".encode())
    return "sha256:" + h.hexdigest()


def open_init_source(spec: str):
    """The opened source of ``--init-from SPEC`` (validated: config and tensor headers agree)."""
    return open_source(parse_endpoint(spec, "--init-from"))


def config_from_source(base: Config, src, overrides) -> Config:
    """``base`` with its model sections taken from the source, then the user's model overrides,
    checked to keep every tensor's shape."""
    cfg = Config(**{s: dataclasses.replace(getattr(base, s)) for s in ("model", "moe", "mesh", "train")},
                 description=base.description)
    for s in MODEL_SECTIONS:
        setattr(cfg, s, dataclasses.replace(getattr(src.cfg, s)))
    for text in overrides:
        section, key, value = parse_override(text)
        if section in MODEL_SECTIONS:
            _apply(cfg, section, key, value)
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


__all__ = ["config_from_source", "load_weights", "open_init_source"]
