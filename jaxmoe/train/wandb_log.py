"""Weights & Biases beside TensorBoard (``train.wandb = true``; the ``[wandb]`` extra).

Every row of ``metrics.jsonl`` is logged at its step: numbers under their own key; the per-layer
lists as one key per MoE layer (``expert_load_max_mean/moe_layer_N``; ``expert_counts/moe_layer_N``
as a tokens-per-expert histogram); a dict (``data_tokens``) as ``KEY/NAME``; text
(``mfu_peak_source``) in the run's summary. The run id is kept in ``RUN_DIR/wandb.json``, so
``--resume`` continues the same W&B run: online, rewound to the step the run resumes from
(``resume_from=ID?_step=N``, as ``metrics.jsonl`` is cut there); offline
(``train.wandb_mode = "offline"`` or ``WANDB_MODE=offline``), a new offline segment of the same
id whose steps start after the resumed step (``wandb sync`` uploads them).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import numpy as np

from jaxmoe.extras import require

ID_FILE = "wandb.json"


def open_wandb(cfg, run_path: Path, start: int):
    """The W&B run of this training run, or None when ``train.wandb`` is off."""
    t = cfg.train
    if not t.wandb:
        return None
    wandb = require("wandb", "train.wandb")
    f = Path(run_path) / ID_FILE
    rid = json.loads(f.read_text())["id"] if f.is_file() else secrets.token_hex(4)  # a W&B run id: [a-z0-9]
    f.write_text(json.dumps({"id": rid}) + "\n")
    mode = os.environ.get("WANDB_MODE") or t.wandb_mode
    kw = dict(project=t.wandb_project, name=t.wandb_name or Path(run_path).name, mode=mode,
              tags=[s.strip() for s in t.wandb_tags.split(",") if s.strip()], dir=str(run_path),
              config=json.loads(cfg.to_json()))
    if start > 0 and mode == "online":
        kw["resume_from"] = f"{rid}?_step={start}"
    else:
        kw.update(id=rid, resume="allow")
    return wandb.init(**kw)


def log_row(run, step: int, rec: dict) -> None:
    """One ``metrics.jsonl`` row into ``run`` (the module doc: which key goes where)."""
    import wandb

    out = {}
    for k, v in rec.items():
        if k == "step":
            continue
        if isinstance(v, bool) or isinstance(v, (int, float)) or v is None:
            out[k] = float(v) if v is not None else float("nan")
        elif isinstance(v, str):
            run.summary[k] = v
        elif k == "expert_counts":
            for i, c in enumerate(v):
                c = np.asarray(c, np.float64)
                out[f"{k}/moe_layer_{i}"] = wandb.Histogram(np_histogram=(c, np.arange(len(c) + 1) - 0.5))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                out[f"{k}/moe_layer_{i}"] = x
        elif isinstance(v, dict):  # e.g. data_tokens: tokens read per data source
            for sub, x in v.items():
                out[f"{k}/{sub}"] = x
    run.log(out, step=step)


__all__ = ["ID_FILE", "log_row", "open_wandb"]
