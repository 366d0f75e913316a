"""Page faults and kernel time per train step, with and without jaxmoe's host allocator setting.

    python bench/step_faults.py [--shape coarse|fine] [--steps 6] [--system-malloc]

Builds bench/train_step.py's jaxmoe step for the shape, runs three untimed steps, then prints,
per step, wall time, user and kernel (system) CPU seconds and minor page faults (``getrusage``).
Without ``--system-malloc`` the setting of ``jaxmoe/train/host_alloc.py`` is applied first, as
``jaxmoe train`` does (before jax starts its threads). Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("coarse", "fine"), default="fine")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--system-malloc", action="store_true", help="leave glibc's defaults alone")
    args = p.parse_args(argv)
    if not args.system_malloc:  # first: no thread may have allocated yet
        from jaxmoe.train.host_alloc import keep_freed_memory

        print(f"host allocator setting applied: {keep_freed_memory()}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_step import jax_config, make_jaxmoe, timed_steps

    run, sync = make_jaxmoe(jax_config(args.shape))
    for _ in range(3):
        sync(run())
    for i in range(args.steps):
        dt, os_use = timed_steps(run, sync, 1)
        print(f"step {i}: wall {dt:.3f}s user {os_use['user_s']:.2f}s sys {os_use['sys_s']:.2f}s "
              f"minor faults {os_use['minflt']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
