"""``jaxmoe plot OUT``: PNG plots from a run's ``metrics.jsonl``.

Writes ``OUT/plots/loss.png`` (train loss and CE, eval CE when present, aux losses on a second
panel) and ``OUT/plots/expert_load.png`` (per MoE layer, a heatmap of each expert's share of the
assignments over steps, plus the max/mean load curve). Matplotlib with the Agg backend: no screen.
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
    return written


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory written by `jaxmoe train --out DIR`")


def run(args) -> int:
    for path in plot_run(Path(args.run_dir)):
        print(path)
    return 0
