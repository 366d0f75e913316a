"""``jaxmoe convert`` and ``jaxmoe logits``: move weights between HF, torch_ref and jaxmoe (Orbax).

Checkpoint endpoints (``--from`` / ``--to`` / ``--ckpt``):

* ``hf:DIR``      a HuggingFace checkpoint directory: ``config.json`` + ``model.safetensors`` or
                  sharded ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``;
                  hub tensor names of the config's architecture (see :mod:`jaxmoe.port.hf_map`).
* ``torch:FILE``  torch_ref's single file: HF tensor names, the jaxmoe config as JSON in the
                  safetensors metadata under ``"jaxmoe_config"``.
* ``orbax:DIR``   a jaxmoe run dir (``config.toml`` + ``checkpoints/<step>/``), latest step.

How a conversion runs (:func:`convert`):

1. Open the source: read its config and every tensor header, and check them against the mapping
   table built from that config (missing / extra / mis-shaped tensors, i.e. also a config.json that
   contradicts the weights). Any problem -> one-line :class:`UserError`, nothing written.
2. Write into a hidden temporary sibling of DST, one jaxmoe leaf at a time: a leaf (e.g. all
   experts of all MoE layers, ``[Lm, E, D, I]``) is assembled from, or split into, its HF tensors.
   Peak memory is about the largest leaf plus one HF tensor, not the model. For an ``orbax:``
   destination the leaves are assembled in files next to DST and streamed into Orbax (see
   :class:`OrbaxSink`), so peak memory does not grow with the model either.
3. Rename the temporary into place (replacing DST only with ``--force``); on any failure the
   temporary is removed, so DST is either the complete result or untouched.

``--verify`` then runs the source and destination checkpoints in two frameworks on a fixed probe
batch and compares logits (:func:`compare_logits`, tolerances in :data:`TOLERANCES`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmoe.config import Config, config_from_dict, load_config, validate
from jaxmoe.errors import UserError
from jaxmoe.port import hf_map
from jaxmoe.port.safetensors_io import (
    FLOAT_DTYPES,
    SafetensorsReader,
    SafetensorsWriter,
    dequantize_fp8,
    parse_size,
)

KINDS = ("hf", "orbax", "torch")
TORCH_CONFIG_KEY = "jaxmoe_config"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

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
# Endpoints
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    kind: str  # "hf" | "orbax" | "torch"
    path: Path

    def __str__(self) -> str:
        return f"{self.kind}:{self.path}"


def parse_endpoint(text: str, flag: str = "checkpoint") -> Endpoint:
    kind, sep, path = str(text).partition(":")
    if not sep or kind not in KINDS or not path:
        raise UserError(f"{flag} {text!r}: expected hf:DIR, orbax:DIR or torch:FILE.safetensors")
    if kind == "torch" and not path.endswith(".safetensors"):
        raise UserError(f"{flag} {text!r}: a torch: checkpoint is a .safetensors file")
    return Endpoint(kind, Path(path))


def _float_dtype(name: str | None):
    if name is None:
        return None
    if name not in FLOAT_DTYPES:
        raise UserError(f"--dtype {name!r}: choose float32 or bfloat16")
    return FLOAT_DTYPES[name]


def _transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = 128) -> None:
    """``dst[...] = src.T`` for 2-D arrays, in column tiles.

    A plain ``dst[...] = src.T`` walks one side with a large stride and ran ~1.6x slower than this
    on the bench's [512, 1024] expert matrices; tiles of 128 keep both sides in cache.
    """
    if src.ndim != 2:
        dst[...] = src.T
        return
    for j in range(0, src.shape[0], tile):
        dst[:, j : j + tile] = src[j : j + tile].T


def _transposed(src: np.ndarray, dtype=None) -> np.ndarray:
    """A contiguous copy of ``src.T`` (optionally cast), made with :func:`_transpose_into`."""
    out = np.empty(src.shape[::-1], dtype or src.dtype)
    _transpose_into(out, src)
    return out


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


# --------------------------------------------------------------------------------------------
# Sources: give jaxmoe leaves (numpy arrays) one at a time
# --------------------------------------------------------------------------------------------


class TensorSource:
    """An HF directory or torch_ref file, viewed as jaxmoe leaves.

    Construction reads the config and every header and validates them against the mapping; the
    tensors themselves are read only by :meth:`read_leaf`.
    """

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.notices: list[str] = []
        self.fp8_block = (128, 128)
        if ep.kind == "hf":
            if not ep.path.is_dir():
                raise UserError(f"{ep}: not a directory")
            cfg_file = ep.path / "config.json"
            if not cfg_file.exists():
                raise UserError(f"{ep}: config.json is missing")
            try:
                hf_cfg = json.loads(cfg_file.read_text())
            except ValueError as e:
                raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
            from jaxmoe.hfconfig import from_hf_config

            self.cfg = from_hf_config(hf_cfg)
            q = hf_cfg.get("quantization_config") or {}
            if q.get("weight_block_size"):
                self.fp8_block = tuple(int(b) for b in q["weight_block_size"])
            self.reader = SafetensorsReader(ep.path)
            what = "config.json"
        else:
            if not ep.path.is_file():
                raise UserError(f"{ep}: no such file")
            self.reader = SafetensorsReader(ep.path)
            raw = self.reader.metadata.get(TORCH_CONFIG_KEY)
            if raw is None:
                raise UserError(f"{ep}: no {TORCH_CONFIG_KEY!r} in the safetensors metadata "
                                "(not a torch_ref file?)")
            try:
                self.cfg = validate(config_from_dict(json.loads(raw)))
            except ValueError as e:
                raise UserError(f"{ep}: bad {TORCH_CONFIG_KEY} metadata ({e})") from None
            what = "its jaxmoe_config"
        self.table = hf_map.entries(self.cfg)
        self.groups = hf_map.leaf_entries(self.cfg, self.table)
        self.shapes = hf_map.leaf_shapes(self.cfg, self.table)
        self._validate(what)

    def _validate(self, what: str) -> None:
        r, cfg = self.reader, self.cfg
        expected = {e.hf_name: e for e in self.table}
        # problems in hub order: mis-shaped, then missing, then unexpected tensors
        shaped, missing, extra, mtp = [], [], [], {}
        for name, ent in expected.items():
            if name not in r:
                missing.append(f"missing tensor {name} (expected shape {_shape(ent.hf_shape)} "
                               f"from {what})")
            elif tuple(r.shape(name)) != ent.hf_shape:
                shaped.append(f"tensor {name} has shape {_shape(r.shape(name))} in the "
                              f"checkpoint but {what} implies {_shape(ent.hf_shape)}")
            elif r.dtype(name) == FP8 and name + "_scale_inv" not in r:
                shaped.append(f"tensor {name} is float8 without {name}_scale_inv")
        for name in r.names():
            if name in expected or name.endswith(hf_map.IGNORED_SUFFIXES):
                continue
            layer = hf_map.hf_layer_index(name)
            if layer is not None and layer >= cfg.model.n_layers:
                mtp[layer] = mtp.get(layer, 0) + 1
                continue
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in expected:
                continue  # consumed by FP8 dequantisation
            extra.append(f"unexpected tensor {name} {_shape(r.shape(name))}: {what} has no "
                         "such weight")
        problems = shaped + missing + extra
        for ent in self.table:
            if ent.key == hf_map.ZERO and ent.hf_name in r and not problems:
                if np.any(r.get(ent.hf_name).astype(np.float32) != 0):
                    problems.append(f"tensor {ent.hf_name} is non-zero but {what} disables it "
                                    "(set moe.use_expert_bias=true / topk_method noaux_tc)")
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise UserError(f"{self.ep}: {problems[0]}{more}")
        if mtp:
            layers = ", ".join(f"model.layers.{i}.*" for i in sorted(mtp))
            self.notices.append(f"note: skipping {layers} ({sum(mtp.values())} tensors): "
                                "multi-token-prediction layers are not part of jaxmoe")

    def keys(self) -> list[str]:
        return list(self.groups)

    def leaf_dtype(self, key: str) -> np.dtype:
        """The dtype the leaf has in the source (float32 after FP8 dequantisation)."""
        if key.startswith("buffers/"):
            return np.dtype(np.float32)
        dts = {self.reader.dtype(e.hf_name) for e in self.groups[key]}
        if len(dts) == 1 and FP8 not in dts:
            return dts.pop()
        return np.dtype(np.float32)

    def tensor(self, name: str) -> np.ndarray:
        arr = self.reader.get(name)
        if arr.dtype == FP8:
            arr = dequantize_fp8(arr, self.reader.get(name + "_scale_inv"), self.fp8_block)
        return arr

    def read_leaf(self, key: str, dtype=None, out: np.ndarray | None = None) -> np.ndarray:
        """The leaf ``key`` as an array of ``dtype``, assembled from its HF tensors.

        ``out`` (optional, the leaf's shape and dtype) receives it instead of a new array; when
        it is file-backed (``np.memmap``), its pages are dropped from this process after each HF
        tensor, so memory holds about one HF tensor rather than the leaf.
        """
        if out is None:
            out = np.empty(self.shapes[key], dtype or self.leaf_dtype(key))
            release = None
        else:
            from jaxmoe.checkpoint import release_pages as release
        for ent in self.groups[key]:
            slot = out[ent.index]
            if not ent.transpose and self.reader.dtype(ent.hf_name) == out.dtype != FP8:
                self.reader.read_into(ent.hf_name, slot)  # no temporary
            else:
                t = self.tensor(ent.hf_name)
                if ent.transpose:
                    _transpose_into(out[ent.index], t)
                else:
                    out[ent.index] = t
                del t
            if release is not None:
                release(out)
        return out

    def close(self) -> None:
        pass


class OrbaxSource:
    """A jaxmoe run dir (latest checkpoint), read one leaf at a time.

    The run dir layout is :mod:`jaxmoe.checkpoint`'s (``checkpoints/<step>/state`` holds the
    ``{"params", "buffers", ...}`` pytree). Shapes come from Orbax's tree metadata (no array is
    read); :meth:`read_leaf` restores a single leaf as a numpy array with Orbax's
    ``partial_restore``, so memory stays at one leaf. Only ``params`` and ``buffers`` are read, so
    training checkpoints (with optimizer state) convert too.
    """

    def __init__(self, ep: Endpoint):
        import orbax.checkpoint as ocp

        from jaxmoe.checkpoint import Checkpointer

        self.ep = ep
        self.notices: list[str] = []
        if not (ep.path / "config.toml").is_file():
            raise UserError(f"{ep}: not a jaxmoe run dir (no config.toml)")
        if not (ep.path / "checkpoints").is_dir():
            raise UserError(f"{ep}: not a jaxmoe run dir (no checkpoints/)")
        self.cfg = load_config(path=ep.path / "config.toml")
        ckpt = Checkpointer(ep.path / "checkpoints", async_save=False)
        try:
            step = ckpt.latest_step()
        finally:
            ckpt.close()
        if step is None:
            raise UserError(f"{ep}: no committed checkpoint in {ep.path / 'checkpoints'}")
        self.step = step
        self.state_dir = (ep.path / "checkpoints" / str(step) / "state").absolute()
        self._ocp = ocp
        self._ckptr = ocp.PyTreeCheckpointer()
        try:
            meta = self._ckptr.metadata(self.state_dir)
            tree = getattr(meta, "item_metadata", meta)  # StepMetadata (orbax >= 0.11)
            tree = getattr(tree, "tree", tree)
            flat = {}
            for top in ("params", "buffers"):
                for k, v in hf_map.flatten(dict(tree.get(top) or {})).items():
                    flat[f"{top}/{k}"] = (tuple(v.shape), np.dtype(v.dtype))
        except Exception as e:  # noqa: BLE001 - any failure means an unreadable checkpoint
            raise UserError(f"{ep}: cannot read checkpoint metadata in {self.state_dir} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                            ) from None
        self.meta = flat
        self._validate()

    def _validate(self) -> None:
        shapes = hf_map.leaf_shapes(self.cfg)
        for key, (shape, _dt) in self.meta.items():
            if key not in shapes:
                raise UserError(f"{self.ep}: unexpected leaf {key} {_shape(shape)} for its "
                                "config.toml")
            if shape != shapes[key]:
                raise UserError(f"{self.ep}: leaf {key} has shape {_shape(shape)} but "
                                f"config.toml implies {_shape(shapes[key])}")
        for key, shape in shapes.items():
            if key not in self.meta:
                raise UserError(f"{self.ep}: missing leaf {key} (expected {_shape(shape)})")
        self.shapes = shapes

    def keys(self) -> list[str]:
        return list(self.shapes)

    def leaf_dtype(self, key: str) -> np.dtype:
        return self.meta[key][1]

    def read_leaf(self, key: str, dtype=None, out: np.ndarray | None = None) -> np.ndarray:
        """The leaf ``key`` (restored whole, then copied into ``out`` when given)."""
        ocp = self._ocp
        stored = self.leaf_dtype(key)
        into = out
        item = hf_map.unflatten({key: np.zeros(0, stored)})
        args = hf_map.unflatten({key: ocp.RestoreArgs(restore_type=np.ndarray, dtype=stored)})
        out = self._ckptr.restore(self.state_dir, args=ocp.args.PyTreeRestore(
            item, restore_args=args, partial_restore=True))
        arr = np.asarray(hf_map.flatten(out)[key])
        arr = arr.astype(dtype, copy=False) if dtype is not None else arr
        if into is not None:
            into[...] = arr
            return into
        return arr

    def close(self) -> None:
        self._ckptr.close()


def open_source(ep: Endpoint):
    if ep.kind == "orbax":
        return OrbaxSource(ep)
    return TensorSource(ep)


# --------------------------------------------------------------------------------------------
# Sinks: take jaxmoe leaves one at a time
# --------------------------------------------------------------------------------------------


class TensorSink:
    """Write leaves as HF-named tensors: an HF dir (+ config.json) or a torch_ref file."""

    def __init__(self, kind: str, target: Path, cfg: Config, dtypes: dict, shard_size=None):
        self.table = hf_map.entries(cfg)
        self.groups = hf_map.leaf_entries(cfg, self.table)
        self.zeros = [e for e in self.table if e.key == hf_map.ZERO]
        plan = [(e.hf_name, e.hf_shape, np.float32 if e.key == hf_map.ZERO else dtypes[e.key])
                for e in self.table]
        self.tensors = len(plan)
        if kind == "hf":
            from jaxmoe.hfconfig import to_hf_config

            target.mkdir(parents=True)
            hf_cfg = to_hf_config(cfg, dtype=str(np.dtype(dtypes["params/embed"])))
            (target / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
            self.writer = SafetensorsWriter(target, plan, shard_size=shard_size)
        else:
            if shard_size is not None:
                raise UserError("--shard-size applies to hf: destinations only")
            self.writer = SafetensorsWriter(target, plan, metadata={TORCH_CONFIG_KEY: cfg.to_json()},
                                            single_file=True)

    def write_leaf(self, key: str, arr: np.ndarray) -> None:
        for ent in self.groups[key]:
            t = arr[ent.index]
            self.writer.write(ent.hf_name, _transposed(t) if ent.transpose else t)

    def close(self) -> None:
        for ent in self.zeros:
            self.writer.write(ent.hf_name, np.zeros(ent.hf_shape, np.float32))
        self.writer.close()


class OrbaxSink:
    """Write a jaxmoe run dir (``config.toml`` + an Orbax checkpoint at step 0) leaf by leaf.

    Orbax writes a pytree in one save, so every leaf must exist at once; to keep them out of
    memory, each leaf is assembled in a raw ``np.memmap`` file under ``scratch`` (a directory
    next to the destination, removed afterwards; it needs disk for one copy of the model).
    :meth:`buffer` hands out that file for the source to fill (its pages are dropped as it
    fills, see :meth:`TensorSource.read_leaf`); at :meth:`close` the files are re-opened
    read-only and saved with :func:`jaxmoe.checkpoint.save_model` ``(stream=True)``, which
    writes them one 64 MiB chunk at a time without copying. Measured by ``bench/convert.py
    --gb 2`` (largest leaf 537 MB): peak RSS 618 MB, where holding every leaf for one save
    peaked at 5.8 GB. Disk: the scratch files are a second copy of the model. The checkpoint is
    the one ``save_model`` writes for in-memory leaves, up to the Zarr chunk shapes of leaves over
    64 MiB, which :func:`jaxmoe.checkpoint.load_model` and ``Checkpointer.restore`` read as usual.
    """

    def __init__(self, target: Path, cfg: Config, scratch: Path | None = None):
        self.target, self.cfg = target, cfg
        self.scratch = Path(scratch) if scratch is not None else target.parent / "leaves"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, tuple[Path | None, tuple, np.dtype, np.ndarray | None]] = {}
        self.tensors = 0

    def buffer(self, key: str, shape, dtype) -> np.ndarray:
        """A writable file-backed array for leaf ``key`` (pass it back to :meth:`write_leaf`)."""
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        if 0 in shape:  # an empty file cannot be mapped
            return np.empty(shape, dtype)
        path = self.scratch / f"{len(self.files):05d}.bin"
        return np.memmap(path, dtype=dtype, mode="w+", shape=shape)

    def write_leaf(self, key: str, arr: np.ndarray) -> None:
        from jaxmoe.checkpoint import release_pages

        if not isinstance(arr, np.memmap):  # not from buffer(): copy it into a file
            buf = self.buffer(key, arr.shape, arr.dtype)
            buf[...] = arr
            arr = buf
        if isinstance(arr, np.memmap):
            arr.flush()
            release_pages(arr)
            self.files[key] = (Path(arr.filename), arr.shape, arr.dtype, None)
        else:
            self.files[key] = (None, arr.shape, arr.dtype, arr)
        self.tensors += 1

    def close(self) -> None:
        from jaxmoe import checkpoint

        leaves = {}
        for key, (path, shape, dtype, arr) in self.files.items():
            leaves[key] = arr if path is None else np.memmap(path, dtype=dtype, mode="r",
                                                             shape=shape)
        tree = hf_map.unflatten(leaves)
        checkpoint.save_model(str(self.target), self.cfg, tree.get("params", {}),
                              tree.get("buffers", {}), step=0, stream=True)
        del leaves, tree
        self.files = {}
        shutil.rmtree(self.scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------------


def _is_nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _out_dtypes(source, dst_kind: str, dtype) -> dict:
    """Per-leaf output dtype: buffers stay fp32; else --dtype, else fp32 for orbax (jaxmoe master
    params are fp32), else the source dtype."""
    out = {}
    for key in source.keys():
        if key.startswith("buffers/"):
            out[key] = np.dtype(np.float32)
        elif dtype is not None:
            out[key] = np.dtype(dtype)
        elif dst_kind == "orbax":
            out[key] = np.dtype(np.float32)
        else:
            out[key] = source.leaf_dtype(key)
    return out


def convert(src: Endpoint, dst: Endpoint, dtype: str | None = None, shard_size: str | None = None,
            force: bool = False, log=None) -> dict:
    """Convert ``src`` to ``dst``; returns figures (tensors, bytes, seconds, notices)."""
    log = log if log is not None else (lambda msg: print(msg, file=sys.stderr))
    np_dtype = _float_dtype(dtype)
    shard = parse_size(shard_size) if shard_size else None
    if shard is not None and dst.kind != "hf":
        raise UserError("--shard-size applies to hf: destinations only")
    if src.path.resolve() == dst.path.resolve():
        raise UserError(f"--from and --to are the same path ({dst.path})")
    if _is_nonempty(dst.path) and not force:
        raise UserError(f"{dst}: exists and is not empty; pass --force to replace it")
    t0 = time.perf_counter()
    source = open_source(src)  # validates: raises before anything is written
    cfg = source.cfg
    hf_map.check_supported(cfg)
    for note in source.notices:
        log(note)
    dtypes = _out_dtypes(source, dst.kind, np_dtype)
    src_dtypes = sorted({str(source.leaf_dtype(k)) for k in source.keys()})

    dst.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.path.name}.tmp-", dir=dst.path.parent))
    target = tmp / "out"
    written = 0
    try:
        if dst.kind == "orbax":
            sink = OrbaxSink(target, cfg, scratch=tmp / "leaves")
        else:
            sink = TensorSink(dst.kind, target, cfg, dtypes, shard)
        for key in source.keys():
            buf = (sink.buffer(key, source.shapes[key], dtypes[key])
                   if isinstance(sink, OrbaxSink) else None)
            arr = source.read_leaf(key, dtypes[key], out=buf)
            del buf
            written += arr.nbytes
            sink.write_leaf(key, arr)
            del arr
        sink.close()
        source.close()
        if dst.path.exists() or dst.path.is_symlink():
            _remove(dst.path)
        os.replace(target, dst.path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    secs = time.perf_counter() - t0
    return {
        "src": str(src), "dst": str(dst), "arch": cfg.model.hf_arch,
        "leaves": len(source.keys()), "tensors": len(hf_map.entries(cfg)),
        "bytes": int(written), "seconds": round(secs, 3),
        "mb_per_s": round(written / 1e6 / max(secs, 1e-9), 1),
        "dtype": sorted({str(d) for d in dtypes.values()}), "src_dtype": src_dtypes,
        "notices": source.notices,
    }


# --------------------------------------------------------------------------------------------
# Running a checkpoint: logits in jaxmoe, torch_ref or HF transformers
# --------------------------------------------------------------------------------------------


def load_numpy_tree(ep: Endpoint, dtype=np.float32):
    """(cfg, params, buffers) as nested dicts of numpy arrays, from any endpoint."""
    source = open_source(ep)
    flat = {}
    for key in source.keys():
        d = np.float32 if key.startswith("buffers/") else dtype
        flat[key] = source.read_leaf(key, np.dtype(d))
    tree = hf_map.unflatten(flat)
    return source.cfg, tree.get("params", {}), tree.get("buffers", {})


def check_tokens(tokens: np.ndarray, cfg: Config, what: str = "tokens") -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.size == 0:
        raise UserError(f"{what}: expected token ids of shape [batch, seq], got {_shape(tokens.shape)}")
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
    import jax
    import jax.numpy as jnp

    from jaxmoe.model.transformer import apply_model

    cfg, params, buffers = load_numpy_tree(ep)
    check_tokens(tokens, cfg)
    params = jax.tree.map(jnp.asarray, params)
    buffers = jax.tree.map(jnp.asarray, buffers)
    logits, _aux = apply_model(cfg, params, buffers, jnp.asarray(tokens))
    return np.asarray(logits, dtype=np.float32)


def _as_file(ep: Endpoint, kind: str, tmpdir: str) -> Endpoint:
    """``ep`` itself when it already is of ``kind``, else a float32 copy converted into tmpdir."""
    if ep.kind == kind:
        return ep
    name = "model.safetensors" if kind == "torch" else "hf"
    out = Endpoint(kind, Path(tmpdir) / name)
    convert(ep, out, dtype="float32", log=lambda m: None)
    return out


def _torch_logits(ep: Endpoint, tokens: np.ndarray) -> np.ndarray:
    import torch

    from torch_ref import hf_io

    with tempfile.TemporaryDirectory() as tmp:
        if ep.kind == "hf":
            cfg, model = hf_io.load_hf(str(ep.path))
        else:
            ep = _as_file(ep, "torch", tmp)
            cfg = TensorSource(ep).cfg
            model = hf_io.load_torch(str(ep.path), cfg)
        check_tokens(tokens, cfg)
        model = model.float().eval()
        with torch.no_grad():
            out = model(torch.from_numpy(np.asarray(tokens, np.int64)))
    logits = out[0] if isinstance(out, (tuple, list)) else out
    return logits.float().numpy()


HF_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM"}


def _hf_logits(ep: Endpoint, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        ep = _as_file(ep, "hf", tmp)
        cfg = TensorSource(ep).cfg
        check_tokens(tokens, cfg)
        cls = getattr(transformers, HF_CLASSES[cfg.model.hf_arch])
        model = cls.from_pretrained(str(ep.path), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64))).logits
    return logits.float().numpy()


FRAMEWORKS = {"jax": _jax_logits, "torch": _torch_logits, "hf": _hf_logits}


def compute_logits(ep: Endpoint, tokens: np.ndarray, framework: str = "jax") -> np.ndarray:
    """fp32 logits [batch, seq, vocab] of checkpoint ``ep`` on ``tokens`` in ``framework``."""
    if framework not in FRAMEWORKS:
        raise UserError(f"--framework {framework!r}: choose {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[framework](ep, np.asarray(tokens))


def _available(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def compare_logits(ref: np.ndarray, out: np.ndarray) -> dict:
    """max |ref - out|, mean KL(softmax(ref) || softmax(out)) per position, top-1 agreement."""
    a = np.asarray(ref, np.float64)
    b = np.asarray(out, np.float64)
    if a.shape != b.shape:
        raise UserError(f"logit shapes differ: {_shape(a.shape)} vs {_shape(b.shape)}")
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


def verify(src: Endpoint, dst: Endpoint, dtype: str) -> dict:
    """Run source and destination on a fixed probe batch; figures + pass/fail vs TOLERANCES.

    Source framework: HF transformers when SRC is hf: and transformers is installed, else
    torch_ref. Destination framework: jaxmoe for orbax:, torch_ref for torch:/hf:. Where
    torch_ref is not importable, HF transformers stands in for it.
    """
    has_torch_ref = _available("torch_ref.hf_io")
    has_hf = _available("transformers")
    torch_fw = "torch" if has_torch_ref else "hf"
    src_fw = "hf" if (src.kind == "hf" and has_hf) else torch_fw
    dst_fw = "jax" if dst.kind == "orbax" else torch_fw
    cfg = (load_config(path=dst.path / "config.toml") if dst.kind == "orbax"
           else TensorSource(dst).cfg)
    rng = np.random.default_rng(PROBE_SEED)
    tokens = rng.integers(0, cfg.model.vocab_size, PROBE_SHAPE).astype(np.int32)
    ref = compute_logits(src, tokens, src_fw)
    out = compute_logits(dst, tokens, dst_fw)
    figures = compare_logits(ref, out)
    tol = TOLERANCES[dtype]
    figures.update({
        "src_framework": src_fw, "dst_framework": dst_fw, "tokens": list(PROBE_SHAPE),
        "tolerance": tol,
        "ok": bool(figures["kl"] <= tol["kl"] and figures["max_abs"] <= tol["max_abs"]),
    })
    return figures


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_args_convert(p) -> None:
    p.add_argument("--from", dest="src", required=True, metavar="SRC",
                   help="hf:DIR | orbax:RUN_DIR | torch:FILE.safetensors")
    p.add_argument("--to", dest="dst", required=True, metavar="DST",
                   help="hf:DIR | orbax:RUN_DIR | torch:FILE.safetensors")
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES),
                   help="output dtype of the weights (default: source dtype; float32 for orbax:)")
    p.add_argument("--shard-size", help="hf: output shard size, e.g. 5GB or 500MB (default: one file)")
    p.add_argument("--verify", action="store_true",
                   help="compare source and destination logits on a probe batch; non-zero exit "
                        "past tolerance")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")


def run_convert(args) -> int:
    src = parse_endpoint(args.src, "--from")
    dst = parse_endpoint(args.dst, "--to")
    stats = convert(src, dst, dtype=args.dtype, shard_size=args.shard_size, force=args.force)
    rc = 0
    if args.verify:
        # bf16 tolerances apply when either side holds bf16 weights
        dts = set(stats["dtype"]) | set(stats["src_dtype"])
        key = "bfloat16" if "bfloat16" in dts else "float32"
        stats["verify"] = verify(src, dst, key)
        rc = 0 if stats["verify"]["ok"] else 1
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(f"converted {stats['src']} -> {stats['dst']}: {stats['tensors']} tensors, "
              f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.2f}s "
              f"({stats['mb_per_s']:.0f} MB/s)")
        if "verify" in stats:
            v = stats["verify"]
            print(f"verify ({v['src_framework']} vs {v['dst_framework']}, {v['tokens'][0]}x"
                  f"{v['tokens'][1]} tokens): max|dlogit| {v['max_abs']:.3g}, KL {v['kl']:.3g}, "
                  f"top-1 agreement {v['top1']:.3f} -> {'OK' if v['ok'] else 'FAILED'} "
                  f"(tolerance KL <= {v['tolerance']['kl']:g}, max abs <= "
                  f"{v['tolerance']['max_abs']:g})")
    return rc


def add_args_logits(p) -> None:
    p.add_argument("--ckpt", required=True, help="hf:DIR | orbax:RUN_DIR | torch:FILE.safetensors")
    p.add_argument("--tokens", required=True, help="int token ids .npy, shape [batch, seq]")
    p.add_argument("--out", required=True, help="output .npy: fp32 logits [batch, seq, vocab]")
    p.add_argument("--framework", choices=("jax", "torch"), default="jax",
                   help="run jaxmoe (jax) or torch_ref (torch)")


def run_logits(args) -> int:
    ep = parse_endpoint(args.ckpt, "--ckpt")
    try:
        tokens = np.load(args.tokens, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokens {args.tokens}: cannot read .npy ({e})") from None
    logits = compute_logits(ep, tokens, args.framework)
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: logits {_shape(logits.shape)} float32 ({args.framework})")
    return 0


__all__ = [
    "Endpoint", "OrbaxSink", "OrbaxSource", "TOLERANCES", "TensorSink", "TensorSource",
    "add_args_convert", "add_args_logits", "compare_logits", "compute_logits", "convert",
    "load_numpy_tree", "parse_endpoint", "run_convert", "run_logits", "verify",
]
