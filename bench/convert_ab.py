"""One conversion route timed with two jaxmoe checkouts, interleaved (A, B, A, B, ...).

    python bench/convert_ab.py --a /path/to/old/checkout --b . --from orbax:RUN --to dcp:OUT [--runs 5]
                               [--titan CONFIG] [--pause 5]

On a noisy machine two full ``bench/convert.py`` runs a few minutes apart can differ by 2x (the
VM's disk probe alone moved 1.3-2.5 GB/s in one day), so comparing a change against its parent
needs both timed alternately on the same machine state. Each run is a fresh subprocess with
``PYTHONPATH`` set to its checkout, which drops the source from the page cache, rests
``--pause`` seconds (on a VM that hands free memory back to the host, every run then starts from
the same state), imports what every conversion needs (jaxmoe, jax, Orbax, the model module), and
times ``jaxmoe convert`` in-process until it returns (its output is fsync'd by then). The output is
removed before each run. Prints each pair and the medians; figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, shutil, sys, time
argv, out, src, pause = json.loads(sys.argv[1])
import jaxmoe, jaxmoe.checkpoint.checkpointer, jaxmoe.cli, jaxmoe.model.transformer  # noqa: E401,F401
import jaxmoe.port.commands.convert  # noqa: F401
shutil.rmtree(out, ignore_errors=True)
if os.path.isfile(out):
    os.unlink(out)
for root, _, files in os.walk(src) if os.path.isdir(src) else [(os.path.dirname(src), [], [os.path.basename(src)])]:
    for f in files:
        fd = os.open(os.path.join(root, f), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
time.sleep(pause)
from jaxmoe.cli import main
t0 = time.perf_counter()
rc = main(argv)
print("AB " + json.dumps({"rc": rc, "seconds": time.perf_counter() - t0, "jaxmoe": jaxmoe.__file__}))
"""


def run_one(checkout: Path, argv: list[str], out: str, src: str, pause: float) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # cwd: the checkout (``python -c`` puts the cwd first on sys.path)
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps([argv, out, src, pause])],
                       env=env, capture_output=True, text=True, cwd=checkout)
    line = next((x for x in p.stdout.splitlines() if x.startswith("AB ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{checkout}: the conversion failed:\n{p.stderr[-2000:]}")
    rec = json.loads(line[3:])
    if rec["rc"]:
        raise SystemExit(f"{checkout}: jaxmoe convert exited {rec['rc']}:\n{p.stderr[-2000:]}")
    if not Path(rec["jaxmoe"]).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"{checkout}: the child imported jaxmoe from {rec['jaxmoe']}, not this "
                         "checkout (an installed jaxmoe shadows PYTHONPATH?)")
    return rec["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (the parent, say)")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (the change)")
    ap.add_argument("--from", dest="src", required=True, help="source endpoint, e.g. orbax:RUN")
    ap.add_argument("--to", dest="dst", required=True, help="destination endpoint (removed before each run)")
    ap.add_argument("--titan", help="--titan for a dcp: source")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pause", type=float, default=5.0)
    args = ap.parse_args()
    for side in (args.a, args.b):
        if not (side / "jaxmoe" / "__init__.py").is_file():
            raise SystemExit(f"--a/--b {side}: not a jaxmoe checkout (no jaxmoe/__init__.py)")
    if ":" not in args.src or ":" not in args.dst:
        raise SystemExit("--from/--to: expected SCHEME:PATH endpoints (hf:DIR, orbax:RUN, dcp:DIR, torch:FILE)")
    (ss, sp), (ds, dp) = args.src.split(":", 1), args.dst.split(":", 1)
    step = "@" + sp.rsplit("@", 1)[1] if ss == "orbax" and "@" in sp else ""
    src, out = str(Path(sp[:len(sp) - len(step)]).absolute()), str(Path(dp).absolute())
    titan = [] if not args.titan else ["--titan", str(Path(args.titan).absolute())
                                       if Path(args.titan).exists() else args.titan]
    argv = ["convert", "--from", f"{ss}:{src}{step}", "--to", f"{ds}:{out}"] + titan
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.runs):
        for name, side in (("A", args.a), ("B", args.b)):
            times[name].append(run_one(side, argv, out, src, args.pause))
        print(f"run {i + 1}: A {times['A'][-1]:.2f} s  B {times['B'][-1]:.2f} s", flush=True)
    ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"median: A {ma:.2f} s  B {mb:.2f} s  (A/B {ma / mb:.2f}x)")


if __name__ == "__main__":
    main()
