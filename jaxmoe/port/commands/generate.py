"""``jaxmoe generate``: new tokens from any checkpoint ``logits`` reads, with a KV cache.

The checkpoint (``hf:``, ``orbax:``, ``torch:``, ``dcp:``) is read as ``jaxmoe logits`` reads it
(:func:`jaxmoe.port.commands.convert.load_numpy_tree`, fp32 weights) and decoded by
:class:`jaxmoe.model.decode.Decoder` (experts dropless) on one device, or with ``--mesh`` on a
device mesh placed as the trainer places it (experts sharded, the mesh's expert dispatcher). Prompts come as text
(``--prompt``, repeatable: a batch; the checkpoint's ``tokenizer.json`` encodes them) or as token
ids (``--prompt-tokens FILE.npy``: ``[seq]`` or ``[batch, seq]``, negative ids are padding and
removed, so rows may differ in length). Each row gets ``--max-new-tokens`` tokens, cut after the
first end-of-sequence id the checkpoint's ``generation_config.json`` / ``config.json`` names
(``--ignore-eos``: never cut).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.port.commands.convert import load_numpy_tree
from jaxmoe.port.formats import add_arguments, bind_options, endpoint_help, open_source, option_values, parse_endpoint
from jaxmoe.port.formats.base import shape_text

TOKENIZER_FILE = "tokenizer.json"


def add_args(p) -> None:
    p.add_argument("--ckpt", required=True, help=endpoint_help())
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a text prompt (repeat for a batch); needs the checkpoint's tokenizer.json")
    src.add_argument("--prompt-tokens", metavar="FILE.npy",
                     help="int token ids [seq] or [batch, seq]; negative ids are padding (removed)")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="tokens generated per prompt")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling flags with it)")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature > 0 (default 1)")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, metavar="S", help="sampling seed (default 0): the same seed, the same tokens")
    p.add_argument("--mesh", metavar="SPEC",
                   help="run on a device mesh as train does, e.g. expert=8 (experts sharded; one axis may be -1)")
    p.add_argument("--ignore-eos", action="store_true", help="do not cut rows after the end-of-sequence id")
    p.add_argument("--json", action="store_true", help='print {"tokens": [[...]], "logprobs": [[...]], "text": [...]}')
    add_arguments(p, ("source",))


def sampling_options(args) -> dict:
    """The Decoder's sampling keywords from the flags, checked (one line for a bad value)."""
    given = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "seed") if getattr(args, k) is not None}
    if args.greedy and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserError(f"--greedy takes no sampling flags ({flags}): drop --greedy to sample")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give a number of tokens >= 1")
    opts = {"greedy": bool(args.greedy), "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0, **given}
    if not 0.0 < opts["top_p"] <= 1.0:
        raise UserError(f"--top-p {opts['top_p']:g} is outside (0, 1]: give a probability mass such as 0.9")
    if not opts["temperature"] > 0.0:
        raise UserError(f"--temperature {opts['temperature']:g}: give a temperature > 0 (or --greedy)")
    if opts["top_k"] < 0:
        raise UserError(f"--top-k {opts['top_k']}: give K >= 0 (0: no top-k cut)")
    return opts


def find_tokenizer(meta_dir: Path | None):
    """The checkpoint's ``tokenizer.json`` as a tokenizer (:mod:`jaxmoe.data.tokenize`), or None."""
    if meta_dir is None or not (Path(meta_dir) / TOKENIZER_FILE).is_file():
        return None
    from jaxmoe.data.tokenize import load_tokenizer

    return load_tokenizer(str(Path(meta_dir) / TOKENIZER_FILE))


def eos_ids(meta_dir: Path | None) -> set[int]:
    """The end-of-sequence ids of ``generation_config.json`` (else ``config.json``), or none."""
    for name in ("generation_config.json", "config.json"):
        f = Path(meta_dir) / name if meta_dir is not None else None
        if f is None or not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token_id")
        except ValueError:
            continue
        if eos is not None:
            return {int(e) for e in (eos if isinstance(eos, list) else [eos])}
    return set()


def read_prompts(args, tokenizer) -> list[np.ndarray]:
    """The prompts as int32 id arrays (text encoded, or rows of the .npy without padding)."""
    if args.prompt is not None:
        if tokenizer is None:
            raise UserError(f"--prompt TEXT needs a tokenizer, and {args.ckpt} has no {TOKENIZER_FILE}: "
                            "give token ids with --prompt-tokens FILE.npy")
        return [np.asarray(tokenizer.encode(t), np.int32) for t in args.prompt]
    try:
        arr = np.load(args.prompt_tokens, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"--prompt-tokens {args.prompt_tokens}: cannot read .npy ({e})") from None
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"--prompt-tokens {args.prompt_tokens}: expected int ids [seq] or [batch, seq], "
                        f"got {arr.dtype} {shape_text(arr.shape)}")
    return [row[row >= 0].astype(np.int32) for row in np.atleast_2d(arr)]


def check_prompts(prompts: list[np.ndarray], cfg, max_new: int) -> None:
    """One line for an empty prompt, an id outside the vocabulary or a prompt past the context."""
    ctx = cfg.model.max_seq_len
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(f"prompt {i} is empty: give at least one token")
        if p.min() < 0 or p.max() >= cfg.model.vocab_size:
            raise UserError(f"prompt {i}: token id {int(p.max())} is outside the vocabulary [0, "
                            f"{cfg.model.vocab_size}) of this checkpoint")
        if len(p) > ctx:
            raise UserError(f"prompt {i} has {len(p)} tokens, longer than the model's context "
                            f"(model.max_seq_len={ctx}): shorten the prompt")
        if len(p) + max_new > ctx:
            raise UserError(f"prompt {i} ({len(p)} tokens) + --max-new-tokens {max_new} exceeds the model's "
                            f"context (model.max_seq_len={ctx}): lower --max-new-tokens")


def decode_config(cfg):
    """``cfg`` for decoding: dropless experts (no capacity: padding never displaces a token)."""
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0))


def generate(cfg, params, buffers, prompts: list, max_new: int, opts: dict, mesh: str | None = None):
    """``(tokens [B, N], logprobs [B, N])`` numpy: :meth:`jaxmoe.model.decode.Decoder.generate`,
    on one device, or with ``mesh`` (``--mesh`` text) on that mesh with the trainer's placement
    and expert dispatcher (the batch is filled up to a multiple of the batch shards with copies of
    the first prompt, dropped again)."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.model.decode import Decoder

    cfg = decode_config(cfg)
    rows = [list(p) for p in prompts]
    if mesh is None:
        dec = Decoder(cfg)
        params, buffers = jax.tree.map(jnp.asarray, (params, buffers))
    else:
        import math

        from jaxmoe.parallel.mesh import build_context, parse_mesh, resolve_mesh_shape
        from jaxmoe.parallel.sharding import BATCH_AXES

        sizes = resolve_mesh_shape(parse_mesh(mesh), jax.device_count())
        rows += [rows[0]] * (-len(rows) % math.prod(sizes[a] for a in BATCH_AXES))
        # the mesh checks read the step's shape from train.*: a decode step is one token per row
        cfg = cfg.replace(train=dataclasses.replace(cfg.train, batch_size=len(rows), seq_len=1, micro_batches=1))
        cfg, ctx = build_context(cfg, sizes)
        dec = Decoder(cfg, ctx.dispatch)
        params, buffers = ctx.place_params(params), ctx.place_params(buffers)
    toks, lps = dec.generate(params, buffers, rows, max_new, **opts)
    return toks[:len(prompts)], lps[:len(prompts)]


def cut_at_eos(tokens: np.ndarray, logprobs: np.ndarray, eos: set[int]) -> tuple[list, list]:
    """Each row as lists, up to and including its first id of ``eos``."""
    out_t, out_l = [], []
    for t, lp in zip(tokens.tolist(), logprobs.tolist()):
        n = next((i + 1 for i, x in enumerate(t) if x in eos), len(t))
        out_t.append(t[:n])
        out_l.append(lp[:n])
    return out_t, out_l


def run(args) -> int:
    opts = sampling_options(args)
    ep, _ = bind_options(option_values(args, ("source",)), source=parse_endpoint(args.ckpt, "--ckpt"))
    with open_source(ep) as source:
        cfg, meta_dir = source.cfg, source.meta_dir
    tokenizer = find_tokenizer(meta_dir)
    prompts = read_prompts(args, tokenizer)
    check_prompts(prompts, cfg, args.max_new_tokens)
    cfg, params, buffers = load_numpy_tree(ep)
    tokens, logprobs = generate(cfg, params, buffers, prompts, args.max_new_tokens, opts, args.mesh)
    toks, lps = cut_at_eos(tokens, logprobs, set() if args.ignore_eos else eos_ids(meta_dir))
    # no tokenizer: the text of each row is null (the command reads and prints tokens)
    text = [tokenizer.decode(t) if tokenizer is not None else None for t in toks]
    if args.json:
        print(json.dumps({"tokens": toks, "logprobs": lps, "text": text}))
        return 0
    for i, t in enumerate(toks):
        shown = text[i] if tokenizer is not None else " ".join(map(str, t))
        print(f"[{i}] {shown}")
    return 0


__all__ = ["add_args", "check_prompts", "cut_at_eos", "decode_config", "eos_ids", "find_tokenizer", "generate",
           "read_prompts", "run", "sampling_options"]
