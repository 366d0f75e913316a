"""Config: the one source of truth for shapes, routing, mesh and training (pure Python: importing
this package never imports jax, so torch_ref shares it).

* :mod:`jaxmoe.config.schema` - the config sections, typed fields (every choice declared once).
* :mod:`jaxmoe.config.load` - building configs (presets, files, ``--set``), TOML, validation;
  its public names are re-exported here (``from jaxmoe.config import load_config``).
* :mod:`jaxmoe.config.autoconf` - ``auto`` values resolved per backend and shape.
* :mod:`jaxmoe.config.hf` / :mod:`jaxmoe.config.titan` - a HuggingFace ``config.json`` / a
  torchtitan flavor <-> a :class:`Config`.
* :mod:`jaxmoe.config.counting` - analytic parameter counts and FLOPs.
* :mod:`jaxmoe.config.cli` - how a command gets its config, and ``jaxmoe config``.
* ``jaxmoe/config/presets/`` - the preset TOML files.

May import: ``jaxmoe.archs``, ``jaxmoe.errors``, ``jaxmoe.extras`` (torchtitan lazily, in ``titan``).
"""

from jaxmoe.config.load import (
    Config,
    ConfigError,
    apply_setting,
    canonical_key,
    config_from_dict,
    config_to_toml,
    list_presets,
    load_config,
    parse_override,
    validate,
)
from jaxmoe.config.named import named_config
from jaxmoe.config.schema import SECTIONS

__all__ = ["SECTIONS", "Config", "ConfigError", "apply_setting", "canonical_key", "config_from_dict", "config_to_toml",
           "list_presets", "load_config", "named_config", "parse_override", "validate"]
