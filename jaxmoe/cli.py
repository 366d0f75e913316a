"""The ``jaxmoe`` command.

Each sub-command lives beside what it drives and is loaded lazily (so ``jaxmoe count`` never
imports jax): a module provides ``add_args(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading

from jaxmoe.config import ConfigError
from jaxmoe.config.cli import add_config_args, add_from_titan, config_from_args
from jaxmoe.config.counting import count_params, human
from jaxmoe.errors import UserError
from jaxmoe.extras import EXTRA_OF, hint

# command -> (module, help)
COMMANDS = {
    "train": ("jaxmoe.train.cli", "train a model (default: tiny on the embedded corpus, on CPU)"),
    "count": (None, "analytic total / active parameter counts (a preset, a config file or --from-titan)"),
    "config": ("jaxmoe.config.cli", "print a resolved config as TOML (preset, file, --set, or --from-titan)"),
    "plan": ("jaxmoe.plan.memory", "will a preset's train step fit a mesh? per-device memory, FLOPs, lowering"),
    "plot": ("jaxmoe.train.plot", "write PNG plots from a training run's metrics.jsonl"),
    "tokenizer": ("jaxmoe.data.tokenize", "train a byte-level BPE tokenizer.json on text files"),
    "convert": ("jaxmoe.port.commands.cli", "convert checkpoints between hf:, orbax:, torch: and dcp: (torchtitan)"),
    "logits": ("jaxmoe.port.commands.cli", "write the fp32 logits a checkpoint computes on tokens"),
    "generate": ("jaxmoe.port.commands.generate", "new tokens from a checkpoint, with a KV cache (greedy or sampled)"),
    "eval": ("jaxmoe.train.eval_cli", "cross-entropy, perplexity and expert load of a checkpoint on a data spec"),
    "parity": ("parity.cli", "run the parity suites: jaxmoe vs torch_ref, transformers or torchtitan"),
}


def _count_add_args(p):
    add_config_args(p)
    add_from_titan(p)
    p.add_argument("--json", action="store_true", help="print JSON")


def _count_run(args) -> int:
    cfg = config_from_args(args)
    c = count_params(cfg)
    if args.json:
        print(json.dumps(c, indent=2))
        return 0
    print(f"{c['name']}: total {human(c['total_params'])} ({c['total_params']:,}), "
          f"active per token {human(c['active_params'])} ({c['active_params']:,})"
          + (f", + multi-token prediction {human(c['mtp_params'])} ({c['mtp_params']:,}; "
             f"{human(c['mtp_params_hf_stored'])} with the embedding and head copies an HF checkpoint stores)"
             if c["mtp_params"] else ""))
    for k, v in c["breakdown"].items():
        print(f"  {k:38s} {v:>20,}")
    print("  dims: " + ", ".join(f"{k}={v}" for k, v in c["dims"].items() if v is not None))
    print("  how counted: " + c["method"])
    return 0


def _load(module):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        if e.name and e.name.split(".")[0] in EXTRA_OF:  # e.g. parity without torch: [ref]
            return e.name
        raise


def _missing(name, module):
    def run(args):
        raise UserError(f"'jaxmoe {name}' is not available: module {module} is missing")

    return run


def _needs(name, dep):
    def run(args):
        raise UserError(hint(dep, f"'jaxmoe {name}'"))

    return run


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Build only the parser of the command asked for, so that `jaxmoe count` stays jax-free.
    parser = argparse.ArgumentParser(prog="jaxmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name != chosen:
            continue
        if module is None:
            _count_add_args(p)
            p.set_defaults(_run=_count_run)
            continue
        mod = _load(module)
        if mod is None or isinstance(mod, str):
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_run=_missing(name, module) if mod is None else _needs(name, mod))
            continue
        getattr(mod, "add_args_" + name, getattr(mod, "add_args", None))(p)
        p.set_defaults(_run=getattr(mod, "run_" + name, getattr(mod, "run", None)))
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ConfigError, UserError) as e:
        print(f"jaxmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra imported late (torch for parity, ...)
        if not (e.name and e.name.split(".")[0] in EXTRA_OF):
            raise
        print(f"jaxmoe {args.command}: error: {hint(e.name, f'jaxmoe {args.command}')}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `jaxmoe count ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"jaxmoe {args.command}: aborted", file=sys.stderr, flush=True)
        if args.command == "train" and threading.active_count() > 1:
            # an unfinished asynchronous save's worker threads would keep the process alive
            os._exit(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
