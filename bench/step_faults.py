"""Page faults and kernel time per train step, with and without jaxmoe's host allocator setting.

    python bench/step_faults.py [--shape coarse|fine] [--steps 6] [--system-malloc]

Builds bench/train_step.py's jaxmoe step for the shape, runs three untimed steps, then prints,
per step, wall time, user and kernel (system) CPU seconds and minor page faults (``getrusage``).
Without ``--system-malloc`` the setting of ``jaxmoe/host_alloc.py`` is applied first, as
``jaxmoe train`` does (before jax starts its threads). Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("coarse", "fine"), default="fine")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--system-malloc", action="store_true", help="leave glibc's defaults alone")
    args = p.parse_args(argv)
    if not args.system_malloc:  # first: no thread may have allocated yet
        from jaxmoe.host_alloc import keep_freed_memory

        print(f"host allocator setting applied: {keep_freed_memory()}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_step import jax_config, make_jaxmoe

    run, sync = make_jaxmoe(jax_config(args.shape))
    for _ in range(3):
        sync(run())
    for i in range(args.steps):
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        sync(run())
        dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        print(f"step {i}: wall {dt:.3f}s user {r1.ru_utime - r0.ru_utime:.2f}s "
              f"sys {r1.ru_stime - r0.ru_stime:.2f}s minor faults {r1.ru_minflt - r0.ru_minflt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
