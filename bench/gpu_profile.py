"""What ``bench/gpu.py`` reads out of XLA and the profiler: the top kernels of a ``jax.profiler``
trace with the share of time in matmuls, collectives, attention and everything else
(``--profile VARIANT`` and each variant's ``top_kernels``), and the largest allocations of a
compiled step from XLA's buffer-assignment report (``--memory-only``).

Kernels: on a GPU, the events of the device planes' ``Stream`` lines (one per kernel launch:
cuBLAS/cuDNN/Triton/XLA fusion kernel names); on CPU, where a trace has no device plane, the
thunks XLA:CPU runs on its client and Eigen threads (``fusion.12``, ``ynn_fusion``, ``dot.3``, ...;
summed over threads, so shares of thread time, not of wall time; the control-flow thunks
``while``/``cond``/``call``, which hold the others, left out so nothing counts twice). Categories are by name
(:func:`category`): XLA:CPU's ``ynn_*`` thunks are XNNPACK fusions, which XLA:CPU uses for dots,
so they count as matmuls.
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re

CATEGORIES = ("matmul", "collective", "attention", "other")
_COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                         r"collective[-_]?permute|ragged[-_]?all|send|recv", re.I)
_ATTENTION = re.compile(r"fmha|flash|sdpa|attention|cudnn", re.I)
_MATMUL = re.compile(r"gemm|xmma|cutlass|nvjet|wgmma|cublas|matmul|\bdot\b|dot[._-]|^dot|ynn|mosaic|"
                     r"ragged_dot|convolution", re.I)
_SKIP = re.compile(r"^(end: |ThreadpoolListener|ThunkExecutor|Thunk::|\$)")
_CONTROL = re.compile(r"^(while|cond|conditional|call)(\.\d+)?$")  # XLA:CPU thunks that hold others


def category(name: str) -> str:
    """``matmul`` / ``collective`` / ``attention`` / ``other`` from a kernel's name."""
    if _COLLECTIVE.search(name):
        return "collective"
    if _ATTENTION.search(name):
        return "attention"
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def find_xplane(trace_dir: str) -> str:
    """The newest ``*.xplane.pb`` that ``jax.profiler.trace(trace_dir)`` wrote."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    return files[-1]


def kernel_times(xplane_path: str) -> tuple[str, dict]:
    """``(source, {kernel name: total ns})`` from a trace: device kernels if the trace has a
    device plane, else XLA:CPU's thunks on its client threads."""
    import jax

    pd = jax.profiler.ProfileData.from_file(xplane_path)
    dev, host = collections.Counter(), collections.Counter()
    for plane in pd.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            if on_device and line.name.startswith("Stream"):
                for e in line.events:
                    dev[e.name] += e.duration_ns
            elif not on_device and plane.name.startswith("/host:") and line.name.startswith("tf_XLA"):
                for e in line.events:  # XLA:CPU's client and Eigen threads run the thunks
                    if not (_SKIP.match(e.name) or _CONTROL.match(e.name)):
                        host[e.name] += e.duration_ns
    if dev:
        return "device kernels (Stream lines of the device planes)", dict(dev)
    return "host: XLA:CPU thunks on its threads (no device plane in this trace)", dict(host)


def summarize(source: str, times: dict, top: int = 15) -> dict:
    """The ``top`` kernels by time (name, ms, share, category) and the time per category."""
    total = sum(times.values()) or 1.0
    by_cat = collections.Counter()
    for name, ns in times.items():
        by_cat[category(name)] += ns
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"source": source, "total_ms": total / 1e6, "n_kernels": len(times),
            "kernels": [{"name": n[:160], "ms": ns / 1e6, "share": ns / total, "category": category(n)}
                        for n, ns in ranked],
            "shares": {c: by_cat[c] / total for c in CATEGORIES}}


def profile_table(summary: dict) -> str:
    lines = [f"top {len(summary['kernels'])} of {summary['n_kernels']} kernels, {summary['total_ms']:.1f} ms in all "
             f"({summary['source']}):"]
    for k in summary["kernels"]:
        lines.append(f"  {k['ms']:10.3f} ms {100 * k['share']:5.1f}%  {k['category']:10s} {k['name'][:90]}")
    lines.append("  shares: " + ", ".join(f"{c} {100 * summary['shares'][c]:.1f}%" for c in CATEGORIES))
    return "\n".join(lines)


# -- memory --------------------------------------------------------------------------------------

_ALLOC = re.compile(r"^\s*[\d.]+\w*\(\s*\d+%\);\s*([\d.]+)(\w+);\s*(\d+);\s*(\d+);\s*(.*)$")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _memory_report(dump_dir: str) -> str:
    """The path of the compiled step's (the largest) ``*memory-usage-report.txt`` in ``dump_dir``."""
    reports = glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt"))
    if not reports:
        raise FileNotFoundError(f"no memory-usage report under {dump_dir}")
    return max(reports, key=os.path.getsize)


_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]+)\]")


def square_buffers(dump_dir: str, s: int, min_elements: int = 0) -> list[str]:
    """The distinct buffer shapes of the compiled step (XLA's memory-usage report) whose last two
    dims are ``[s, s]`` and that hold at least ``min_elements`` values: attention score stacks
    (with ``min_elements`` = B x H x S x S, a ``[.., D, D]`` weight where D == S is not one)."""
    with open(_memory_report(dump_dir)) as f:
        text = f.read()
    out = set()
    for m in _SHAPE.finditer(text):
        dims = [int(x) for x in m.group(1).split(",")]
        if len(dims) >= 2 and dims[-2:] == [s, s] and math.prod(dims) >= min_elements:
            out.add(m.group(0))
    return sorted(out)


def largest_allocations(dump_dir: str, top: int = 5) -> list[dict]:
    """The ``top`` largest allocations of the compiled step from XLA's
    ``*memory-usage-report.txt`` (written with ``xla_dump_to``): size and the shapes of the
    values that share it (XLA reuses one allocation for values whose live ranges do not meet)."""
    out = []
    with open(_memory_report(dump_dir)) as f:
        for line in f:
            m = _ALLOC.match(line)
            if m:
                out.append({"bytes": int(float(m.group(1)) * _UNITS.get(m.group(2), 1)),
                            "values": int(m.group(4)), "shapes": m.group(5).strip()[:300]})
    out.sort(key=lambda a: -a["bytes"])
    return out[:top]


__all__ = ["CATEGORIES", "category", "find_xplane", "kernel_times", "largest_allocations", "profile_table",
           "square_buffers", "summarize"]
