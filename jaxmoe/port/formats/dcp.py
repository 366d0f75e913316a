"""The ``dcp:STEP_DIR`` format: a torchtitan checkpoint step (``torch.distributed.checkpoint``), read.

torchtitan's ``CheckpointManager`` saves the model's tensors flat under their native names (mapped
to jaxmoe leaves by the one table, :mod:`jaxmoe.port.titan_map`) and, in a full checkpoint,
``optimizer.*``, ``lr_scheduler.*``, ``dataloader`` and ``train_state.*`` beside them (recognised
and skipped for weights). A checkpoint holds no model config: the ``--titan`` option names it, a
torchtitan ``FAMILY/FLAVOR`` (e.g. ``deepseek_v3/debugmodel``) or a jaxmoe preset / config
``.toml``. The step directory is read by :mod:`jaxmoe.port.dcp_io`, which runs no code from it.

Tensors are read one at a time: a leaf is assembled from its torchtitan tensors, each from its
chunks, so memory holds about one tensor plus the leaf being filled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmoe.config_cli import named_config
from jaxmoe.errors import UserError
from jaxmoe.port import titan_map
from jaxmoe.port.dcp_io import TRAINING_STATE, DcpDir
from jaxmoe.port.formats.base import TITAN_OPTION, Endpoint, Format, Source, shape_text

# --------------------------------------------------------------------------------------------
# The source
# --------------------------------------------------------------------------------------------


EXPERT_BIAS = "moe.expert_bias_E"


def check_titan_names(names, shape_of, entries, what: str, config_what: str) -> list[str]:
    """Every tensor of the mapping present with its shape; every other name a training-state entry
    (one line naming the first problem and how many more, unknown names listed). Returns the
    expert biases the config has no place for (torchtitan keeps one for softmax routers too):
    the caller accepts them only when zero."""
    expected = {e.name: e for e in entries}
    problems, unknown, biases = [], [], []
    for name, ent in expected.items():
        if name not in names:
            problems.append(f"missing tensor {name} (expected shape {shape_text(ent.shape)} from {config_what})")
        elif tuple(shape_of(name)) != ent.shape:
            problems.append(f"tensor {name} has shape {shape_text(shape_of(name))} in the checkpoint "
                            f"but {config_what} says {shape_text(ent.shape)}")
    for name in names:
        if name in expected or name.split(".", 1)[0] in TRAINING_STATE:
            continue
        if name.endswith("." + EXPERT_BIAS):
            biases.append(name)
        else:
            unknown.append(name)
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        problems.append(f"{len(unknown)} tensors {config_what} has no place for: {shown}")
    if len(problems) == len(expected) + (1 if unknown else 0) and expected:
        raise UserError(f"{what}: none of {config_what}'s torchtitan tensors is there (not a "
                        f"torchtitan checkpoint of this model?); it holds {len(names)} entries, e.g. "
                        f"{', '.join(list(names)[:4])}")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(f"{what}: {problems[0]}{more}")
    return biases


class DcpSource(Source):
    """A torchtitan DCP step as jaxmoe leaves (the config from ``--titan``)."""

    def __init__(self, ep: Endpoint):
        self.ep = ep
        self.notices: list[str] = []
        self.dir = DcpDir(ep.path, str(ep))
        spec = ep.options.get("titan")
        if not spec:
            raise UserError(f"{ep}: a DCP checkpoint holds no model config; name it with --titan "
                            "FAMILY/FLAVOR (e.g. deepseek_v3/debugmodel) or a jaxmoe preset / config .toml")
        self.cfg = named_config(spec)
        self.entries = titan_map.titan_entries(self.cfg)
        names = list(self.dir.tensors) + self.dir.byte_items
        biases = check_titan_names(names, lambda n: self.dir.shape(n) if n in self.dir.tensors else (),
                                   self.entries, str(ep), f"--titan {spec}")
        self.dir.check_files()
        for name in biases:
            if name not in self.dir.tensors or np.any(self.dir.read(name).astype(np.float32) != 0):
                raise UserError(f"{ep}: tensor {name} is non-zero but --titan {spec} has no expert "
                                "bias (jaxmoe's aux-loss-free bias is sigmoid-only)")
        if biases:
            self.notices.append(f"note: {ep}: {len(biases)} all-zero {EXPERT_BIAS} tensors skipped "
                                "(the config has no expert bias)")
        self.groups: dict[str, list[titan_map.TitanEntry]] = {}
        for ent in self.entries:
            self.groups.setdefault(ent.key, []).append(ent)
            self.dir.dtype(ent.name)  # a dtype jaxmoe reads
        self.shapes = titan_map.leaf_shapes(self.cfg)
        skipped = sorted({n.split(".", 1)[0] for n in names if n.split(".", 1)[0] in TRAINING_STATE})
        if skipped:
            self.notices.append(f"note: {ep}: skipping the training state ({', '.join(skipped)}): "
                                "weights only")
        self._cache: tuple[str, np.ndarray] | None = None

    def keys(self) -> list[str]:
        return list(self.groups)

    def leaf_dtype(self, key: str) -> np.dtype:
        if key.startswith("buffers/"):
            return np.dtype(np.float32)
        dts = {self.dir.dtype(e.name) for e in self.groups[key]}
        return dts.pop() if len(dts) == 1 else np.dtype(np.float32)

    def _tensor(self, name: str) -> np.ndarray:
        """One torchtitan tensor; the last is kept (a fused wqkv serves q, k and v)."""
        if self._cache is None or self._cache[0] != name:
            self._cache = None
            self._cache = (name, self.dir.read(name))
        return self._cache[1]

    def _fill(self, ents, out: np.ndarray) -> np.ndarray:
        for ent in ents:
            part = titan_map.jax_part(self._tensor(ent.name), ent)
            if ent.index:
                out[ent.index] = part
            else:
                out[...] = part
        self._cache = None
        return out

    def read_leaf(self, key: str, dtype=None, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(self.shapes[key], dtype or self.leaf_dtype(key))
        return self._fill(self.groups[key], out)

    def read_rows(self, key: str, n: int, dtype=None) -> np.ndarray:
        ents = self.groups[key]
        if not ents[0].index:
            return self.read_leaf(key, dtype)
        shape = (min(n, self.shapes[key][0]),) + tuple(self.shapes[key][1:])
        out = np.empty(shape, dtype or self.leaf_dtype(key))
        return self._fill([e for e in ents if e.index[0] < n], out)

    def content_files(self) -> list[Path]:
        return [self.ep.path / ".metadata"] + self.dir.files()


class DcpFormat(Format):
    scheme = "dcp"
    syntax = "dcp:STEP_DIR"
    help = ("a torchtitan checkpoint step (torch.distributed.checkpoint: .metadata + __R_0.distcp "
            "files, full or model-only; the model config from --titan)")
    options = (TITAN_OPTION,)
    can_write = False
    output_what = "a DCP step directory (.metadata)"

    @classmethod
    def open_source(cls, ep: Endpoint) -> DcpSource:
        return DcpSource(ep)

    @classmethod
    def is_output(cls, path: Path) -> bool:
        return (path / ".metadata").is_file()


__all__ = ["DcpFormat", "DcpSource", "check_titan_names"]
