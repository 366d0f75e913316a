"""The ``torch:FILE.safetensors`` format: torch_ref's single checkpoint file, read and written.

HF tensor names (per-expert layout, what ``torch_ref.hf_io`` loads) in one safetensors file, with
the jaxmoe config as JSON in the file's metadata under ``"jaxmoe_config"``. Reading and writing
the tensors is the ``hf:`` machinery (:mod:`jaxmoe.port.formats.hf`); only the config differs.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxmoe.config import Config, config_from_dict, validate
from jaxmoe.errors import UserError
from jaxmoe.port.formats.base import Endpoint, Format
from jaxmoe.port.formats.hf import HfTensorSink, HfTensorSource
from jaxmoe.port.io.safetensors_io import WRITES_IN_FLIGHT, PartWriter, SafetensorsReader

TORCH_CONFIG_KEY = "jaxmoe_config"


class TorchSource(HfTensorSource):
    """A torch_ref file as jaxmoe leaves."""

    config_what = "its jaxmoe_config"

    def _open(self) -> tuple[Config, SafetensorsReader]:
        ep = self.ep
        if not ep.path.is_file():
            raise UserError(f"{ep}: no such file")
        reader = SafetensorsReader(ep.path)
        raw = reader.metadata.get(TORCH_CONFIG_KEY)
        if raw is None:
            raise UserError(f"{ep}: no {TORCH_CONFIG_KEY!r} in the safetensors metadata "
                            "(not a torch_ref file?)")
        try:
            return validate(config_from_dict(json.loads(raw))), reader
        except ValueError as e:
            raise UserError(f"{ep}: bad {TORCH_CONFIG_KEY} metadata ({e})") from None

    def content_files(self) -> list[Path]:
        return [self.ep.path]


class TorchSink(HfTensorSink):
    """A torch_ref file: per-expert HF names, the config in the metadata."""

    def _writer(self, cfg: Config, dtypes: dict, plan: list) -> PartWriter:
        return PartWriter(self.target, plan, metadata={TORCH_CONFIG_KEY: cfg.to_json()},
                           single_file=True, in_flight=WRITES_IN_FLIGHT)


class TorchFormat(Format):
    scheme = "torch"
    syntax = "torch:FILE.safetensors"
    help = "torch_ref's file (HF tensor names, the jaxmoe config in its metadata)"
    verify_frameworks = ("torch",)
    output_what = "a .safetensors file"

    @classmethod
    def parse(cls, text: str, rest: str, flag: str) -> Endpoint:
        if not rest.endswith(".safetensors"):
            raise UserError(f"{flag} {text!r}: a torch: checkpoint is a .safetensors file")
        return Endpoint(cls, Path(rest))

    @classmethod
    def open_source(cls, ep: Endpoint) -> TorchSource:
        return TorchSource(ep)

    @classmethod
    def open_sink(cls, ep: Endpoint, target: Path, cfg: Config, dtypes: dict, log) -> TorchSink:
        return TorchSink(target, cfg, dtypes)

    @classmethod
    def is_output(cls, path: Path) -> bool:
        return path.is_file() and path.suffix == ".safetensors"


__all__ = ["TORCH_CONFIG_KEY", "TorchFormat", "TorchSink", "TorchSource"]
