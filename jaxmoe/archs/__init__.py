"""The HuggingFace architectures jaxmoe reads and writes: one record per architecture.

``ARCHS`` maps ``model.hf_arch`` to its :class:`~jaxmoe.archs.base.Arch` (HF class, model types,
fixed semantics, allowed features, tensor-name templates for both expert layouts, config.json
translation, transformers' defaults). Config validation, HF config import/export, the name
mapping, conversion, torch_ref and parity all read these records. Pure Python.

Adding an architecture: write ``jaxmoe/archs/<name>.py`` with an ``ARCH`` record and add it to
``_MODULES`` below (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from jaxmoe.archs import deepseek_v3, mixtral, qwen3_moe
from jaxmoe.archs.base import FEATURES, LAYOUTS, Arch, features_used
from jaxmoe.errors import ConfigError

_MODULES = (qwen3_moe, mixtral, deepseek_v3)

ARCHS: dict[str, Arch] = {mod.ARCH.name: mod.ARCH for mod in _MODULES}
ARCH_NAMES: tuple[str, ...] = tuple(ARCHS)
# config.json model_type -> the record that reads it
MODEL_TYPES: dict[str, Arch] = {t: a for a in ARCHS.values() for t in a.model_types}


def get_arch(name: str) -> Arch:
    """The record of ``model.hf_arch`` ``name`` (ConfigError listing the known ones)."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ConfigError(f"model.hf_arch={name!r} is not one of: {', '.join(ARCHS)}") from None


def arch_for_model_type(model_type) -> Arch:
    """The record that reads a config.json of ``model_type``."""
    try:
        return MODEL_TYPES[model_type]
    except (KeyError, TypeError):
        raise ConfigError(
            f"config.json model_type={model_type!r} is not supported; supported: "
            + ", ".join(MODEL_TYPES)
        ) from None


__all__ = ["ARCHS", "ARCH_NAMES", "Arch", "FEATURES", "LAYOUTS", "MODEL_TYPES", "arch_for_model_type",
           "features_used", "get_arch"]
