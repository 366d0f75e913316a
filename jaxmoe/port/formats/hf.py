"""The ``hf:DIR`` format: a HuggingFace checkpoint directory, read and written.

``hf:DIR`` is ``config.json`` + ``model.safetensors`` or sharded ``model-*-of-*.safetensors`` with
``model.safetensors.index.json``, under the hub tensor names of the config's architecture (see
:mod:`jaxmoe.port.maps.hf_map`), in either HF expert layout (per expert or fused, detected per layer on
reading, ``--hf-layout`` on writing). FP8 weights (``weight_scale_inv``) are dequantised on
reading; multi-token-prediction layers (``model.layers.{L..}``) are read into ``mtp/*`` when
``model.mtp_layers`` covers them, else refused in one line.

The machinery for HF-named tensors in safetensors files (:class:`HfTensorSource`,
:class:`HfTensorSink`) is shared with the ``torch:`` format (:mod:`jaxmoe.port.formats.torch`),
which differs only in where the config lives.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmoe.archs.base import LAYOUTS
from jaxmoe.config import Config, named_config
from jaxmoe.config.hf import from_hf_config, to_hf_config
from jaxmoe.errors import UserError
from jaxmoe.port.formats.base import (
    TITAN_OPTION,
    Endpoint,
    Format,
    Option,
    RawTensor,
    Sink,
    Source,
    shape_text,
)
from jaxmoe.port.io.hf_meta import merge_into_hf_dir
from jaxmoe.port.io.safetensors_io import (
    WRITES_IN_FLIGHT,
    PartWriter,
    SafetensorsReader,
    dequantize_fp8,
    parse_size,
)
from jaxmoe.port.io.transpose import transpose_into, transposed
from jaxmoe.port.maps import hf_map
from jaxmoe.storage import direct_io

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# Reading: HF-named tensors as jaxmoe leaves
# --------------------------------------------------------------------------------------------


class HfTensorSource(Source):
    """HF-named tensors in safetensors files, viewed as jaxmoe leaves.

    Construction reads the config (:meth:`_open`, per format) and every header and validates them
    against the mapping; the tensors themselves are read only by :meth:`read_leaf`.
    """

    #: where the config comes from, as messages name it
    config_what = "config.json"

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.notices: list[str] = []
        self.fp8_block = (128, 128)
        self.cfg, self.reader = self._open()
        self.notices += [n for n in [hf_map.without_absent_mtp(self.cfg, self.reader.names())] if n]
        # each layer's expert layout (per-expert or fused) is read off its tensor names
        self.table, self.layouts = hf_map.detect_entries(self.cfg, self.reader)
        self.groups = hf_map.leaf_entries(self.cfg, self.table)
        self.shapes = hf_map.leaf_shapes(self.cfg)
        self._validate(self.config_what)

    def _open(self) -> tuple[Config, SafetensorsReader]:
        raise NotImplementedError

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
                missing.append(f"missing tensor {name} (expected shape {shape_text(ent.hf_shape)} "
                               f"from {what}){layout}")
            elif tuple(r.shape(name)) != ent.hf_shape:
                shaped.append(f"tensor {name} has shape {shape_text(r.shape(name))} in the "
                              f"checkpoint but {what} implies {shape_text(ent.hf_shape)}")
            elif r.dtype(name) == FP8 and name + "_scale_inv" not in r:
                shaped.append(f"tensor {name} is float8 without {name}_scale_inv")
        for name in r.names():
            if name in expected or name.endswith(hf_map.IGNORED_SUFFIXES):
                continue
            layer = hf_map.hf_layer_index(name)
            if layer is not None and layer >= cfg.model.n_layers + cfg.model.mtp_layers:
                mtp[layer] = mtp.get(layer, 0) + 1
                continue
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in expected:
                continue  # consumed by FP8 dequantisation
            extra.append(f"unexpected tensor {name} {shape_text(r.shape(name))}: {what} has no "
                         "such weight")
        mismatch = hf_map.mtp_mismatch(cfg, [p.split()[2] for p in missing], mtp)
        if mismatch:  # nothing is dropped silently: the config must hold every MTP depth
            raise UserError(f"{self.ep}: {mismatch}")
        problems = shaped + missing + extra
        for ent in self.table:
            if ent.key == hf_map.ZERO and ent.hf_name in r and not problems:
                if np.any(r.get(ent.hf_name).astype(np.float32) != 0):
                    problems.append(f"tensor {ent.hf_name} is non-zero but {what} disables it "
                                    "(set moe.use_expert_bias=true / topk_method noaux_tc)")
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise UserError(f"{self.ep}: {problems[0]}{more}")

    raw_names = "hf"

    def keys(self) -> list[str]:
        return list(self.groups)

    def raw_tensors(self, key: str) -> dict[str, RawTensor] | None:  # None for fused / FP8
        out = {}
        for ent in self.groups[key]:
            t = self.reader.infos[ent.hf_name]
            if ent.hf_part is not None or t.dtype == FP8:
                return None
            out[ent.hf_name] = RawTensor(t.file, t.offset, t.nbytes, t.dtype, t.shape, ent.index, ent.transpose)
        return out

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
            # late: jaxmoe.checkpoint.checkpointer imports jax and Orbax, which hf:/torch: sources never need
            from jaxmoe.checkpoint.checkpointer import release_pages as release
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
                transpose_into(slot, t)
            else:
                slot[...] = t
        elif not ent.transpose and self.reader.dtype(ent.hf_name) == out.dtype != FP8:
            self.reader.read_into(ent.hf_name, slot)  # no temporary
        else:
            t = self.tensor(ent.hf_name)
            if ent.transpose:
                transpose_into(out[ent.index], t)
            else:
                out[ent.index] = t

    def tensor_map(self, name: str) -> np.ndarray:
        """A read-only map of HF tensor ``name``'s bytes in its file (nothing read yet)."""
        info = self.reader.infos[name]
        return np.memmap(info.file, dtype=info.dtype, mode="r", offset=info.offset,
                         shape=info.shape)

    def _part(self, ent: hf_map.Entry) -> np.ndarray:
        """The range ``ent.hf_part`` of HF tensor ``ent.hf_name`` (a fused ``gate_up_proj``'s
        gate or up half), read through a read-only map of the file: only its pages are read."""
        dim, start, stop = ent.hf_part
        fp8 = self.reader.dtype(ent.hf_name) == FP8
        whole = self.tensor(ent.hf_name) if fp8 else self.tensor_map(ent.hf_name)
        return whole[(slice(None),) * dim + (slice(start, stop),)]

    def leaf_view(self, key: str, dtype=None):
        """A :class:`HfLeafView` (one transpose flag; FP8 only unfused and stacked; a global leaf
        only as one whole, non-empty, not FP8 HF tensor), else the whole leaf."""
        ents = self.groups[key]
        dtype = np.dtype(dtype or self.leaf_dtype(key))
        fused = any(e.hf_part is not None for e in ents)
        if (len({e.transpose for e in ents}) != 1
                or any(self.reader.dtype(e.hf_name) == FP8 for e in ents) and (fused or not ents[0].index)
                or not ents[0].index and (len(ents) > 1 or fused or 0 in self.shapes[key])):
            return self.read_leaf(key, dtype)
        return HfLeafView(self, key, dtype)

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

    @property
    def hub_files(self) -> dict[str, Path] | None:
        if "fused" in self.layouts.values():  # torch_ref reads the per-expert names only
            return None
        return {name: info.file for name, info in self.reader.infos.items()}


class HfLeafView:
    """A stacked leaf of an :class:`HfTensorSource` read one layer at a time: ``view[index]``
    (layer first) reads that layer's HF tensors into one block, kept for the next index in the
    layer, in the HF orientation (each tensor read straight into its slot) and handed out as a
    transposed *view* where jaxmoe transposes: a sink writing the HF / torchtitan orientation
    takes it back without moving bytes (:func:`transposed`).

    A global leaf (one HF tensor) is a map of its bytes, transposed likewise: the sink reads
    what it needs (``orbax:``: each chunk, ``O_DIRECT``), not a whole copy set aside first."""

    def __init__(self, src: HfTensorSource, key: str, dtype: np.dtype):
        self.src, self.key, self.dtype = src, key, dtype
        self.shape = tuple(src.shapes[key])
        self.ndim = len(self.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize
        self.ents, self.transpose = src.groups[key], src.groups[key][0].transpose
        self._layer, self._block = None, None
        # experts, read a group at a time (_expert): (layer, expert) -> (HF tensor, index in it),
        # per-expert tensors or each expert's slice of a fused layer tensor (experts first)
        self._experts = None
        if all(len(e.index) == 2 for e in self.ents):
            self._experts = {e.index: (e.hf_name, ()) for e in self.ents}
        elif "/experts/" in key and all(len(e.index) == 1 and e.hf_shape[0] == self.shape[1]
                                        and (e.hf_part or (1,))[0] >= 1 for e in self.ents):
            self._experts = {(e.index[0], x): (e.hf_name, (x,) + self._part_index(e))
                             for e in self.ents for x in range(self.shape[1])}
        self._group = None  # (layer, first expert) of self._block in that mode
        self._cast = (None, None)  # (layer, expert), that expert cast to ``dtype`` (kept: a
        # sink asks for one expert once per chunk of it)

    def _expert(self, layer: int, expert: int) -> np.ndarray:
        """Expert ``expert`` of ``layer`` (HF orientation), from a group of experts' tensors read
        together around the page cache, the next group (or the next layer's first) read
        meanwhile (:meth:`~jaxmoe.port.formats.base.Source.read_ahead`): an HF file interleaves
        gate / up / down per expert, so a leaf's tensors are apart and each is its own request."""
        n, one = self.shape[1], int(np.prod(self.shape[2:], dtype=np.int64))
        per = max(1, direct_io.BLOCK // max(1, one * self.src.reader.dtype(self.ents[0].hf_name).itemsize))
        first = expert // per * per
        if self._group != (layer, first):
            maps = lambda at: [(lambda name, i: self.src.tensor_map(name)[i])(*self._experts[(at[0], e)])  # noqa: E731
                               for e in range(at[1], min(at[1] + per, n))]
            nxt = (layer, first + per) if first + per < n else (layer + 1, 0)
            then = ((self.key,) + nxt, maps(nxt)) if nxt in self._experts else None
            self._block, self._layer = None, None
            self._block = self.src.read_ahead().rows((self.key, layer, first), maps((layer, first)), then)
            self._group = (layer, first)
        return self._block[expert - first]

    @staticmethod
    def _part_index(ent: hf_map.Entry) -> tuple:
        """The index of ``ent``'s part within one expert of its fused tensor (() if whole)."""
        if ent.hf_part is None:
            return ()
        dim, start, stop = ent.hf_part
        return (slice(None),) * (dim - 1) + (slice(start, stop),)

    def _converted(self, at: tuple[int, int], part: np.ndarray) -> np.ndarray:
        """Expert ``at`` (read as stored) in ``dtype``: FP8 dequantised, anything else cast."""
        if part.dtype == FP8:
            name = self._experts[at][0]
            scale = direct_io.read_copy(self.src.tensor_map(name + "_scale_inv"))  # uncached too
            part = dequantize_fp8(part, scale, self.src.fp8_block)
        return part.astype(self.dtype, copy=False)

    def _read_layer(self, layer: int) -> np.ndarray:
        rest = self.shape[1:]
        if self.transpose:
            rest = rest[:-2] + (rest[-1], rest[-2])
        self._block = None  # free the previous layer first
        block = np.empty(rest, self.dtype)
        reader = self.src.reader
        for ent in self.ents:
            if ent.index[0] != layer:
                continue
            slot = block[ent.index[1:]]
            if ent.hf_part is not None:  # a half of a fused tensor, through its map
                slot[...] = self.src.tensor_map(ent.hf_name)[(slice(None),) + self._part_index(ent)]
            elif reader.dtype(ent.hf_name) == self.dtype and slot.flags.c_contiguous:
                reader.read_into(ent.hf_name, slot)
            else:  # cast, or FP8 dequantised
                slot[...] = self.src.tensor(ent.hf_name)
        return block

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if not self.ents[0].index:  # a global leaf: its map (read directly and cast for a cast)
            whole = self.src.tensor_map(self.ents[0].hf_name)
            whole = whole if whole.dtype == self.dtype else direct_io.read_copy(whole).astype(self.dtype)
            return (np.swapaxes(whole, -1, -2) if self.transpose else whole)[index]
        if not index or not all(isinstance(i, (int, np.integer)) for i in index):
            raise TypeError("HfLeafView takes integer indices over the leading axes")
        layer = int(index[0])
        if self._experts is not None and len(index) > 1:
            at = (layer, int(index[1]))
            part = self._expert(*at)
            if part.dtype != self.dtype:
                if self._cast[0] != at:
                    self._cast = (at, self._converted(at, part))
                part = self._cast[1]
            return (np.swapaxes(part, -1, -2) if self.transpose else part)[tuple(index[2:])]
        if self._layer != layer:
            self._block, self._group = self._read_layer(layer), None
            self._layer = layer
        block = np.swapaxes(self._block, -1, -2) if self.transpose else self._block
        return block[tuple(int(i) for i in index[1:])]


class HfSource(HfTensorSource):
    """An ``hf:`` directory as jaxmoe leaves."""

    def _open(self) -> tuple[Config, SafetensorsReader]:
        ep = self.ep
        if not ep.path.is_dir():
            raise UserError(f"{ep}: not a directory")
        cfg_file = ep.path / "config.json"
        spec = ep.options.get("titan")
        if spec:  # torchtitan's HF export: safetensors without config.json
            if cfg_file.exists():
                raise UserError(f"{ep}: has a config.json; --titan names the model of a folder "
                                "without one (torchtitan's HF export): drop --titan")
            self.config_what = f"--titan {spec}"
            return named_config(spec), SafetensorsReader(ep.path)
        if not cfg_file.exists():
            raise UserError(f"{ep}: config.json is missing (torchtitan's HF export has none: "
                            "name its model with --titan FAMILY/FLAVOR)")
        try:
            hf_cfg = json.loads(cfg_file.read_text())
        except ValueError as e:
            raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
        cfg = from_hf_config(hf_cfg)
        q = hf_cfg.get("quantization_config") or {}
        if q.get("weight_block_size"):
            self.fp8_block = tuple(int(b) for b in q["weight_block_size"])
        return cfg, SafetensorsReader(ep.path)

    @property
    def meta_dir(self) -> Path:
        return self.ep.path

    @property
    def hf_dir(self) -> Path:
        return self.ep.path

    def content_files(self) -> list[Path]:
        return sorted(f for f in self.ep.path.iterdir()
                      if f.is_file() and f.suffix in (".safetensors", ".json"))


# --------------------------------------------------------------------------------------------
# Writing: jaxmoe leaves as HF-named tensors
# --------------------------------------------------------------------------------------------


class HfTensorSink(Sink):
    """Write leaves as HF-named tensors (:meth:`_writer`, per format, opens the files).

    ``layout`` is the HF expert layout written (:data:`jaxmoe.archs.base.LAYOUTS`): per-expert
    (hub names, one ``[I, H]`` tensor per expert) or fused (``save_pretrained(...,
    save_original_format=False)``: one ``[E, 2I, H]`` ``gate_up_proj`` and one ``[E, H, I]``
    ``down_proj`` per layer). A fused ``gate_up_proj`` gets its gate half from the gate leaf and
    its up half from the up leaf, each written in place as its leaf arrives
    (:meth:`PartWriter.write_part`): the sink holds no more than one layer's part (the
    transposed copy) beyond what the source hands it, and never a whole fused tensor."""

    takes_views = True

    def __init__(self, target: Path, cfg: Config, dtypes: dict, layout: str = LAYOUTS[0]):
        self.target = target
        self.table = hf_map.entries(cfg, layout)
        self.groups = hf_map.leaf_entries(cfg, self.table)
        by_tensor = hf_map.tensors(self.table)  # a fused gate_up_proj: two rows, one tensor
        self.zeros = [rows[0] for rows in by_tensor.values() if rows[0].key == hf_map.ZERO]
        plan = [(name, rows[0].hf_shape,
                 np.float32 if rows[0].key == hf_map.ZERO else dtypes[rows[0].key])
                for name, rows in by_tensor.items()]
        self.tensors = len(plan)
        self.writer = self._writer(cfg, dtypes, plan)

    def _writer(self, cfg: Config, dtypes: dict, plan: list) -> PartWriter:
        raise NotImplementedError

    raw_names, raw_any_order = "hf", True  # pre-sized files: every tensor's place is planned

    def raw_tensors(self, key: str) -> dict[str, RawTensor] | None:  # None for fused parts
        out = {}
        for ent in self.groups[key]:
            p = self.writer.planned[ent.hf_name]
            if ent.hf_part is not None or p.written:
                return None
            out[ent.hf_name] = RawTensor(p.file, p.offset, p.nbytes, p.dtype, p.shape, ent.index, ent.transpose)
        return out

    def raw_written(self, key: str, crcs: list | None = None) -> None:
        for ent in self.groups[key]:
            self.writer.planned[ent.hf_name].written = True

    def write_leaf(self, key: str, arr) -> None:
        for ent in self.groups[key]:
            t = arr[ent.index]
            t = transposed(t) if ent.transpose else t
            if ent.hf_part is None:
                self.writer.write(ent.hf_name, t)
            else:
                self.writer.write_part(ent.hf_name, ent.hf_part, t)

    def finish(self) -> None:
        for ent in self.zeros:
            self.writer.write(ent.hf_name, np.zeros(ent.hf_shape, np.float32))
        self.writer.close()


class HfSink(HfTensorSink):
    """An ``hf:`` directory: config.json from the model config, then the safetensors files."""

    def __init__(self, target: Path, cfg: Config, dtypes: dict, layout: str = LAYOUTS[0],
                 shard_size: int | None = None):
        self.shard_size = shard_size
        super().__init__(target, cfg, dtypes, layout)

    def _writer(self, cfg: Config, dtypes: dict, plan: list) -> PartWriter:
        self.target.mkdir(parents=True)
        hf_cfg = to_hf_config(cfg, dtype=str(np.dtype(dtypes["params/embed"])))
        (self.target / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        return PartWriter(self.target, plan, shard_size=self.shard_size, in_flight=WRITES_IN_FLIGHT)

    def carry(self, files: list[Path], log=None) -> list[str]:
        return merge_into_hf_dir(files, self.target)


class HfFormat(Format):
    scheme = "hf"
    syntax = "hf:DIR"
    help = ("a HuggingFace checkpoint directory (config.json + model.safetensors or sharded "
            "model-*-of-*.safetensors with its index; hub tensor names, either expert layout)")
    options = (
        TITAN_OPTION,
        Option("shard_size", "--shard-size", "sink", parse=parse_size,
               help="hf: output shard size, e.g. 5GB or 500MB (default: one file)"),
        Option("hf_layout", "--hf-layout", "sink", choices=LAYOUTS, default=LAYOUTS[0],
               report=True,
               help="hf: output expert layout: per-expert (default; hub names, "
                    "experts.{e}.gate_proj.weight ...) or fused (experts.gate_up_proj "
                    "[E, 2I, H] / experts.down_proj [E, H, I], as transformers' "
                    "save_pretrained(save_original_format=False) writes)"),
    )
    verify_frameworks = ("hf", "torch")
    output_what = "an HF checkpoint folder (config.json, no sub-folders)"

    @classmethod
    def open_source(cls, ep: Endpoint) -> HfSource:
        return HfSource(ep)

    @classmethod
    def open_sink(cls, ep: Endpoint, target: Path, cfg: Config, dtypes: dict, log) -> HfSink:
        return HfSink(target, cfg, dtypes, ep.options.get("hf_layout", LAYOUTS[0]),
                      ep.options.get("shard_size"))

    @classmethod
    def is_output(cls, path: Path) -> bool:
        return (path.is_dir() and (path / "config.json").is_file()
                and not any(p.is_dir() for p in path.iterdir()))


__all__ = ["FP8", "HfFormat", "HfLeafView", "HfSink", "HfSource", "HfTensorSink", "HfTensorSource", "transpose_into",
           "transposed"]
