"""The config a checkpoint's ``--titan SPEC`` names (a ``dcp:`` step or torchtitan's HF export hold
none): a jaxmoe config ``.toml``, a jaxmoe preset, or a torchtitan ``FAMILY/FLAVOR``."""

from __future__ import annotations

from jaxmoe.config.load import list_presets, load_config
from jaxmoe.config.titan import titan_config


def named_config(spec: str):
    """The config a checkpoint's ``--titan SPEC`` names: a jaxmoe config ``.toml``, a jaxmoe
    preset, or a torchtitan ``FAMILY/FLAVOR`` (the ``[titan]`` extra)."""
    if spec.endswith(".toml"):
        return load_config(path=spec)
    if spec in list_presets():
        return load_config(preset=spec)
    return titan_config(spec)


__all__ = ["named_config"]
