"""``jaxmoe config``: print a resolved config as TOML (a preset, a file, ``--set`` overrides, or
a torchtitan flavor with ``--from-titan FAMILY/FLAVOR``).

``--from-titan`` derives the config from torchtitan's own flavor definition
(:mod:`parity.titan_flavors`; needs the ``[titan]`` extra, imported only then): what it cannot
represent fails with one line naming the field; what it leaves out is printed as a note on stderr.
"""

from __future__ import annotations

import sys

from jaxmoe.config import config_from_dict, config_to_toml, parse_override, validate
from jaxmoe.errors import UserError


def add_from_titan(p) -> None:
    p.add_argument("--from-titan", metavar="FAMILY/FLAVOR", default=None,
                   help="derive the config from a torchtitan flavor, e.g. deepseek_v3/671B, qwen3/30B-A3B, "
                        "kimi_k2_7/Kimi-K2.5 (needs pip install 'jaxmoe[titan]')")


def titan_config(spec: str, overrides=(), notes=None):
    """The jaxmoe Config of torchtitan's ``FAMILY/FLAVOR`` with ``--set`` overrides on top."""
    try:
        from parity.titan_flavors import config_from_titan
    except ModuleNotFoundError as e:  # parity without torch
        from jaxmoe.extras import hint

        raise UserError(hint("torchtitan", "--from-titan") + f" [import of {e.name} failed]") from None
    tc = config_from_titan(spec)
    if notes is not None:
        notes.extend(tc.notes)
    data: dict = {}
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    return validate(config_from_dict(data, base=tc.config))


def add_args(p) -> None:
    from jaxmoe.cli import add_config_args

    add_config_args(p)
    add_from_titan(p)
    p.add_argument("--out", default=None, help="write the TOML here instead of stdout")


def run(args) -> int:
    from jaxmoe.cli import config_from_args

    notes: list[str] = []
    cfg = config_from_args(args, notes)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    text = config_to_toml(cfg)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


__all__ = ["add_args", "add_from_titan", "run", "titan_config"]
