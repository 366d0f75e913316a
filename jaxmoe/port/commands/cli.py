"""The ``jaxmoe convert`` and ``jaxmoe logits`` commands (loaded by :mod:`jaxmoe.cli`).

Checkpoint flags (``--from`` / ``--to`` / ``--ckpt``) take the endpoints of the formats in
:mod:`jaxmoe.port.formats`, and the formats' own flags (``--shard-size``, ``--hf-layout``, ...)
come from there too; the work is done by :func:`jaxmoe.port.commands.convert.convert`,
:func:`jaxmoe.port.commands.verify.verify` and :func:`jaxmoe.port.commands.logits.compute_logits`.
"""

from __future__ import annotations

import json

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.extras import require
from jaxmoe.port.commands.convert import convert
from jaxmoe.port.commands.logits import compute_logits
from jaxmoe.port.commands.verify import verify
from jaxmoe.port.formats import (
    add_arguments,
    bind_options,
    endpoint_help,
    option_values,
    parse_endpoint,
)
from jaxmoe.port.formats.base import shape_text
from jaxmoe.port.io.safetensors_io import FLOAT_DTYPES


def add_args_convert(p) -> None:
    p.add_argument("--from", dest="src", required=True, metavar="SRC", help=endpoint_help())
    p.add_argument("--to", dest="dst", required=True, metavar="DST", help=endpoint_help())
    p.add_argument("--dtype", choices=sorted(FLOAT_DTYPES),
                   help="output dtype of the weights (default: source dtype; float32 for orbax:)")
    add_arguments(p, ("source", "sink"))
    p.add_argument("--verify", action="store_true",
                   help="compare source and destination logits on a probe batch; non-zero exit "
                        "past tolerance")
    p.add_argument("--verify-layers", type=int, metavar="N",
                   help="with --verify: compare the first N layers' activations and the logits of "
                        "the model truncated to N layers (reads only those layers: bounded memory)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")


def run_convert(args) -> int:
    src = parse_endpoint(args.src, "--from")
    dst = parse_endpoint(args.dst, "--to")
    if args.verify_layers is not None and not args.verify:
        raise UserError("--verify-layers N needs --verify")
    if args.verify_layers is not None and args.verify_layers < 1:
        raise UserError(f"--verify-layers {args.verify_layers}: give a number of layers >= 1")
    if args.verify:  # before anything is written: --verify runs torch (the [ref] extra)
        require("torch", "jaxmoe convert --verify")
    src, dst = bind_options(option_values(args, ("source", "sink")), source=src, sink=dst)
    stats = convert(src, dst, dtype=args.dtype, force=args.force)
    rc = 0
    if args.verify:
        # bf16 tolerances apply when either side holds bf16 weights
        dts = set(stats["dtype"]) | set(stats["src_dtype"])
        key = "bfloat16" if "bfloat16" in dts else "float32"
        stats["verify"] = verify(src, dst, key, layers=args.verify_layers)
        rc = 0 if stats["verify"]["ok"] else 1
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(f"converted {stats['src']} -> {stats['dst']}: {stats['tensors']} tensors, "
              f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.2f}s "
              f"({stats['mb_per_s']:.0f} MB/s)")
        if "verify" in stats:
            v = stats["verify"]
            what = "" if v["layers"] is None else f", first {v['layers']} layers"
            print(f"verify ({v['src_framework']} vs {v['dst_framework']}{what}, {v['tokens'][0]}x"
                  f"{v['tokens'][1]} tokens): max|dlogit| {v['max_abs']:.3g}, KL {v['kl']:.3g}, "
                  f"top-1 agreement {v['top1']:.3f} -> {'OK' if v['ok'] else 'FAILED'} "
                  f"(tolerance KL <= {v['tolerance']['kl']:g}, max abs <= "
                  f"{v['tolerance']['max_abs']:g})")
    return rc


def add_args_logits(p) -> None:
    p.add_argument("--ckpt", required=True, help=endpoint_help())
    p.add_argument("--tokens", required=True, help="int token ids .npy, shape [batch, seq]")
    p.add_argument("--out", required=True, help="output .npy: fp32 logits [batch, seq, vocab]")
    p.add_argument("--framework", choices=("jax", "torch", "hf"), default="jax",
                   help="run jaxmoe (jax), torch_ref (torch) or HF transformers itself (hf; torch "
                        "and transformers come with the [ref] extra)")
    add_arguments(p, ("source",))


def run_logits(args) -> int:
    ep, _ = bind_options(option_values(args, ("source",)), source=parse_endpoint(args.ckpt, "--ckpt"))
    if args.framework != "jax":  # torch_ref / transformers: the [ref] extra
        require("torch", f"jaxmoe logits --framework {args.framework}")
    try:
        tokens = np.load(args.tokens, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokens {args.tokens}: cannot read .npy ({e})") from None
    logits = compute_logits(ep, tokens, args.framework)
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: logits {shape_text(logits.shape)} float32 ({args.framework})")
    return 0


__all__ = ["add_args_convert", "add_args_logits", "run_convert", "run_logits"]
