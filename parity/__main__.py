"""``python -m parity run|selftest ...`` (see parity.cli)."""

from __future__ import annotations

import argparse
import os
import sys


def _wants_devices(argv: list[str]) -> int:
    """Fake CPU devices needed by --mesh (or by --all, whose matrix has a mesh run)."""
    if "--all" in argv:
        return 8
    for i, a in enumerate(argv):
        if a.startswith("--mesh="):
            spec = a.split("=", 1)[1]
        else:
            spec = argv[i + 1] if a == "--mesh" and i + 1 < len(argv) else None
        if spec:
            n = 1
            for part in spec.split(","):
                try:
                    v = int(part.split("=", 1)[1])
                except (IndexError, ValueError):
                    return 8
                n *= 8 if v == -1 else v
            return max(n, 1)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    n = _wants_devices(argv)
    if n > 1:
        # must happen before jax is imported anywhere: XLA reads it when its CPU backend starts
        flag = "--xla_force_host_platform_device_count"
        flags = os.environ.get("XLA_FLAGS", "")
        if flag not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()
    from parity.cli import add_args_parity, run_parity

    parser = argparse.ArgumentParser(prog="python -m parity", description="jaxmoe vs torch_ref parity suites")
    add_args_parity(parser)
    args = parser.parse_args(argv)
    args._standalone = True
    return run_parity(args)


if __name__ == "__main__":
    sys.exit(main())
