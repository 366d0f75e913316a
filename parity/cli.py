"""The parity command line: ``python -m parity run|selftest ...`` and ``jaxmoe parity ...``.

``run``: one comparison (``--preset``, ``--set``, ``--dtype``, ``--steps``, ``--optimizer``,
``--seed``, ``--out``, ``--mesh``, ``--force-routing``, ``--profile``, ``--packed``, ``--fp8``) or the whole coverage
matrix (``--all``, see :data:`MATRIX`), writing report.json / report.md / plots per run and, for
``--all``, summary.json plus a printed table. ``selftest``: fault injection
(:mod:`parity.faults`). Exit status 0 when everything passed, 1 when a check failed, 2 for bad
input (a one-line error).

jax is imported only when a run starts (so ``--help`` is instant and ``--mesh`` can still set
the number of fake CPU devices).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmoe.config import ConfigError
from jaxmoe.errors import UserError

DEFAULT_OUT = Path("runs") / "parity"

# The coverage matrix of `run --all`: (label, preset, overrides, extra RunOptions fields).
MATRIX = [
    ("tiny", "tiny", [], {}),
    ("tiny-mla", "tiny-mla", [], {}),
    ("mixtral-tiny", "mixtral-tiny", [], {}),
    ("tiny-dense", "tiny", ["moe.compute_path=dense"], {}),
    ("tiny-ragged", "tiny", ["moe.compute_path=ragged"], {}),
    ("tiny-mla-dense", "tiny-mla", ["moe.compute_path=dense"], {}),
    ("tiny-mla-ragged", "tiny-mla", ["moe.compute_path=ragged"], {}),
    ("tiny-capacity0.5", "tiny", ["moe.compute_path=dense", "moe.capacity_factor=0.5"], {}),
    ("tiny-mla-capacity0.75", "tiny-mla", ["moe.compute_path=dense", "moe.capacity_factor=0.75"], {}),
    ("tiny-mla-bias-rate1e-2", "tiny-mla", ["moe.bias_update_rate=0.01"], {}),
    # torchtitan's default recipe: an expert bias on softmax scores (selection only)
    ("tiny-softmax-bias", "tiny", ["moe.use_expert_bias=true", "moe.bias_update_rate=0.01"], {}),
    ("tiny-micro2", "tiny", ["train.micro_batches=2"], {}),
    ("tiny-mla-micro2", "tiny-mla", ["train.micro_batches=2"], {}),
    ("tiny-muon", "tiny", [], {"optimizer": "muon"}),
    ("tiny-mla-muon", "tiny-mla", [], {"optimizer": "muon"}),
    ("mixtral-tiny-muon", "mixtral-tiny", [], {"optimizer": "muon"}),
    ("tiny-bf16", "tiny", [], {"dtype": "bfloat16"}),
    ("tiny-mla-bf16", "tiny-mla", [], {"dtype": "bfloat16"}),
    ("mixtral-tiny-bf16", "mixtral-tiny", [], {"dtype": "bfloat16"}),
    # bf16 with one side's routing imposed on the other: gradients gated tightly (the natural
    # bf16 runs above report their gradients as figures; parity.tolerances)
    ("tiny-bf16-forced", "tiny", [], {"dtype": "bfloat16", "force_routing": "torch"}),
    ("tiny-mla-bf16-forced", "tiny-mla", [], {"dtype": "bfloat16", "force_routing": "torch"}),
    ("mixtral-tiny-bf16-forced", "mixtral-tiny", [], {"dtype": "bfloat16", "force_routing": "torch"}),
    ("tiny-mla-force-torch", "tiny-mla", [], {"force_routing": "torch"}),
    ("tiny-force-jax", "tiny", [], {"force_routing": "jax"}),
    ("tiny-mla-mesh-expert4-fsdp2", "tiny-mla", [], {"mesh": "expert=4,fsdp=2"}),
    # packed documents: segment masks and per-document RoPE positions on both sides
    ("tiny-packed", "tiny", [], {"packed": True}),
    ("tiny-mla-packed", "tiny-mla", [], {"packed": True}),
    ("tiny-mla-packed-micro2", "tiny-mla", ["train.micro_batches=2"], {"packed": True}),
    # transformers as the reference (parity.hf_runner)
    ("tiny-hf", "tiny", [], {"reference": "hf"}),
    ("tiny-mla-hf", "tiny-mla", [], {"reference": "hf"}),
    ("mixtral-tiny-hf", "mixtral-tiny", [], {"reference": "hf"}),
]


def add_args_parity(p: argparse.ArgumentParser) -> None:
    """Sub-actions ``run`` and ``selftest`` on ``p`` (used by ``python -m parity`` and by
    ``jaxmoe parity``)."""
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = sub.add_parser("run", help="compare jaxmoe and torch_ref on one config (or --all)",
                       description="Compare jaxmoe and torch_ref: routing, activations, losses, "
                                   "gradients of every parameter and N optimizer steps.")
    r.add_argument("--preset", default=None, help="preset name (default tiny)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override (repeatable), e.g. --set moe.compute_path=dense")
    r.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype on both sides (master weights stay fp32)")
    r.add_argument("--steps", type=int, default=None, help="optimizer steps to compare (default: 20, "
                   "or 2 with --profile fast); 0 skips the training check")
    r.add_argument("--optimizer", choices=("adamw", "muon"), default=None, help="default: the preset's")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help=f"report directory (default {DEFAULT_OUT}/NAME)")
    r.add_argument("--mesh", default=None, help="run jaxmoe on a device mesh, e.g. expert=4,fsdp=2 "
                   "(fake CPU devices are created when needed)")
    r.add_argument("--force-routing", choices=("torch", "jax"), default=None,
                   help="replay one side's expert choices in the other (torch: jax replays torch's)")
    r.add_argument("--profile", choices=("fast", "full"), default="full",
                   help="run size: fast = 4x32 tokens, 2 steps; full = the preset's batch, 20 steps")
    r.add_argument("--reference", choices=("torch_ref", "hf", "torchtitan"), default="torch_ref",
                   help="the other side: torch_ref (default), hf (transformers' own model; --steps N "
                        "trains it with torch AdamW, 0 compares one forward/backward) or torchtitan "
                        "(torchtitan's model of --titan FAMILY/FLAVOR; --steps 0 compares one forward/"
                        "backward, N trains both with torchtitan's AdamW, schedule and bias hook)")
    r.add_argument("--titan", default=None, metavar="FAMILY/FLAVOR",
                   help="--reference torchtitan: the torchtitan flavor, e.g. deepseek_v3/debugmodel "
                        "(the jaxmoe config is derived from it; --set may still change train.*)")
    r.add_argument("--titan-set", dest="titan_overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="edit every layer's torchtitan config before both sides are built, e.g. "
                        "--titan-set moe.router.score_func=sigmoid (repeatable)")
    r.add_argument("--fp8", choices=("tensorwise", "rowwise", "blockwise"), default=None, metavar="RECIPE",
                   help="FP8 training on both sides (compute.fp8=RECIPE: tensorwise, rowwise or blockwise; "
                        "torch_ref mirrors each recipe) with that recipe's tolerance profile")
    r.add_argument("--init-scale", type=float, default=None, metavar="S",
                   help="multiply the init's weight matrices by S (default 8: logit std ~1.3, decisive "
                        "routing; 1 = the plain init)")
    r.add_argument("--packed", action="store_true",
                   help="batches of packed documents (segment_ids, per-document positions): attention "
                        "masked at document boundaries and RoPE per document, on both sides (torch_ref, "
                        "or torchtitan's flex block-causal forward with --steps 0)")
    r.add_argument("--all", action="store_true", help="run the whole coverage matrix; write summary.json")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    s = sub.add_parser("selftest", help="inject faults into torch_ref and check that they are caught",
                       description="Fault injection: each fault must fail the suite with the expected "
                                   "first divergence; each baseline must pass.")
    s.add_argument("--profile", choices=("fast", "full"), default="fast")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--init-scale", type=float, default=None, metavar="S",
                   help="multiply the init's weight matrices by S (default 8)")
    s.add_argument("--out", default=None, help="write selftest.json here")


def _options(args, preset, overrides, extra, name=None):
    from parity.runner import RunOptions

    if getattr(args, "fp8", None):
        overrides = [*overrides, f"compute.fp8={args.fp8}"]
    kw = dict(preset=preset, overrides=list(overrides), dtype=args.dtype, steps=args.steps,
              optimizer=args.optimizer, seed=args.seed, mesh=args.mesh, force_routing=args.force_routing,
              profile=args.profile, name=name,
              packed=getattr(args, "packed", False) and not getattr(args, "all", False))  # --all: the matrix says
    if args.init_scale is not None:
        kw["init_scale"] = args.init_scale
    if getattr(args, "reference", None) and not getattr(args, "all", False):  # --all: the matrix says
        kw["reference"] = args.reference
        if args.reference == "torchtitan":
            from parity.titan_runner import TITAN_INIT_SCALE

            kw.update(titan=args.titan, titan_overrides=list(args.titan_overrides))
            kw.setdefault("init_scale", TITAN_INIT_SCALE)
    kw.update(extra)
    return RunOptions(**kw)


def _one(opts, out: Path, plots: bool) -> dict:
    from parity.report import write_report
    from parity.runner import run_suite

    rep = run_suite(opts)
    write_report(rep, out, plots=plots)
    fd = rep["first_divergence"]
    status = "PASSED" if rep["passed"] else "FAILED"
    print(f"parity {rep['name']}: {status} ({rep['n_checks']} checks, {rep['n_failed']} failed; "
          f"routing near-ties {rep['routing']['near_tie']}, real mismatches {rep['routing']['real']}; "
          f"{rep['timings_s']['total']:.1f}s) -> {out}")
    if fd:
        print(f"  first divergence: {fd['name']} ({fd['metric']} = {fd['value']:.3g} > {fd['tolerance']})")
    parted = [c for c in rep["checks"] if c["name"].startswith("step_routing[") and c["passed"]]
    for c in parted:
        gaps = [x["max_near_tie_gap"] for x in c["layers"] if x["max_near_tie_gap"] is not None]
        then = ("routing forced from the reference from here on, later steps still strict"
                if c.get("forced_from_step") is not None else "later steps are reported as figures")
        print(f"  training parted at step {c['step']} on a near-tie routing flip (gap {max(gaps, default=0):.2g} <= "
              f"tie_gap): {then}; {rep.get('strict_fraction', 0):.0%} of the checks strict")
    return rep


def run_parity(args) -> int:
    try:
        if args.action == "selftest":
            return _selftest(args)
        return _run(args)
    except (ConfigError, UserError) as e:
        if getattr(args, "_standalone", False):
            print(f"parity: error: {e}", file=sys.stderr)
            return 2
        raise


def _run(args) -> int:
    from parity.report import summary_row, write_summary

    plots = not args.no_plots
    if not args.all:
        opts = _options(args, args.preset or "tiny", args.overrides, {})
        out = Path(args.out) if args.out else DEFAULT_OUT / opts.label
        rep = _one(opts, out, plots)
        return 0 if rep["passed"] else 1
    ignored = [flag for flag, given in (("--preset", args.preset is not None),
                                        ("--reference", args.reference != "torch_ref"),
                                        ("--titan", args.titan is not None),
                                        ("--titan-set", bool(args.titan_overrides)),
                                        ("--packed", args.packed)) if given]
    if ignored:
        raise UserError(f"run --all runs the matrix, whose rows set their own preset, reference and packing: "
                        f"drop {', '.join(ignored)} (or drop --all to run one comparison)")
    root = Path(args.out) if args.out else DEFAULT_OUT / "all"
    rows = []
    for label, preset, overrides, extra in MATRIX:
        opts = _options(args, preset, list(overrides) + list(args.overrides), extra, name=label)
        rep = _one(opts, root / label, plots)
        rows.append(summary_row(rep))
    table = write_summary(rows, root)
    print()
    print(table)
    print(f"\nsummary: {root / 'summary.json'}")
    return 0 if all(r["passed"] for r in rows) else 1


def _selftest(args) -> int:
    import json

    from parity.faults import selftest
    from parity.report import format_table

    kw = {} if args.init_scale is None else {"init_scale": args.init_scale}
    ok, rows = selftest(profile=args.profile, seed=args.seed, **kw)
    print()
    print(format_table(rows, ["fault", "stage", "caught", "first_divergence", "expected", "margin", "ok"]))
    print("\nself-test " + ("PASSED: every fault caught and localised; baselines pass" if ok else "FAILED"))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "selftest.json").write_text(json.dumps({"passed": ok, "faults": rows}, indent=1))
    return 0 if ok else 1


__all__ = ["MATRIX", "add_args_parity", "run_parity"]
