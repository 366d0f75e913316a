"""The ``orbax:RUN_DIR[@STEP]`` format: a jaxmoe run dir's Orbax checkpoint, read and written.

A run dir is :mod:`jaxmoe.checkpoint.checkpointer`'s layout: ``config.toml`` + ``checkpoints/<step>/state``,
which holds the ``{"params", "buffers", ...}`` pytree. Reading takes the latest committed step, or
``@STEP``; only ``params`` and ``buffers`` are read, so training checkpoints (with optimizer
state) convert too. Writing makes a fresh run dir with the checkpoint at step 0, and keeps an HF
source's non-weight files in ``RUN_DIR/hf_meta/`` (:mod:`jaxmoe.port.io.hf_meta`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from jaxmoe.checkpoint.run_dir import RunDir
from jaxmoe.config import Config, load_config
from jaxmoe.errors import UserError
from jaxmoe.port.formats.base import Endpoint, Format, Sink, Source, shape_text
from jaxmoe.port.io.hf_meta import HF_META_DIR, keep_in_run_dir
from jaxmoe.port.io.transpose import transpose_into
from jaxmoe.port.maps import hf_map
from jaxmoe.storage import direct_io, page_cache


def leaf_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every leaf of ``cfg``'s model (``params/...`` trained, ``buffers/...``) with its shape,
    from the model's own declarations: a run dir holds any model jaxmoe trains, also one no HF
    architecture expresses (same leaves as :func:`jaxmoe.port.maps.hf_map.leaf_shapes` where one does)."""
    from jaxmoe.model.transformer import model_declarations  # late: jax

    return {("params/" if d.trained else "buffers/") + k: tuple(d.shape)
            for k, d in model_declarations(cfg).items()}


class OrbaxSource(Source):
    """A run dir's checkpoint (``ep.options["step"]``, default the latest), one leaf at a time.

    Shapes come from Orbax's tree metadata (no array is read); :meth:`read_leaf` restores a
    single leaf as a numpy array with Orbax's ``partial_restore``, so memory stays at one leaf;
    :meth:`leaf_view` reads one layer's / expert's slice at a time.
    """

    def __init__(self, ep: Endpoint):
        import orbax.checkpoint as ocp

        from jaxmoe.checkpoint.checkpointer import Checkpointer

        self.ep = ep
        self.notices: list[str] = []
        step = ep.options.get("step")
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
        shapes = leaf_shapes(self.cfg)
        for key, (shape, _dt) in self.meta.items():
            if key not in shapes:
                raise UserError(f"{self.ep}: unexpected leaf {key} {shape_text(shape)} for its "
                                "config.toml")
            if shape != shapes[key]:
                raise UserError(f"{self.ep}: leaf {key} has shape {shape_text(shape)} but "
                                f"config.toml implies {shape_text(shapes[key])}")
        for key, shape in shapes.items():
            if key not in self.meta:
                raise UserError(f"{self.ep}: missing leaf {key} (expected {shape_text(shape)})")
        self.shapes = shapes

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
        """The leaf as a :class:`~jaxmoe.checkpoint.orbax_read.LeafSlices`: ``view[index]`` reads one
        layer's / expert's slice (one Zarr chunk at a time) instead of the whole leaf."""
        from jaxmoe.checkpoint.orbax_read import LeafSlices, open_array

        try:
            return LeafSlices(open_array(self.state_dir, key), dtype or self.leaf_dtype(key),
                              root=self.state_dir)
        except OSError as e:
            raise UserError(f"{self.ep}: cannot read leaf {key} ({e})") from None

    def read_rows(self, key: str, n: int, dtype=None) -> np.ndarray:
        """The first ``n`` rows of a layer-stack leaf (all of a global leaf), read partially."""
        view = self.leaf_view(key, dtype)
        return view[()] if "/" not in key.split("/", 1)[1] else view.rows(n)

    @property
    def spec(self) -> str:
        """``orbax:/abs/RUN_DIR@STEP``, the step actually read."""
        return str(Endpoint(OrbaxFormat, self.ep.path.absolute(), {"step": self.step}))

    @property
    def meta_dir(self) -> Path | None:
        d = self.ep.path / HF_META_DIR
        return d if d.is_dir() else None

    def content_files(self) -> list[Path]:
        step_dir = self.ep.path / "checkpoints" / str(self.step) / "state"
        files = [self.ep.path / "config.toml"] + sorted(f for f in step_dir.rglob("*") if f.is_file())
        return [f for f in files if f.is_file()]

    def close(self) -> None:
        self._ckptr.close()


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _declared(cfg: Config) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Per leaf, its shape (:func:`leaf_shapes`) and how many leading axes index a source's
    slices: the ``layers`` / ``experts`` axes of its declaration (0: a global leaf, read whole)."""
    from jaxmoe.model.transformer import model_declarations  # late: jax

    shapes, depth = {}, {}
    for k, d in model_declarations(cfg).items():
        key = ("params/" if d.trained else "buffers/") + k
        n = 0
        while n < len(d.axes) and d.axes[n] in ("layers", "experts"):
            n += 1
        shapes[key], depth[key] = tuple(d.shape), n
    return shapes, depth


def copy_into(dst: np.ndarray, src) -> None:
    """``dst[...] = src``; a transposed view (the last two axes' strides swapped, what an
    ``hf:`` / ``dcp:`` source hands out for a leaf jaxmoe stores transposed) is copied tile by
    tile with :func:`~jaxmoe.port.formats.hf.transpose_into` instead of a strided copy."""
    src = np.asarray(src)
    if (src.ndim >= 2 and src.shape[-1] > 1 and src.shape[-2] > 1
            and abs(src.strides[-2]) < abs(src.strides[-1])):
        transpose_into(dst, np.swapaxes(src, -1, -2))
    else:
        dst[...] = src


class ViewFiller:
    """Fills a chunk of a leaf from the source's lazy view (``leaf_view``) at save time.

    ``depth`` leading axes are indexed with integers (``view[(layer,)]``, ``view[(layer,
    expert)]``; a source reads and keeps that slice's block), the rest sliced from what it
    returns. ``depth`` 0 (a global leaf) reads ``view[()]`` once and keeps it until the leaf is
    written (:meth:`release`). ``calls`` counts view reads (tests)."""

    def __init__(self, view, depth: int):
        self.view, self.depth = view, depth
        self._whole = None
        self.calls = 0

    def __call__(self, box: tuple, out: np.ndarray) -> None:
        if self.depth == 0:
            if self._whole is None:
                self.calls += 1
                self._whole = np.asarray(self.view[()])
                if not self._whole.flags.c_contiguous:  # a transposed map: a chunk's bytes are
                    self._whole = direct_io.read_copy(self._whole)  # strewn over all of it
            self._copy(out, self._whole[box])
            return
        lead, rest = box[:self.depth], box[self.depth:]
        for at in np.ndindex(*[b.stop - b.start for b in lead]):
            self.calls += 1
            self._copy(out[at], self.view[tuple(b.start + i for b, i in zip(lead, at))][rest])

    @staticmethod
    def _copy(out: np.ndarray, part) -> None:
        """``out[...] = part``; a map of the source's file is read around the page cache
        (:func:`~jaxmoe.storage.direct_io.read_view`), or, where it cannot be, through the map and
        its pages dropped once used."""
        got = direct_io.read_view(part)
        copy_into(out, got)
        if got is part:
            page_cache.drop_view(part)

    def release(self) -> None:
        """Drop the view (and what it keeps: its last block) once the leaf is written."""
        self.view, self._whole = None, None


class OrbaxSink(Sink):
    """Write a jaxmoe run dir (``config.toml`` + an Orbax checkpoint at step 0) leaf by leaf.

    Orbax writes a pytree in one save, so every leaf must exist at once. The sink takes the
    source's lazy views (:attr:`takes_views`: ``hf:`` / ``dcp:`` / ``orbax:`` sources read one
    layer's or expert's slice at a time) and keeps, per leaf, only a
    :class:`jaxmoe.checkpoint.stream.StreamLeaf` over it; at :meth:`finish` one
    :func:`jaxmoe.checkpoint.checkpointer.save_model` ``(stream=True)`` call writes the leaves one after
    another, one Zarr chunk (:data:`~jaxmoe.checkpoint.checkpointer.STREAM_CHUNK_BYTES`) at a time, each chunk
    filled straight from the source (:class:`ViewFiller`; transposed slices copied in tiles).
    Each byte is read once and written once, and memory holds a source block and a few chunks.
    (The source stays open until after :meth:`finish`, see :func:`jaxmoe.port.commands.convert.convert`.)

    A leaf that arrives as a whole in-memory array (a global ``hf:`` leaf, a fused HF layout,
    FP8) is *spilled*: copied into a raw ``np.memmap`` file under ``leaves/`` next to ``target``
    (in the conversion's temporary folder, removed afterwards) and its pages dropped, so it is
    not held in memory until the save. The checkpoint is the one ``save_model`` writes for
    in-memory leaves, up to the Zarr chunk shapes of leaves over the chunk size, which
    :func:`jaxmoe.checkpoint.checkpointer.load_model` and ``Checkpointer.restore`` read as usual.

    Before anything is written the sink says how much disk it needs: the checkpoint, plus, when
    some leaves may spill, a scratch copy of those (counted as the whole model: which leaves
    spill is known only as they arrive), and refuses, one line, when the file system holding
    ``where`` has less.
    """

    takes_views = True

    def __init__(self, target: Path, cfg: Config, dtypes: dict, where: Path, log):
        self.target, self.cfg, self.dtypes = target, cfg, dtypes
        self._where, self._log = where, log
        self.scratch = target.parent / "leaves"
        self.leaves: dict[str, object] = {}  # key -> StreamLeaf | np.memmap | small ndarray
        self.spilled: list[str] = []
        self.shapes, self.depth = _declared(cfg)
        try:  # convert reports HF tensors; a model HF cannot express (torchtitan's softmax
            self.tensors = len(hf_map.entries(cfg))  # DeepSeek-V3 flavors): its leaves
        except UserError:
            self.tensors = len(self.shapes)
        self._checked = False

    def use_source(self, source) -> None:
        """Check free disk before the first leaf: an ``orbax:`` source hands out every leaf as
        a lazy view (nothing spills); others may spill some leaves."""
        spill = not isinstance(source, OrbaxSource)
        self._check_disk(self.shapes, self.dtypes, self._where, self._log, spill)
        self._checked = True

    @staticmethod
    def _check_disk(shapes: dict, dtypes: dict, where: Path, log, spill: bool = True) -> None:
        model = sum(int(np.prod(shapes[k], dtype=np.int64)) * np.dtype(dt).itemsize
                    for k, dt in dtypes.items())
        need = 2 * model if spill else model
        free = shutil.disk_usage(where).free
        what = ("the checkpoint, plus scratch files for leaves the source cannot hand out a "
                "slice at a time, at most the model" if spill else "the checkpoint only")
        log(f"note: writing an orbax: checkpoint of {_gb(model)} needs {_gb(need)} free disk next "
            f"to the destination ({what}); {_gb(free)} free in {where}")
        if free < need:
            extra = f" + up to {_gb(model)} scratch" if spill else ""
            raise UserError(f"not enough free disk in {where}: converting to orbax: needs "
                            f"{_gb(need)} ({_gb(model)} checkpoint{extra}), "
                            f"{_gb(free)} free; free space or write --to elsewhere")

    def buffer(self, key: str, shape, dtype) -> None:
        """None: the sink takes the source's view (:attr:`takes_views`)."""
        return None

    def _spill(self, key: str, arr: np.ndarray) -> np.ndarray:
        """``arr`` copied into a scratch file, re-opened read-only with no page resident."""
        if 0 in arr.shape:  # an empty file cannot be mapped (and Orbax refuses 0-size leaves)
            return np.array(arr)
        self.scratch.mkdir(parents=True, exist_ok=True)
        path = self.scratch / f"{len(self.spilled):05d}.bin"
        buf = np.memmap(path, dtype=arr.dtype, mode="w+", shape=arr.shape)
        buf[...] = arr
        buf.flush()
        page_cache.drop_view(buf)  # written back by the flush: out of this process and the cache
        del buf
        self.spilled.append(key)
        return np.memmap(path, dtype=arr.dtype, mode="r", shape=arr.shape)

    def write_leaf(self, key: str, arr) -> None:
        from jaxmoe.checkpoint.checkpointer import StreamLeaf  # late: jax, Orbax

        if not self._checked:  # a caller that skipped use_source
            self._check_disk(self.shapes, self.dtypes, self._where, self._log)
            self._checked = True
        dtype = np.dtype(self.dtypes.get(key, arr.dtype))
        if isinstance(arr, np.ndarray):  # the whole leaf, in memory: spill, unless tiny
            arr = arr.astype(dtype, copy=False)
            self.leaves[key] = arr.copy() if arr.nbytes <= 4096 else self._spill(key, arr)
            return
        fill = ViewFiller(arr, self.depth.get(key, 0))
        self.leaves[key] = StreamLeaf(arr.shape, dtype, fill, fill.release)

    def finish(self) -> None:
        from jaxmoe.checkpoint import checkpointer as checkpoint

        tree = hf_map.unflatten(self.leaves)
        self.leaves = {}
        checkpoint.save_model(str(self.target), self.cfg, tree.get("params", {}),
                              tree.get("buffers", {}), step=0, stream=True)
        del tree
        shutil.rmtree(self.scratch, ignore_errors=True)

    def carry(self, files: list[Path], log=None) -> list[str]:
        return keep_in_run_dir(files, self.target)


class OrbaxFormat(Format):
    scheme = "orbax"
    syntax = "orbax:RUN_DIR[@STEP]"
    help = ("a jaxmoe run dir (config.toml + checkpoints/<step>/): its latest checkpoint, or "
            "step STEP when reading")
    verify_frameworks = ("jax",)
    hf_arch_only = False  # a run dir holds any model jaxmoe trains
    default_dtype = np.dtype(np.float32)  # jaxmoe master params are fp32
    output_what = "a jaxmoe run folder"

    @classmethod
    def parse(cls, text: str, rest: str, flag: str) -> Endpoint:
        options = {}
        if "@" in rest:
            rest, _, tail = rest.rpartition("@")
            if not tail.isdigit():
                raise UserError(f"{flag} {text!r}: expected orbax:DIR@STEP with an integer STEP")
            options["step"] = int(tail)
        return Endpoint(cls, Path(rest), options)

    @classmethod
    def text(cls, ep: Endpoint) -> str:
        step = ep.options.get("step")
        return f"{cls.scheme}:{ep.path}" + ("" if step is None else f"@{step}")

    @classmethod
    def open_source(cls, ep: Endpoint) -> OrbaxSource:
        return OrbaxSource(ep)

    @classmethod
    def check_sink(cls, ep: Endpoint) -> None:
        super().check_sink(ep)
        if "step" in ep.options:
            raise UserError(f"{ep}: @STEP picks a checkpoint to read; a conversion writes a new "
                            "run dir at step 0: drop @STEP")

    @classmethod
    def open_sink(cls, ep: Endpoint, target: Path, cfg: Config, dtypes: dict, log) -> OrbaxSink:
        return OrbaxSink(target, cfg, dtypes, ep.path.parent, log)

    @classmethod
    def is_output(cls, path: Path) -> bool:
        return path.is_dir() and RunDir(path).is_run()


__all__ = ["OrbaxFormat", "OrbaxSink", "OrbaxSource"]
