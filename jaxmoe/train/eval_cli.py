"""``jaxmoe eval``: cross-entropy, perplexity and per-expert load of a checkpoint on a data spec.

The checkpoint is read as ``jaxmoe logits`` reads it (any endpoint, fp32 weights); the batches come
from the training data pipeline (:func:`jaxmoe.data.make_data`) on ``--data SPEC`` (the specs of
``train --data``: ``default``, ``tokens:PATH``, ``text:PATH``, ``mix:...``), its held-out split by
default, in rows of ``--seq-len`` tokens packed as ``--packing`` says (``windows``: fixed windows
across documents; ``documents``: documents packed with their masks and positions, padding not
counted). The CE is the mean next-token cross-entropy over the first ``--tokens`` counted targets
(row-major over the batches; the held-out split repeats when it is shorter); ``ppl = exp(ce)``.
``expert_load``: tokens routed to each expert per MoE layer over the batches read (real tokens
only: a packed row's padding is not counted).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.port.commands.convert import load_numpy_tree
from jaxmoe.port.commands.generate import TOKENIZER_FILE, decode_config
from jaxmoe.port.formats import add_arguments, bind_options, endpoint_help, open_source, option_values, parse_endpoint


def add_args(p) -> None:
    p.add_argument("--ckpt", required=True, help=endpoint_help())
    p.add_argument("--data", required=True, metavar="SPEC",
                   help="default | tokens:PATH(.bin/.npy) | text:PATH | mix:W*SPEC,... (as train --data)")
    p.add_argument("--tokens", type=int, default=16384, metavar="N", help="targets evaluated (default 16384)")
    p.add_argument("--split", choices=("eval", "train"), default="eval",
                   help="the data's held-out split (default) or its training split")
    p.add_argument("--seq-len", type=int, default=512, metavar="S", help="tokens per row (default 512)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per forward (default 8)")
    p.add_argument("--packing", choices=("windows", "documents"), default="windows",
                   help="rows: fixed windows (default) or documents packed with masks (data.packing)")
    p.add_argument("--doc-sep-id", type=int, default=-1, metavar="ID",
                   help="--packing documents on a flat token stream: its separator id (data.doc_sep_id)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json for text: data (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help='print {"ce", "ppl", "tokens", "expert_load"}')
    add_arguments(p, ("source",))


def eval_config(cfg, args, tokenizer: str = ""):
    """The checkpoint's config with the data flags in ``data`` / ``train`` (what make_data reads)."""
    if args.tokens < 1 or args.seq_len < 1 or args.batch_size < 1:
        raise UserError("--tokens, --seq-len and --batch-size must each be >= 1")
    if args.seq_len > cfg.model.max_seq_len:
        raise UserError(f"--seq-len {args.seq_len} exceeds the model's context (model.max_seq_len="
                        f"{cfg.model.max_seq_len}): give a shorter --seq-len")
    cfg = decode_config(cfg)
    data = dataclasses.replace(cfg.data, source=args.data, packing=args.packing, doc_sep_id=args.doc_sep_id,
                               tokenizer=args.tokenizer or tokenizer, workers=0)
    train = dataclasses.replace(cfg.train, seq_len=args.seq_len, batch_size=args.batch_size, micro_batches=1)
    return dataclasses.replace(cfg, data=data, train=train)


def make_eval_fn(cfg):
    """jitted ``(params, buffers, batch) -> (nll [B, S] fp32 with the mask applied, counts [Lm, E]
    of the real tokens' expert choices)``."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.model.transformer import apply_model

    def fn(params, buffers, batch):
        logits, aux = apply_model(cfg, params, buffers, batch["inputs"], segment_ids=batch.get("segment_ids"),
                                  positions=batch.get("positions"))
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        # tokens per expert over the real tokens only (a packed row's padding is routed too)
        real = (batch["segment_ids"] > 0) if "segment_ids" in batch else jnp.ones(batch["inputs"].shape, bool)
        idx = aux["router"]["topk_idx"]  # [Lm, T, k]
        hot = jax.nn.one_hot(idx, cfg.moe.n_experts, dtype=jnp.int32) * real.reshape(1, -1, 1, 1)
        return nll * batch["mask"], hot.sum(axis=(1, 2))

    return jax.jit(fn)


def evaluate(cfg, params, buffers, n_tokens: int, split: str = "eval") -> dict:
    """``{"ce", "ppl", "tokens", "expert_load"}`` over the first ``n_tokens`` targets (module doc)."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.data import make_data

    data = make_data(cfg, split, workers=0)
    fn = make_eval_fn(cfg)
    params, buffers = jax.tree.map(jnp.asarray, (params, buffers))
    total, seen, counts = 0.0, 0, None
    try:
        while seen < n_tokens:
            batch = data.next_batch()
            nll, c = fn(params, buffers, {k: jnp.asarray(v) for k, v in batch.items()})
            mask = batch["mask"].reshape(-1) > 0
            nll = np.asarray(nll, np.float64).reshape(-1)[mask][: n_tokens - seen]
            if not mask.any():
                raise UserError(f"--data {cfg.data.source}: a batch with no target to count")
            total += float(nll.sum())
            seen += len(nll)
            counts = np.asarray(c, np.int64) if counts is None else counts + np.asarray(c, np.int64)
    finally:
        data.close()
    ce = total / seen
    return {"ce": ce, "ppl": math.exp(ce), "tokens": seen, "expert_load": expert_load(cfg, counts)}


def expert_load(cfg, counts) -> dict:
    """Per MoE layer (model layer index): routed tokens per expert, their share, max/mean load and
    the experts that received none."""
    if counts is None or counts.size == 0:
        return {"layers": [], "counts": [], "fraction": [], "max_over_mean": [], "dead": []}
    first = cfg.model.first_k_dense
    frac = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    mean = np.maximum(counts.mean(-1), 1e-12)
    return {"layers": [first + i for i in range(len(counts))], "counts": counts.tolist(),
            "fraction": np.round(frac, 6).tolist(), "max_over_mean": np.round(counts.max(-1) / mean, 4).tolist(),
            "dead": [[int(first + i), int(e)] for i, e in zip(*np.nonzero(counts == 0))]}


def run(args) -> int:
    ep, _ = bind_options(option_values(args, ("source",)), source=parse_endpoint(args.ckpt, "--ckpt"))
    with open_source(ep) as source:
        meta, cfg = source.meta_dir, source.cfg
    tok = str(meta / TOKENIZER_FILE) if meta is not None and (meta / TOKENIZER_FILE).is_file() else ""
    cfg = eval_config(cfg, args, tok)  # flags checked before the weights are read
    _, params, buffers = load_numpy_tree(ep)
    out = evaluate(cfg, params, buffers, args.tokens, args.split)
    if args.json:
        print(json.dumps(out))
        return 0
    load = out["expert_load"]
    print(f"{args.data} ({args.split} split): ce {out['ce']:.6f}, ppl {out['ppl']:.4f} over {out['tokens']} tokens")
    for layer, r in zip(load["layers"], load["max_over_mean"]):
        dead = [e for ly, e in load["dead"] if ly == layer]
        print(f"  layer {layer}: max/mean expert load {r:.3f}" + (f", no tokens: experts {dead}" if dead else ""))
    return 0


__all__ = ["add_args", "eval_config", "evaluate", "expert_load", "make_eval_fn", "run"]
