"""How a command gets its config (``--preset`` / ``--config`` / ``--set``, or ``--from-titan``), and
``jaxmoe config``: print a resolved config as TOML (a preset, a file, ``--set`` overrides, or
a torchtitan flavor with ``--from-titan FAMILY/FLAVOR``).

``--from-titan`` derives the config from torchtitan's own flavor definition
(:mod:`jaxmoe.config.titan`; needs the ``[titan]`` extra, imported only then): what it cannot
represent fails with one line naming the field; what it leaves out is printed as a note on stderr.
"""

from __future__ import annotations

import argparse
import sys

from jaxmoe.config import config_to_toml, list_presets, load_config
from jaxmoe.config.titan import titan_config
from jaxmoe.errors import UserError


def add_from_titan(p) -> None:
    p.add_argument("--from-titan", metavar="FAMILY/FLAVOR", default=None,
                   help="derive the config from a torchtitan flavor, e.g. deepseek_v3/671B, qwen3/30B-A3B, "
                        "kimi_k2_7/Kimi-K2.5 (needs pip install 'jaxmoe[titan]')")


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The shared --preset / --config / --set flags."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", help=f"preset name ({', '.join(list_presets())})")
    g.add_argument("--config", help="a config .toml (may start from `preset = NAME`)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set moe.top_k=2",
    )


def config_from_args(args):
    """--preset / --config / --set, or ``--from-titan`` (where the command has it) + --set; what a
    flavor's mapping leaves out is printed as ``note:`` lines on stderr."""
    spec = getattr(args, "from_titan", None)
    if spec:
        if args.preset or args.config:
            raise UserError("--from-titan replaces --preset / --config: give one of them")
        notes: list[str] = []
        cfg = titan_config(spec, args.overrides, notes)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        return cfg
    return load_config(preset=args.preset, path=args.config, overrides=args.overrides)


def add_args(p) -> None:
    add_config_args(p)
    add_from_titan(p)
    p.add_argument("--out", default=None, help="write the TOML here instead of stdout")


def run(args) -> int:
    cfg = config_from_args(args)
    text = config_to_toml(cfg)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


__all__ = ["add_args", "add_config_args", "add_from_titan", "config_from_args", "run"]
