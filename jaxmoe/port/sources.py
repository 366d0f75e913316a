"""Checkpoint endpoints, and the sources that read them one jaxmoe leaf at a time.

Checkpoint endpoints (``--from`` / ``--to`` / ``--ckpt``):

* ``hf:DIR``      a HuggingFace checkpoint directory: ``config.json`` + ``model.safetensors`` or
                  sharded ``model-*-of-*.safetensors`` with ``model.safetensors.index.json``;
                  hub tensor names of the config's architecture (see :mod:`jaxmoe.port.hf_map`).
* ``torch:FILE``  torch_ref's single file: HF tensor names, the jaxmoe config as JSON in the
                  safetensors metadata under ``"jaxmoe_config"``.
* ``orbax:DIR``   a jaxmoe run dir (``config.toml`` + ``checkpoints/<step>/``), latest step.

Opening a source (:func:`open_source`) reads its config and every tensor header and checks them
against the mapping table built from that config; :mod:`jaxmoe.port.convert` writes what a source
reads, :mod:`jaxmoe.port.logits` runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmoe.config import config_from_dict, load_config, validate
from jaxmoe.errors import UserError
from jaxmoe.hfconfig import from_hf_config
from jaxmoe.port import hf_map
from jaxmoe.port.safetensors_io import SafetensorsReader, dequantize_fp8

KINDS = ("hf", "orbax", "torch")
TORCH_CONFIG_KEY = "jaxmoe_config"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


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


def _transpose_into(dst: np.ndarray, src: np.ndarray, tile: int = 128) -> None:
    """``dst[...] = src`` with its last two dims swapped (2-D: the transpose), in column tiles.

    A plain ``dst[...] = src.T`` walks one side with a large stride and ran ~1.6x slower than this
    on the bench's [512, 1024] expert matrices; tiles of 128 keep both sides in cache. Stacked
    ``[..., a, b]`` arrays (the fused layout's ``[E, ...]``) go matrix by matrix.
    """
    if src.ndim > 2:
        for i in range(src.shape[0]):
            _transpose_into(dst[i], src[i], tile)
        return
    if src.ndim != 2:
        dst[...] = src.T
        return
    for j in range(0, src.shape[0], tile):
        dst[:, j : j + tile] = src[j : j + tile].T


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
        # each layer's expert layout (per-expert or fused) is read off its tensor names
        self.table, self.layouts = hf_map.detect_entries(self.cfg, self.reader)
        self.groups = hf_map.leaf_entries(self.cfg, self.table)
        self.shapes = hf_map.leaf_shapes(self.cfg)
        self._validate(what)

    def _validate(self, what: str) -> None:
        r, cfg = self.reader, self.cfg
        expected = {e.hf_name: e for e in self.table}
        # problems in hub order: mis-shaped, then missing, then unexpected tensors
        shaped, missing, extra, mtp = [], [], [], {}
        for name, ent in expected.items():
            if name not in r:
                layout = ""
                if "/experts/" in ent.key:  # neither layout's expert tensors are there
                    layout = (f"; expert tensors must be in a supported HF layout: per-expert "
                              f"({name.split('.experts.')[0]}.experts.{{e}}.<proj>.weight) or fused "
                              f"({name.split('.experts.')[0]}.experts.gate_up_proj / .down_proj)")
                missing.append(f"missing tensor {name} (expected shape {_shape(ent.hf_shape)} "
                               f"from {what}){layout}")
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
            # late: jaxmoe.checkpoint imports jax and Orbax, which hf:/torch: sources never need
            from jaxmoe.checkpoint import release_pages as release
        for ent in self.groups[key]:
            self._read_entry(ent, out)
            if release is not None:
                release(out)
        return out

    def _read_entry(self, ent: hf_map.Entry, out: np.ndarray) -> None:
        """Read the HF tensor (or fused part) of ``ent`` into its slot ``out[ent.index]``."""
        slot = out[ent.index]
        if ent.hf_part is not None:  # a part of a fused tensor: read only that part
            t = self._part(ent)
            if ent.transpose:
                _transpose_into(slot, t)
            else:
                slot[...] = t
        elif not ent.transpose and self.reader.dtype(ent.hf_name) == out.dtype != FP8:
            self.reader.read_into(ent.hf_name, slot)  # no temporary
        else:
            t = self.tensor(ent.hf_name)
            if ent.transpose:
                _transpose_into(out[ent.index], t)
            else:
                out[ent.index] = t

    def _part(self, ent: hf_map.Entry) -> np.ndarray:
        """The range ``ent.hf_part`` of HF tensor ``ent.hf_name`` (a fused ``gate_up_proj``'s
        gate or up half), read through a read-only map of the file: only its pages are read."""
        dim, start, stop = ent.hf_part
        if self.reader.dtype(ent.hf_name) == FP8:
            whole = self.tensor(ent.hf_name)
        else:
            info = self.reader.infos[ent.hf_name]
            whole = np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset,
                              shape=info.shape)
        return whole[(slice(None),) * dim + (slice(start, stop),)]

    def read_rows(self, key: str, n: int, dtype=None) -> np.ndarray:
        """The first ``n`` rows of a layer-stack leaf (all of a global leaf): only the HF
        tensors of those layers are read (a truncated model, ``--verify-layers``)."""
        ents = [e for e in self.groups[key] if not e.index or e.index[0] < n]
        if not self.groups[key][0].index:
            return self.read_leaf(key, dtype)
        shape = (min(n, self.shapes[key][0]),) + tuple(self.shapes[key][1:])
        out = np.empty(shape, dtype or self.leaf_dtype(key))
        for ent in ents:
            self._read_entry(ent, out)
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

    def __init__(self, ep: Endpoint, step: int | None = None):
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
            steps = ckpt.all_steps() if step is not None else None
            step = ckpt.latest_step() if step is None else step
        finally:
            ckpt.close()
        if step is None:
            raise UserError(f"{ep}: no committed checkpoint in {ep.path / 'checkpoints'}")
        if steps is not None and step not in steps:
            raise UserError(f"{ep}: no checkpoint at step {step} (steps: "
                            f"{', '.join(map(str, sorted(steps))) or 'none'})")
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

    def leaf_view(self, key: str, dtype=None):
        """The leaf as a :class:`~jaxmoe.port.orbax_read.LeafSlices`: ``view[index]`` reads one
        layer's / expert's slice (one Zarr chunk at a time) instead of the whole leaf."""
        from jaxmoe.port.orbax_read import LeafSlices, open_array

        try:
            return LeafSlices(open_array(self.state_dir, key), dtype or self.leaf_dtype(key))
        except OSError as e:
            raise UserError(f"{self.ep}: cannot read leaf {key} ({e})") from None

    def read_rows(self, key: str, n: int, dtype=None) -> np.ndarray:
        """The first ``n`` rows of a layer-stack leaf (all of a global leaf), read partially."""
        view = self.leaf_view(key, dtype)
        return view[()] if "/" not in key.split("/", 1)[1] else view.rows(n)

    def close(self) -> None:
        self._ckptr.close()


def open_source(ep: Endpoint):
    if ep.kind == "orbax":
        return OrbaxSource(ep)
    return TensorSource(ep)


__all__ = [
    "Endpoint", "FP8", "KINDS", "OrbaxSource", "TORCH_CONFIG_KEY", "TensorSource", "open_source",
    "parse_endpoint",
]
