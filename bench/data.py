"""Input pipeline throughput (tokens/s of ``jaxmoe.data.make_data``) per source format, with 0 and 2
Grain worker processes, windows and documents packing, next to the train step's tokens/s on
``bench/train_step.py``'s shapes (B=8, S=256, vocab 8192), with the ratio pipeline / step.

    python bench/data.py [--shape coarse|fine] [--batches 40] [--tokens 2000000] [--json]

The files are written to a temporary directory first: a uint16 token file of ``--tokens`` random
ids (documents of 20..1000 tokens, each ending with separator id 0), a JSONL text file of the same
order of size with a byte-level BPE tokenizer trained on it (vocab 1024), and -- when this checkout's
``jaxmoe.data.sources`` reads them -- the same documents as parquet (column ``ids``), array_record
(one record of int32 little-endian ids per document) and an HF ``datasets`` directory (column
``ids``); a format the sources refuse is reported as skipped, with the reason. Each pipeline
figure: two untimed batches (worker start, first reads), then ``--batches`` batches timed. The step
figure: three untimed steps (compilation, warm-up), then five timed. Figures are reported, never
asserted; the 2-core machine is shared, so the absolute numbers move with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as ts  # the bench shapes and the step timing


def write_files(d: Path, n_tokens: int) -> dict:
    """{format: (data.source spec, extra --set overrides)} for the files written under ``d``."""
    rng = np.random.default_rng(0)
    docs, total = [], 0
    while total < n_tokens:
        n = int(rng.integers(20, 1000))
        docs.append(np.r_[rng.integers(1, ts.V, n - 1), 0].astype(np.int32))
        total += n
    np.concatenate(docs).astype(np.uint16).tofile(d / "tokens.bin")
    words = np.array("the of and to in is was for on that with as by at from his her it an".split())
    with open(d / "text.jsonl", "w") as f:
        for doc in docs[: len(docs) // 2]:
            f.write(json.dumps({"text": " ".join(words[doc % len(words)])}) + "\n")
    from jaxmoe.data.tokenize import train_tokenizer

    train_tokenizer([str(d / "text.jsonl")], 1024).save(str(d / "tok.json"))
    out = {"tokens": (f"tokens:{d}/tokens.bin", ["data.doc_sep_id=0"]),
           "text": (f"text:{d}/text.jsonl", [f"data.tokenizer={d}/tok.json"])}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"ids": [x.tolist() for x in docs]}), d / "docs.parquet")
        out["parquet"] = (f"parquet:{d}/docs.parquet#ids", [])
    except Exception as e:  # noqa: BLE001 - reported
        out["parquet"] = (None, [f"cannot write: {e}"])
    try:
        from jaxmoe.data.sources import write_arrayrecord

        write_arrayrecord(d / "docs.array_record", docs)
        out["arrayrecord"] = (f"arrayrecord:{d}/docs.array_record", [])
    except Exception as e:  # noqa: BLE001
        out["arrayrecord"] = (None, [f"cannot write: {e}"])
    try:
        import datasets

        datasets.Dataset.from_dict({"ids": [x.tolist() for x in docs]}).save_to_disk(str(d / "hfds"))
        out["hfds"] = (f"hfds:{d}/hfds#ids", [])
    except Exception as e:  # noqa: BLE001
        out["hfds"] = (None, [f"cannot write: {e}"])
    return out


def pipeline_tokens_per_s(shape: str, spec: str, sets, packing: str, workers: int, batches: int):
    from jaxmoe.data import make_data

    cfg = ts.jax_config(shape, [f"data.source={spec}", f"data.packing={packing}",
                                f"data.workers={workers}", *sets])
    src = make_data(cfg)
    try:
        for _ in range(2):
            src.next_batch()
        t = time.perf_counter()
        real = 0
        for _ in range(batches):
            b = src.next_batch()
            real += int((b["segment_ids"] > 0).sum()) if "segment_ids" in b else b["inputs"].size
        dt = time.perf_counter() - t
    finally:
        src.close()
    return ts.B * ts.S * batches / dt, real / (ts.B * ts.S * batches)


def step_tokens_per_s(shape: str) -> float:
    run, sync = ts.make_jaxmoe(ts.jax_config(shape))
    for _ in range(3):
        sync(run())
    dt, _ = ts.timed_steps(run, sync, 5)
    return ts.B * ts.S * 5 / dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(ts.SHAPES), default="coarse")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from jaxmoe.errors import UserError

    step = step_tokens_per_s(args.shape)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, (spec, sets) in write_files(Path(tmp), args.tokens).items():
            for packing in ("windows", "documents"):
                for workers in (0, 2):
                    row = {"format": fmt, "packing": packing, "workers": workers}
                    if spec is None:
                        row["skipped"] = sets[0]
                    else:
                        try:
                            tok_s, fill = pipeline_tokens_per_s(args.shape, spec, sets, packing, workers,
                                                                args.batches)
                            row.update(tokens_per_s=tok_s, fill=fill, ratio_to_step=tok_s / step)
                        except UserError as e:
                            row["skipped"] = str(e)
                    rows.append(row)
                    if not args.json:
                        figs = (f"{row['tokens_per_s']:>12,.0f} tok/s  fill {row['fill']:.3f}  "
                                f"x{row['ratio_to_step']:,.1f} the step" if "tokens_per_s" in row
                                else f"skipped: {row['skipped']}")
                        print(f"{fmt:12s} {packing:9s} workers={workers}  {figs}", flush=True)
    if args.json:
        print(json.dumps({"shape": args.shape, "step_tokens_per_s": step, "pipeline": rows}))
    else:
        print(f"train step ({args.shape}, B={ts.B}, S={ts.S}): {step:,.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
