"""Write what a parity run found: ``report.json``, ``report.md`` and plots.

* ``report.json``: the dict from :func:`parity.runner.run_suite` -- ``passed``, ``checks`` (each
  ``name, stage, metric, value, tolerance, passed`` and details), ``first_divergence``, routing
  summary, loss curves, tolerances, options, config, timings.
* ``report.md``: a readable summary and one table row per check (failures first).
* ``loss_curves.png``: the training loss of both frameworks over the N steps, overlaid, with the
  relative difference on a second axis; ``layer_errors.png``: per layer, the error of the
  attention / MoE / dense-FFN outputs (max |jax - torch| / max |torch|, log scale) against the
  tolerance.
* ``summary.json`` / a printed table for ``--all`` (:func:`write_summary`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def assemble(name: str, items: list[dict], *, first_divergence: dict | None, routing, comparison_routing: str,
             curves, layer_errors, grad_worst: dict, tol, opts, n_steps: int, cfg, timings: dict, t0: float,
             mesh=None, fault=None, **extra) -> dict:
    """The report of one parity run (any reference): verdict, checks, what was compared, the run's
    options and config, timings (``t0``: when the run started); ``extra``: a reference's own fields."""
    report = {
        "passed": all(c["passed"] for c in items),
        "name": name,
        "first_divergence": first_divergence,
        "checks": items,
        "n_checks": len(items),
        "n_failed": sum(not c["passed"] for c in items),
        "routing": routing,
        "comparison_routing": comparison_routing,
        "loss_curves": curves,
        "layer_errors": layer_errors,
        "grad_worst": sorted(grad_worst.items(), key=lambda kv: -kv[1])[:10],
        "tolerances": tol.to_dict(),
        "options": dataclasses.asdict(opts),
        "steps": n_steps,
        "mesh": mesh,
        "fault": fault,
        "config": cfg.to_dict(),
        **extra,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }
    report["timings_s"]["total"] = round(time.perf_counter() - t0, 3)
    return report


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.3g}"
    return str(x)


def to_markdown(report: dict) -> str:
    status = "PASSED" if report["passed"] else "FAILED"
    lines = [f"# Parity: {report['name']} -- {status}", ""]
    fd = report.get("first_divergence")
    lines.append(f"* checks: {report['n_checks']}, failed: {report['n_failed']}")
    where = f"{fd['name']} ({fd['metric']} = {_fmt(fd['value'])} > {_fmt(fd['tolerance'])})" if fd else "none"
    lines.append(f"* first divergence: {where}")
    r = report["routing"]
    lines.append(f"* routing mismatches: {r['near_tie']} near-tie, {r['real']} real; comparisons ran with "
                 f"routing: {report['comparison_routing']}")
    if report.get("reference") == "hf":
        lb = report.get("hf_aux_loss")
        lines.append(f"* reference: transformers (hf); HF aux_loss {_fmt(lb)} "
                     f"({'compared' if report.get('lb_compared') else 'a figure: moe.lb_scope is not pooled'})")
    if report.get("fault"):
        lines.append(f"* injected fault (torch side): {report['fault']}")
    if report.get("mesh"):
        lines.append(f"* mesh: {report['mesh']}")
    tol = report["tolerances"]
    lines.append(f"* tolerance profile: {tol['name']}; steps: {report['steps']}")
    lines.append("* timings (s): " + ", ".join(f"{k} {v}" for k, v in report["timings_s"].items()))
    curves = report.get("loss_curves")
    if curves:
        lines.append(f"* final loss: jax {curves['jax'][-1]:.8g}, torch {curves['torch'][-1]:.8g}")
    # the value column is named after the reference the jax side was compared with
    ref = report.get("reference", "torch_ref")
    lines += ["", f"| check | stage | metric | {ref} | tolerance | passed |", "| --- | --- | --- | --- | --- | --- |"]
    for c in sorted(report["checks"], key=lambda c: c["passed"]):
        lines.append(f"| {c['name']} | {c['stage']} | {c['metric']} | {_fmt(c['value'])} | "
                     f"{_fmt(c['tolerance'])} | {'yes' if c['passed'] else '**NO**'} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    curves = report.get("loss_curves")
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        steps = range(len(curves["jax"]))
        ax.plot(steps, curves["torch"], "o-", label="torch_ref", alpha=0.7)
        ax.plot(steps, curves["jax"], "x--", label="jaxmoe")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"loss curves: {report['name']}")
        ax2 = ax.twinx()
        rel = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(curves["jax"], curves["torch"])]
        ax2.semilogy(steps, [max(r, 1e-12) for r in rel], ":", color="gray", label="rel diff")
        ax2.set_ylabel("|jax - torch| / |torch|")
        ax.legend(loc="upper right")
        fig.tight_layout()
        p = out / "loss_curves.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    le = report.get("layer_errors") or {}
    if any(le.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        kinds = [k for k in ("attn_out", "ffn_out", "moe_out") if le.get(k)]
        n_layers = report["config"]["model"]["n_layers"]
        width = 0.8 / max(1, len(kinds))
        for i, k in enumerate(kinds):
            xs = [int(l) + i * width for l in le[k]]
            ax.bar(xs, [max(v, 1e-12) for v in le[k].values()], width=width, label=k)
        ax.axhline(report["tolerances"]["probe_scaled"], color="red", ls="--", label="tolerance")
        ax.set_yscale("log")
        ax.set_xticks([l + 0.4 - width / 2 for l in range(n_layers)], [str(l) for l in range(n_layers)])
        ax.set_xlabel("layer")
        ax.set_ylabel("max |jax - torch| / max |torch|")
        ax.set_title(f"per-layer error: {report['name']}")
        ax.legend()
        fig.tight_layout()
        p = out / "layer_errors.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    return written


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and x != x:
        return None
    return x


def write_report(report: dict, out: str | Path, plots: bool = True) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_jsonable(report), indent=1, allow_nan=True))
    (out / "report.md").write_text(to_markdown(report))
    if plots:
        plot(report, out)
    return out


def summary_row(report: dict) -> dict:
    fd = report.get("first_divergence")
    worst_grad = report["grad_worst"][0] if report.get("grad_worst") else None
    curves = report.get("loss_curves")
    return {
        "name": report["name"],
        "reference": report.get("reference", "torch_ref"),
        "passed": report["passed"],
        "checks": report["n_checks"],
        "failed": report["n_failed"],
        "near_ties": report["routing"]["near_tie"],
        "worst_grad_rel_l2": worst_grad[1] if worst_grad else None,
        "final_loss_rel": (abs(curves["jax"][-1] - curves["torch"][-1]) / abs(curves["torch"][-1])) if curves else None,
        "first_divergence": fd["name"] if fd else None,
        "seconds": report["timings_s"]["total"],
    }


def format_table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    head = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([head, sep, *body])


def write_summary(rows: list[dict], out: str | Path) -> str:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    passed = all(r["passed"] for r in rows)
    (out / "summary.json").write_text(json.dumps(_jsonable({"passed": passed, "runs": rows}), indent=1))
    cols = ["name", "reference", "passed", "checks", "failed", "near_ties", "worst_grad_rel_l2", "final_loss_rel",
            "first_divergence", "seconds"]
    return format_table(rows, cols)


__all__ = ["assemble", "format_table", "plot", "summary_row", "to_markdown", "write_report", "write_summary"]
