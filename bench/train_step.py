"""Train-step throughput side by side: jaxmoe vs HF transformers (eager and torch.compile) vs
torch_ref, and a measured fp32 matmul peak, in ONE run.

    python bench/train_step.py [--shape coarse|fine|all] [--rounds 3] [--steps 3] [--skip SYSTEMS] [--json]

Shapes (fwd + bwd + AdamW, B=8, S=256, vocab 8192, d_model 512, 4 layers, 8 heads / 4 KV heads,
head_dim 64, fp32, aux losses off, global-norm clipping 1.0 on every system):

* ``coarse``: 8 experts top-2, expert FFN 1024 -- HF ``MixtralForCausalLM``;
* ``fine``: 64 experts top-8, expert FFN 256, QK-norm -- HF ``Qwen3MoeForCausalLM``.

Systems: ``jaxmoe`` (the jitted train step of ``jaxmoe.train.step``: the ``blocked`` expert path with
64-row blocks, cross-entropy chunked by 1024 tokens (``compute.ce_chunk_tokens``), the 4 layers
unrolled (``compute.scan_unroll=0``)), ``hf_eager`` and ``hf_compile`` (the transformers model with
``torch.optim.AdamW``, eager and under ``torch.compile``; a compile failure is reported, not
hidden), ``torch_ref`` (the reference's own train step), ``jaxmoe_train`` (``jaxmoe train`` end to
end with its defaults: a subprocess per round on the shape's config without the tuned values that
``auto`` now picks, tokens/s from its ``metrics.jsonl`` after 3 warm-up steps; see ``_TrainRun``;
``train_over_step``: its per-round ratio to the ``jaxmoe`` step). Each system lives in its own
worker process (two runtimes in one process slow each other down; see ``bench_shape``) and runs
three untimed steps first (compilation, warm-up); every worker process gets jaxmoe's host
allocator setting (``jaxmoe/train/host_alloc.py``, as ``jaxmoe train`` applies it;
``JAXMOE_SYSTEM_MALLOC=1``: none does); each round then times ``--steps`` steps of every system,
one at a time, the order alternating between rounds (and a matmul peak before and after each
round); a system's figure is the median over rounds (range beside it), the ratios are per round
(median and range). ~6 minutes for ``--shape all`` on the 2-core machine. MFU = tokens/s x FLOPs
per token / matmul peak, FLOPs per token from ``jaxmoe.config.counting.flops_per_token`` (6 x active
matmul parameters without the input embedding, plus causal attention). ``ratio_to_best_peer``:
jaxmoe tokens/s over the best torch system. With both shapes, ``fine_over_coarse_at_equal_flops``:
each system's fine tokens/s over its coarse tokens/s, scaled by the FLOPs per token.
``per_step_os``: each worker's user and kernel CPU seconds and page faults per step.
Figures are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the systems it times; `X as X`: re-exported (tests and step_parts.py use them as train_step.X)
from train_step_systems import batch_np as batch_np
from train_step_systems import cfg_batch as cfg_batch
from train_step_systems import make_hf, make_jaxmoe, make_titan, make_torch_ref

# numpy (and every library that starts threads) is imported inside the functions: a worker must
# apply jaxmoe's allocator setting before any thread allocates (jaxmoe/train/host_alloc.py)

B, S, V, D, L, H, KV, HD = 8, 256, 8192, 512, 4, 8, 4, 64
SHAPES = {
    "coarse": dict(preset="mixtral-tiny", arch="mixtral", experts=8, top_k=2, ffn=1024, qk_norm=False),
    "fine": dict(preset="tiny", arch="qwen3_moe", experts=64, top_k=8, ffn=256, qk_norm=True),
}


# what `auto` decides (jaxmoe/config/autoconf.py): the `jaxmoe_train` row leaves these to the defaults
AUTO_KEYS = ("moe.compute_path", "compute.ce_chunk_tokens", "compute.scan_unroll")


# the torchtitan peer (``--peer torchtitan --titan FAMILY/FLAVOR``): its flavor at this batch
TITAN_B, TITAN_S = 8, 256


def titan_jax_config(spec: str, extra=()):
    """What ``jaxmoe config --from-titan SPEC`` writes (torchtitan's dims, its router and expert
    bias, its AdamW / clipping / warmup-stable-decay defaults; every ``auto`` left to ``auto``),
    at ``TITAN_B x TITAN_S`` tokens, with ``extra`` (``--set``) on top."""
    from jaxmoe.config.titan import titan_config

    sets = [f"train.batch_size={TITAN_B}", f"train.seq_len={TITAN_S}", "train.steps=1000", *extra]
    return titan_config(spec, sets)


def jax_config(shape: str, extra=(), defaults: bool = False):
    """The bench shape's jaxmoe config; ``defaults``: without the tuned values of ``AUTO_KEYS``
    (what ``jaxmoe train`` then picks itself: the preset's value where it sets one, else ``auto``).
    A shape ``titan:FAMILY/FLAVOR`` is :func:`titan_jax_config` (its ``auto`` values untouched)."""
    from jaxmoe.config import load_config

    if shape.startswith("titan:"):
        return titan_jax_config(shape.removeprefix("titan:"), extra)
    s = SHAPES[shape]
    sets = {
        "model.vocab_size": V, "model.d_model": D, "model.n_layers": L, "model.first_k_dense": 0,
        "model.n_heads": H, "model.n_kv_heads": KV, "model.head_dim": HD,
        "model.qk_norm": str(s["qk_norm"]).lower(), "model.max_seq_len": S,
        "moe.n_experts": s["experts"], "moe.top_k": s["top_k"], "moe.expert_ffn_dim": s["ffn"],
        "moe.norm_topk_prob": "true", "moe.lb_coef": 0, "moe.router_z_coef": 0, "moe.seq_aux_coef": 0,
        "moe.compute_path": "blocked", "train.batch_size": B, "train.seq_len": S,
        "compute.dtype": "float32", "optim.optimizer": "adamw", "optim.grad_clip": 1.0,
        "train.z_loss_coef": 0, "train.steps": 1000, "optim.warmup_steps": 10,
        # CE fused with the LM head in 1024-token chunks: same FLOPs, -19% bytes, -20% CPU time
        # of CE fwd+bwd at this shape (docs/MEASUREMENTS.md, "Kernels")
        "compute.ce_chunk_tokens": 1024,
        # 4 layers: no layer loop, so no stacked per-layer buffers (+4% coarse, +14% fine by
        # interleaved A/B, docs/MEASUREMENTS.md, "auto defaults")
        "compute.scan_unroll": 0,
        # blocked path: groups padded to 64 rows, not the tiny presets' 8 (fewer, larger tail runs:
        # +12% coarse, +9% fine by interleaved A/B; 32 and 128 were not faster)
        "moe.block_size": 64,
    }
    if defaults:
        sets = {k: v for k, v in sets.items() if k not in AUTO_KEYS}
    return load_config(s["preset"], overrides=[f"{k}={v}" for k, v in sets.items()] + list(extra))


def matmul_peak(n=2048, reps=5) -> float:
    from jaxmoe.train.step import measure_matmul_peak

    return measure_matmul_peak(n, "float32", reps)


class _TrainRun:
    """``jaxmoe train`` end to end with its defaults, as a user runs it: each ``("time", steps)``
    is one subprocess ``python -m jaxmoe.cli train --config FILE --steps WARM+steps`` on the bench
    shape's config without the tuned ``AUTO_KEYS`` (:func:`jax_config` ``defaults=True``; the
    embedded corpus, no eval, no checkpoints, the async loop, the persistent compile cache as
    a user has it). Its tokens/s: the median of the per-step ``tokens_per_s`` the run writes to
    ``metrics.jsonl`` (wall time between one step's metrics and the next: the real loop, data
    included) over the steps after the first ``WARM`` (compilation and warm-up excluded, as the
    in-process systems' three untimed steps). ``jaxmoe train`` applies the allocator setting
    itself."""

    WARM = 3

    def __init__(self, shape, sets):
        import tempfile

        from jaxmoe.config import config_to_toml

        self.dir = tempfile.mkdtemp(prefix="jaxmoe-train-row-")
        cfg = jax_config(shape, sets, defaults=True)
        for k, v in (("eval_every", 0), ("checkpoint_every", 0), ("checkpoint_minutes", 0.0), ("log_every", 1)):
            setattr(cfg.train, k, v)
        self.config = os.path.join(self.dir, "config.toml")
        with open(self.config, "w") as f:
            f.write(config_to_toml(cfg))
        self.n, self.ready = 0, {"config": "bench shape without " + ", ".join(AUTO_KEYS)}

    def call(self, cmd, steps=None):
        import subprocess

        if cmd == "peak":
            raise RuntimeError("not a matmul timer")
        self.n += 1
        out = os.path.join(self.dir, f"run{self.n}")
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run([sys.executable, "-m", "jaxmoe.cli", "train", "--config", self.config, "--out", out,
                            "--steps", str(self.WARM + steps), "--quiet"], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"jaxmoe train exited {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}")
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        tok = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > self.WARM]
        with open(os.path.join(out, "run.json")) as f:
            self.ready["resolved"] = json.load(f).get("resolved", {})
        n = self.WARM + steps  # the whole process's CPU time (compile included) per step
        return statistics.median(tok), {"user_s": (r1.ru_utime - r0.ru_utime) / n,
                                        "sys_s": (r1.ru_stime - r0.ru_stime) / n,
                                        "minflt": (r1.ru_minflt - r0.ru_minflt) / n}

    def close(self):
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


SETTLE_S = 10.0

MAKERS = {"jaxmoe": make_jaxmoe, "jaxmoe_train": None, "hf_eager": lambda cfg: make_hf(cfg, False),
          "hf_compile": lambda cfg: make_hf(cfg, True), "torch_ref": make_torch_ref,
          "torchtitan": make_titan, "torchtitan_compile": lambda cfg: make_titan(cfg, True)}
HF_SYSTEMS = ("jaxmoe", "jaxmoe_train", "hf_eager", "hf_compile", "torch_ref")
TITAN_SYSTEMS = ("jaxmoe", "jaxmoe_train", "torchtitan", "torchtitan_compile")


def timed_steps(run, sync, steps: int) -> tuple[float, dict]:
    """Run ``steps`` steps; wall seconds and, per step, the process's user and kernel CPU seconds
    and minor page faults (``getrusage``). Shared with ``bench/step_faults.py``."""
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        out = run()
    sync(out)
    dt, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    return dt, {"user_s": (r1.ru_utime - r0.ru_utime) / steps, "sys_s": (r1.ru_stime - r0.ru_stime) / steps,
                "minflt": (r1.ru_minflt - r0.ru_minflt) / steps}


def _worker(shape: str, name: str, sets, conn) -> None:
    """One system in its own process: build it, run the untimed warm-up steps, then answer
    ``("time", steps)`` with tokens/s and :func:`timed_steps`'s per-step figures, ``("peak",
    None)`` with the matmul peak (the ``peak`` worker), ``("stop", None)`` by returning. Every
    failure is sent back as ``("error", line)``."""
    try:
        # every worker gets what `jaxmoe train` does at start-up (jaxmoe/train/host_alloc.py): no peer
        # handicapped by a setting only jaxmoe gets; JAXMOE_SYSTEM_MALLOC=1 turns it off for all
        from jaxmoe.train.host_alloc import keep_freed_memory

        keep_freed_memory()
        tokens = 0
        if name == "peak":
            conn.send(("ready", {}))
        else:
            if name != "jaxmoe":
                import torch

                torch.set_num_threads(os.cpu_count() or 1)
            cfg = jax_config(shape, sets)
            tokens = cfg.train.batch_size * cfg.train.seq_len
            run, sync = MAKERS[name](cfg)
            t = time.perf_counter()
            sync(run())  # compilation
            first = time.perf_counter() - t
            for _ in range(2):  # and two more untimed steps: the heap reaches its peak size
                sync(run())
            conn.send(("ready", {"first_step_s": round(first, 2)}))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                return
            if cmd == "peak":
                conn.send(("ok", matmul_peak()))
                continue
            dt, os_use = timed_steps(run, sync, arg)
            conn.send(("ok", (arg * tokens / dt, os_use)))
    except Exception as e:  # noqa: BLE001 - a system that does not run here is reported
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        conn.send(("error", f"{type(e).__name__}: {msg}"))


class _System:
    """A worker process holding one system; ``call`` sends one command and waits for its answer."""

    def __init__(self, ctx, shape, name, sets):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(shape, name, tuple(sets), child), daemon=True)
        self.proc.start()
        child.close()
        self.ready = self._answer()

    def _answer(self):
        try:
            kind, val = self.conn.recv()
        except EOFError:
            kind, val = "error", f"worker exited with code {self.proc.join(5) or self.proc.exitcode}"
        if kind == "error":
            raise RuntimeError(val)
        return val

    def call(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        return self._answer()

    def close(self):
        try:
            self.conn.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def bench_shape(shape: str, rounds: int, steps: int, log, skip=(), sets=(), systems=HF_SYSTEMS) -> dict:
    """Every system (and the matmul timer) in its own worker process, built and warmed up one
    after the other, then timed round by round, one system at a time, the order alternating.

    Separate processes because two runtimes in one process slow each other down: with HF and
    torch_ref in the same process, jaxmoe's compiled step ran 1138 tok/s on the coarse shape
    against 1499 alone, and on the earlier machine its fine figure fell from 371 to 272 over
    the rounds (docs/history/MEASUREMENTS-2026-12.md,
    "Train step, second pass"). A user runs one framework per process; so does this.
    """
    import multiprocessing as mp

    from jaxmoe.config.counting import flops_per_token

    ctx = mp.get_context("spawn")
    fpt = flops_per_token(jax_config(shape, sets))
    workers, notes = {}, {}
    try:
        workers["peak"] = _System(ctx, shape, "peak", sets)
        for name in systems:
            if name in skip:
                notes[name] = {"skipped": "--skip"}
                continue
            try:
                w = _TrainRun(shape, sets) if name == "jaxmoe_train" else _System(ctx, shape, name, sets)
            except RuntimeError as e:
                notes[name] = {"error": str(e)}
                log(f"{shape}: {name} did not run: {e}")
                continue
            workers[name], notes[name] = w, w.ready
        systems = [n for n in workers if n != "peak"]
        # let what the builds left running in the background settle (torch.compile's worker pool):
        # without this pause every system's first round ran 10-45% below the later ones
        time.sleep(SETTLE_S)
        peaks, tok, per_step = [], {n: [] for n in systems}, {}
        for r in range(rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            peaks.append(workers["peak"].call("peak"))
            for name in order:
                tps, os_use = workers[name].call("time", steps)
                tok[name].append(tps)
                for k, v in os_use.items():
                    per_step.setdefault(name, {}).setdefault(k, []).append(v)
            peaks.append(workers["peak"].call("peak"))
            log(f"{shape} round {r + 1}: " + ", ".join(f"{n} {tok[n][-1]:.0f}" for n in order) + " tok/s")
    finally:
        for w in workers.values():
            w.close()
    peak = statistics.median(peaks)
    res = {"tokens_per_s": {n: statistics.median(v) for n, v in tok.items()},
           "tokens_per_s_range": {n: [min(v), max(v)] for n, v in tok.items()},
           "tokens_per_s_rounds": tok,
           "mfu": {n: statistics.median(v) * fpt / peak for n, v in tok.items()},
           "mfu_range": {n: [min(v) * fpt / max(peaks), max(v) * fpt / min(peaks)] for n, v in tok.items()},
           "matmul_peak_gflops": peak / 1e9, "matmul_peak_gflops_range": [min(peaks) / 1e9, max(peaks) / 1e9],
           "flops_per_token": fpt, "rounds": rounds, "steps_per_round": steps, "notes": notes,
           "processes": "one worker process per system",
           # medians over rounds of each worker's user and kernel CPU seconds and minor page
           # faults per step: the host allocator's churn shows here (jaxmoe/train/host_alloc.py)
           "per_step_os": {n: {k: statistics.median(v) for k, v in d.items()} for n, d in per_step.items()}}
    peers = {n: v for n, v in res["tokens_per_s"].items() if n not in ("jaxmoe", "jaxmoe_train")}
    if "jaxmoe" in tok and "jaxmoe_train" in tok:  # the real loop with defaults / the tuned step
        r = [a / b for a, b in zip(tok["jaxmoe_train"], tok["jaxmoe"])]
        res["train_over_step"], res["train_over_step_range"] = statistics.median(r), [min(r), max(r)]
    if "jaxmoe" in res["tokens_per_s"] and peers:
        best = max(peers, key=peers.get)
        res["best_peer"] = best

        def per_round(other):  # jaxmoe / other, round by round (same round: same machine state)
            r = [j / o for j, o in zip(tok["jaxmoe"], tok[other])]
            return statistics.median(r), [min(r), max(r)]

        res["ratio_to_best_peer"], res["ratio_to_best_peer_range"] = per_round(best)
        res["ratio_to_hf_eager"], res["ratio_to_hf_eager_range"] = (
            per_round("hf_eager") if "hf_eager" in peers else (None, None))
        res["ratio_to_peer"] = {n: per_round(n)[0] for n in peers}
        res["ratio_to_peer_range"] = {n: per_round(n)[1] for n in peers}
    return res


TITAN_HANDICAPS = (
    "same tokens on both sides (one fixed batch), fp32 parameters, activations and optimizer state on both; "
    "torch threads = {cores} (torch.set_num_threads), jax: XLA:CPU's own pool over {cores} cores; "
    "both processes get jaxmoe's host allocator setting (jaxmoe/train/host_alloc.py); "
    "torchtitan: its model, CrossEntropyLoss, OptimizersContainer (AdamW, implementation=fused), "
    "clip_grad_norm_(foreach), LR schedule and expert-bias hook, attention = its ScaledDotProductAttention "
    "(FlexAttention has no CPU backward), experts in fp32 (its stock GroupedExperts casts to bf16), "
    "torch._grouped_mm's CPU fallback; jaxmoe: the config --from-titan writes, every auto resolved for CPU")


def bench_titan(spec: str, rounds: int, steps: int, log, skip=(), sets=()) -> dict:
    """jaxmoe against torchtitan on torchtitan's flavor ``spec`` (:func:`make_titan`), one worker
    process per system, the order alternating between rounds (:func:`bench_shape`)."""
    from jaxmoe.config.titan import import_titan

    import_titan()  # one line if the [titan] extra is missing
    res = bench_shape("titan:" + spec, rounds, steps, log, skip, sets, TITAN_SYSTEMS)
    cfg = jax_config("titan:" + spec, sets)
    from jaxmoe.config.autoconf import auto_choices

    res["jaxmoe_resolved"] = auto_choices(cfg, "cpu")
    res["shape"] = f"{cfg.train.batch_size}x{cfg.train.seq_len}"
    res["handicaps"] = TITAN_HANDICAPS.format(cores=os.cpu_count())
    return res


def titan_ratio_line(spec: str, r: dict, peer: str = "torchtitan") -> str:
    """The bench's last line per flavor (the issue's contract)."""
    if peer not in r.get("ratio_to_peer", {}):
        missing = [n for n in ("jaxmoe", peer) if n not in r.get("tokens_per_s", {})]
        return (f"jaxmoe / {peer} train step ({spec}, {r.get('shape')}, fp32, CPU): n/a "
                f"({' and '.join(missing) or 'no ratio'} did not run)")
    lo, hi = r["ratio_to_peer_range"][peer]
    return (f"jaxmoe / {peer} train step ({spec}, {r['shape']}, fp32, CPU): "
            f"{r['ratio_to_peer'][peer]:.2f} [{lo:.2f}-{hi:.2f}]")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("coarse", "fine", "all"), default="all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    p.add_argument("--skip", default="", help="comma-separated systems not to run (e.g. hf_compile)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a jaxmoe config override for A/B runs (e.g. compute.ce_chunk_tokens=1024)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--peer", choices=("hf", "torchtitan"), default="hf",
                   help="hf: the two bench shapes against HF transformers and torch_ref (default); "
                        "torchtitan: --titan flavors against torchtitan's own model and train step")
    p.add_argument("--titan", action="append", default=[], metavar="FAMILY/FLAVOR",
                   help="with --peer torchtitan (repeatable): e.g. deepseek_v3/debugmodel, qwen3/debugmodel_moe")
    args = p.parse_args(argv)
    if args.peer == "torchtitan":
        return main_titan(args)
    if args.titan:
        p.error("--titan needs --peer torchtitan")
    def log(m):
        print(m, file=sys.stderr, flush=True)
    shapes = ["coarse", "fine"] if args.shape == "all" else [args.shape]
    t0 = time.perf_counter()
    skip = tuple(x for x in args.skip.split(",") if x)
    out = {s: bench_shape(s, args.rounds, args.steps, log, skip, args.set) for s in shapes}
    if "coarse" in out and "fine" in out:  # fine-grained over coarse tokens/s at equal FLOPs per token
        c, f = out["coarse"], out["fine"]
        out["fine_over_coarse_at_equal_flops"] = {
            n: f["tokens_per_s"][n] * f["flops_per_token"] / (c["tokens_per_s"][n] * c["flops_per_token"])
            for n in c["tokens_per_s"] if n in f["tokens_per_s"]}
    log(f"bench wall time {time.perf_counter() - t0:.0f}s")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for s, r in out.items():
            if s not in SHAPES:
                print(f"{s}: " + ", ".join(f"{n} {v:.2f}" for n, v in r.items()))
                continue
            print(f"{s}: matmul peak {r['matmul_peak_gflops']:.0f} GFLOP/s")
            for n, v in r["tokens_per_s"].items():
                lo, hi = r["tokens_per_s_range"][n]
                print(f"  {n:11s} {v:8.0f} tok/s [{lo:.0f}-{hi:.0f}]  MFU {r['mfu'][n]:.3f}")
            if "ratio_to_best_peer" in r:
                lo, hi = r["ratio_to_best_peer_range"]
                line = f"  jaxmoe / best peer ({r['best_peer']}) = {r['ratio_to_best_peer']:.2f} [{lo:.2f}-{hi:.2f}]"
                if r["ratio_to_hf_eager"] is not None:
                    lo, hi = r["ratio_to_hf_eager_range"]
                    line += f"; / hf_eager = {r['ratio_to_hf_eager']:.2f} [{lo:.2f}-{hi:.2f}]"
                print(line)
            if "train_over_step" in r:
                lo, hi = r["train_over_step_range"]
                print(f"  jaxmoe train (defaults, end to end) / tuned step = {r['train_over_step']:.2f} "
                      f"[{lo:.2f}-{hi:.2f}]")
    return 0


def main_titan(args) -> int:
    from jaxmoe.config.titan import parse_name
    from jaxmoe.errors import UserError

    def log(m):
        print(m, file=sys.stderr, flush=True)

    if not args.titan:
        print("train_step.py: --peer torchtitan needs --titan FAMILY/FLAVOR (e.g. deepseek_v3/debugmodel)",
              file=sys.stderr)
        return 2
    skip = tuple(x for x in args.skip.split(",") if x)
    t0 = time.perf_counter()
    out = {}
    try:
        for spec in args.titan:
            parse_name(spec)
            out[spec] = bench_titan(spec, args.rounds, args.steps, log, skip, args.set)
    except UserError as e:
        print(f"train_step.py: {e}", file=sys.stderr)
        return 2
    log(f"bench wall time {time.perf_counter() - t0:.0f}s")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for spec, r in out.items():
        print(f"{spec} ({r['shape']}): matmul peak {r['matmul_peak_gflops']:.0f} GFLOP/s, "
              f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token; jaxmoe resolved {r['jaxmoe_resolved']}")
        for n, v in r["tokens_per_s"].items():
            lo, hi = r["tokens_per_s_range"][n]
            print(f"  {n:18s} {v:8.0f} tok/s [{lo:.0f}-{hi:.0f}]  MFU {r['mfu'][n]:.3f}")
        for n, e in r["notes"].items():
            if isinstance(e, dict) and "error" in e:
                print(f"  {n:18s} did not run: {e['error']}")
        print(f"  ({r['handicaps']})")
    for spec, r in out.items():
        print(titan_ratio_line(spec, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
