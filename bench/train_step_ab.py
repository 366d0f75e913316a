"""Interleaved in-process A/B of jaxmoe train-step variants on bench/train_step.py's shapes.

    python bench/train_step_ab.py SHAPE VARIANT [VARIANT ...]     (ROUNDS=4 STEPS=3 by default)

SHAPE: ``coarse``, ``fine`` or ``titan:FAMILY/FLAVOR`` (torchtitan's flavor at the torchtitan
peer's batch, ``bench/train_step.py --peer torchtitan``).

A VARIANT is a comma-separated list of ``set:SECTION.KEY=VALUE`` (a config override),
``py:MODULE.ATTR=INT`` (a module constant read at trace time, e.g.
``py:jaxmoe.model.blocked.RUN_ROWS=256``; restored after that variant is compiled) or
``ENV=VALUE``; the empty string is the current code. Every variant is compiled and warmed up
first; each round then times STEPS steps of every variant, the order reversed every other round.
Prints each variant's median tokens/s (range) and its per-round ratio to the first variant.
jaxmoe's host allocator setting (``jaxmoe/train/host_alloc.py``) is applied first, as ``jaxmoe train``
does. Figures are reported, never asserted.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import jax_config, make_jaxmoe


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not (argv[0] in ("coarse", "fine") or argv[0].startswith("titan:")):
        print("usage: python bench/train_step_ab.py coarse|fine|titan:FAMILY/FLAVOR VARIANT [VARIANT ...]",
              file=sys.stderr)
        return 2
    shape, variants = argv[0], argv[1:]
    from jaxmoe.train.host_alloc import keep_freed_memory

    keep_freed_memory()  # before jax starts its threads, as `jaxmoe train` and bench/train_step.py's worker
    rounds, steps = int(os.environ.get("ROUNDS", 4)), int(os.environ.get("STEPS", 3))
    systems = []
    for v in variants:
        sets, undo = [], []
        for item in filter(None, v.split(",")):
            if item.startswith("set:"):
                sets.append(item[4:])
            elif item.startswith("py:"):
                target, val = item[3:].split("=", 1)
                mod, attr = target.rsplit(".", 1)
                m = importlib.import_module(mod)
                undo.append((setattr, m, attr, getattr(m, attr)))
                setattr(m, attr, int(val))
            else:
                k, val = item.split("=", 1)
                undo.append((lambda _o, key, old: os.environ.__setitem__(key, old) if old is not None
                             else os.environ.pop(key, None), None, k, os.environ.get(k)))
                os.environ[k] = val
        cfg = jax_config(shape, sets)
        tokens = cfg.train.batch_size * cfg.train.seq_len
        run, sync = make_jaxmoe(cfg)
        t = time.perf_counter()
        sync(run())  # compile (the constants and variables above are read while tracing)
        first = time.perf_counter() - t
        sync(run())
        for f, obj, key, old in undo:
            f(obj, key, old)
        systems.append((v or "current", run, sync))
        print(f"{v or 'current'}: first step {first:.1f}s", flush=True)
    res = {n: [] for n, _, _ in systems}
    for r in range(rounds):
        for n, run, sync in (systems if r % 2 == 0 else systems[::-1]):
            t = time.perf_counter()
            for _ in range(steps):
                out = run()
            sync(out)
            res[n].append(steps * tokens / (time.perf_counter() - t))
    base = systems[0][0]
    for n, v in res.items():
        rat = [a / b for a, b in zip(v, res[base])]
        print(f"{shape} {n:45s} tok/s median {statistics.median(v):6.0f} [{min(v):.0f}-{max(v):.0f}]"
              f"  / first {statistics.median(rat):.3f} [{min(rat):.3f}-{max(rat):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
