"""``jaxmoe plot OUT``: PNG plots from a run's ``metrics.jsonl``.

Writes ``OUT/plots/loss.png`` (train loss and CE, eval CE when present, aux losses on a second
panel) and ``OUT/plots/expert_load.png`` (per MoE layer, a heatmap of each expert's share of the
assignments over steps, plus the max/mean load curve) and ``OUT/plots/expert_heatmap.png`` (layer x
expert: each expert's share of its layer's assignments over the whole run, experts that never
received a token marked; beside it the max/mean load of each layer over steps). Matplotlib with
the Agg backend: no screen.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxmoe.errors import UserError
from jaxmoe.extras import require


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path} not found; pass the --out directory of a `jaxmoe train` run")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{path}:{i} is not valid JSON; the file is corrupt") from None
    if not rows:
        raise UserError(f"{path} holds no steps yet")
    return rows


def plot_run(run_dir: Path) -> list[Path]:
    matplotlib = require("matplotlib", "jaxmoe plot")  # late: the optional [plot] extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for key, style in (("loss", "-"), ("ce", "--")):
        ax.plot(steps, [r.get(key) for r in rows], style, label=f"train {key}")
    ev = [(r["step"], r["eval_ce"]) for r in rows if "eval_ce" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval ce")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(f"{run_dir.name}: loss")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    for key in ("lb", "seq_aux", "router_z", "z_loss"):
        vals = [r.get(key) for r in rows]
        if any(v for v in vals if v is not None):
            ax.plot(steps, vals, label=key)
    ax.set_xlabel("step")
    ax.set_title("aux and z losses (unweighted)")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "loss.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)

    counts = [r.get("expert_counts") for r in rows]
    if all(c is not None for c in counts) and counts:
        c = np.asarray(counts, dtype=np.float64)  # [steps, Lm, E]
        share = c / np.maximum(c.sum(-1, keepdims=True), 1)
        n_layers = c.shape[1]
        fig, axes = plt.subplots(n_layers + 1, 1, figsize=(10, 2.2 * (n_layers + 1)), squeeze=False)
        for layer in range(n_layers):
            ax = axes[layer, 0]
            im = ax.imshow(share[:, layer, :].T, aspect="auto", origin="lower", cmap="viridis",
                           extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, c.shape[2] - 0.5))
            ax.set_ylabel(f"MoE layer {layer}\nexpert")
            fig.colorbar(im, ax=ax, label="share of assignments")
        ax = axes[n_layers, 0]
        load = np.asarray([r["expert_load_max_mean"] for r in rows])
        for layer in range(n_layers):
            ax.plot(steps, load[:, layer], label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel("max / mean load")
        ax.legend(ncol=min(n_layers, 6), fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out / "expert_load.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
        written.append(plot_heatmap(plt, out / "expert_heatmap.png", run_dir.name, steps, c, load))
    return written


def plot_heatmap(plt, path: Path, name: str, steps: list, counts, load) -> Path:
    """Layer x expert share of the run's assignments (``counts [steps, Lm, E]``), dead experts
    crossed, and the max/mean load per layer over steps (``load [steps, Lm]``)."""
    import numpy as np

    total = counts.sum(0)  # [Lm, E]
    share = total / np.maximum(total.sum(-1, keepdims=True), 1)
    n_layers, n_exp = share.shape
    fig, axes = plt.subplots(1, 2, figsize=(13, max(3.0, 0.45 * n_layers + 2)),
                             gridspec_kw={"width_ratios": [max(n_exp, 8) / 8, 1.2]})
    ax = axes[0]
    im = ax.imshow(share, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                   extent=(-0.5, n_exp - 0.5, -0.5, n_layers - 0.5))
    dead = np.argwhere(total == 0)
    if len(dead):
        ax.scatter(dead[:, 1], dead[:, 0], marker="x", color="red", s=30, label="no tokens")
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(n_layers))
    ax.set_title(f"{name}: share of assignments, steps {steps[0]}-{steps[-1]} (uniform = {1 / n_exp:.3f})")
    fig.colorbar(im, ax=ax, label="share of the layer's assignments")
    ax = axes[1]
    for layer in range(n_layers):
        ax.plot(steps, load[:, layer], label=f"layer {layer}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean expert load")
    ax.set_title("imbalance over time")
    ax.legend(ncol=2 if n_layers > 6 else 1, fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory written by `jaxmoe train --out DIR`")


def run(args) -> int:
    for path in plot_run(Path(args.run_dir)):
        print(path)
    return 0
