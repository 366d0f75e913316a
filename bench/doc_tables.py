"""Render the tables of docs/MEASUREMENTS.md that come from committed JSON, so they cannot drift.

    python3 bench/doc_tables.py            # rewrite every generated region of docs/MEASUREMENTS.md
    python3 bench/doc_tables.py --check    # exit 1, one line naming the stale table; 0 if current

A generated region is the text between ``<!-- generated: NAME (bench/doc_tables.py) -->`` and the
next ``<!-- end generated -->``; NAME is a key of :data:`TABLES`, which names the JSON files
(under ``docs/``) each table is rendered from. Edit the JSON (a new measurement) or the renderer,
never the region: the next rewrite replaces it, and ``--check`` (tests/test_doc_tables.py) fails
until it is rewritten.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = Path("docs") / "MEASUREMENTS.md"
BEGIN = "<!-- generated: {name} (bench/doc_tables.py) -->"
END = "<!-- end generated -->"
_BEGIN_RE = re.compile(r"<!-- generated: (\S+) \(bench/doc_tables\.py\) -->")
GIB = float(2 ** 30)


def _e(x) -> str:
    """A relative error or small figure: two significant digits."""
    return "0" if x == 0 else f"{x:.2g}"


def _rng(r, fmt="{:.2f}") -> str:
    return f"[{fmt.format(r[0])}-{fmt.format(r[1])}]"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def parity_matrix(d: dict) -> list[str]:
    """docs/parity/matrix-summary.json: one row per run of ``python -m parity run --all``."""
    runs = d["runs"]
    rows = [[r["name"], r["reference"], "pass" if r["passed"] else f"**FAIL** ({r['failed']})",
             r["checks"], r["near_ties"], _e(r["worst_grad_rel_l2"]), _e(r["final_loss_rel"]),
             r["first_divergence"] or "-", f"{r['seconds']:.0f}"] for r in runs]
    passed = sum(r["passed"] for r in runs)
    return [f"{len(runs)} rows in the JSON, {passed} passed, `passed: {str(d['passed']).lower()}`.", ""] + _table(
        ["run", "reference", "result", "checks", "near-ties", "worst grad rel L2", "final loss rel",
         "first divergence", "s"], rows)


def parity_selftest(d: dict) -> list[str]:
    """docs/parity/selftest.json: one row per baseline or injected fault of ``python -m parity selftest``."""
    rows = [[f["fault"], f["stage"], f["first_divergence"] or "passes", f["expected"],
             "yes" if f["ok"] else "**NO**", f"{f['margin']:.3g}", f"{f['seconds']:.1f}"] for f in d["faults"]]
    ok = sum(f["ok"] for f in d["faults"])
    return [f"{len(d['faults'])} rows, {ok} as declared, `passed: {str(d['passed']).lower()}`.", ""] + _table(
        ["fault", "stage", "first divergence", "expected", "as declared", "margin", "s"], rows)


_SYSTEMS = ("jaxmoe", "hf_eager", "hf_compile", "torch_ref")


def train_step(default: dict, env_all: dict) -> list[str]:
    """docs/perf/train_step_*.json: ``bench/train_step.py --json``, by default and with the allocator
    setting given to every process through glibc's environment."""
    rows = []
    for label, d in (("default", default), ("allocator env for all", env_all)):
        for shape in ("coarse", "fine"):
            s = d[shape]
            tps = [f"{s['tokens_per_s'][k]:.0f} {_rng(s['tokens_per_s_range'][k], '{:.0f}')}" for k in _SYSTEMS]
            rows.append([shape, label, *tps,
                         f"**{s['ratio_to_hf_eager']:.2f}** {_rng(s['ratio_to_hf_eager_range'])}",
                         f"{s['ratio_to_best_peer']:.2f} ({s['best_peer']})",
                         f"{s['mfu']['jaxmoe']:.3f}", f"{s['matmul_peak_gflops']:.0f}"])
    foc = default["fine_over_coarse_at_equal_flops"]
    tail = ", ".join(f"{k} {foc[k]:.2f}" for k in _SYSTEMS)
    return _table(["shape", "environment", "jaxmoe tok/s", "HF eager", "HF compile", "torch_ref",
                   "jaxmoe / HF eager", "jaxmoe / best peer", "jaxmoe MFU", "matmul peak GFLOP/s"], rows) + [
        "", f"Fine over coarse at equal FLOPs per token (default run): {tail}."]


def experts_small(d: dict) -> list[str]:
    """docs/perf/experts_small_*.json: ``bench/experts.py --paths blocked --rounds 9 --json``."""
    rows = []
    for name, p in [("blocked", d["paths"]["blocked"]), ("ideal_loop", d["ideal_loop"]),
                    ("ideal_batched", d["ideal_batched"])]:
        ideal = (f"{p['ratio_to_ideal']:.3f} {_rng(p['ratio_to_ideal_range'], '{:.3f}')}"
                 if "ratio_to_ideal" in p else "-")
        rows.append([name, f"{p['gflops']:.0f}",
                     f"{p['ratio_to_matmul']:.3f} {_rng(p['ratio_to_matmul_range'], '{:.3f}')}",
                     f"{p['fwd_ratio_to_matmul']:.3f}", ideal])
    s = d["shapes"]
    head = (f"Shape `{s['name']}`: T={s['tokens']}, D={s['d_model']}, I={s['expert_ffn_dim']}, "
            f"E={s['n_experts']}, k={s['top_k']}, block {s['block_size']}; {d['rounds']} rounds; "
            f"plain matmul {d['matmul_gflops']:.0f} GFLOP/s; host allocator `{d['host_alloc']}`.")
    return [head, ""] + _table(["path", "fwd+bwd GFLOP/s", "fwd+bwd ratio_to_matmul [range]", "fwd ratio",
                                "ratio_to_ideal [range]"], rows)


def expert_shapes(d: dict) -> list[str]:
    """docs/perf/expert_shapes_*.json: ``bench/expert_shapes.py`` (coarse and fine expert layers alternated)."""
    rows = [[k, f"{v['coarse_gflops']:.0f}", f"{v['fine_gflops']:.0f}",
             f"{v['fine_over_coarse']:.3f} {_rng(v['fine_over_coarse_range'], '{:.3f}')}"]
            for k, v in d["kinds"].items()]
    return [f"T={d['tokens']}, {d['rounds']} rounds, block {d['block_size']}.", ""] + _table(
        ["kind", "coarse GFLOP/s", "fine GFLOP/s", "fine / coarse [range]"], rows)


def _gpu_result(v: dict) -> str:
    if v.get("error"):
        m = re.search(r"allocate ([\d.]+)\s*GiB", v["error"])
        return f"out of memory: one {m.group(1)} GiB allocation" if m else "error: " + v["error"].splitlines()[-1][:80]
    if v.get("skipped"):
        return "not run: " + v["skipped"]
    return (f"**{v['tokens_per_s']:,.0f} tok/s, MFU {v['mfu']:.3f}**, step {v['step_s']:.3f} s "
            f"{_rng(v['step_s_range'], '{:.3f}')}, peak device memory {v['peak_device_bytes'] / GIB:.2f} GiB "
            f"(XLA temp {v['memory_analysis_bytes']['temp'] / GIB:.2f} GiB), compile {v['compile_s']:.0f} s, "
            f"loss {v['loss_first']:.2f} -> {v['loss_last']:.2f}")


def gpu_h200(a: dict, b: dict) -> list[str]:
    """docs/perf/gpu_h200_*_{a,b}.json: ``bench/gpu.py --json`` on a lent H200 (two partial runs)."""
    rows = []
    for run, d in (("a", a), ("b", b)):
        for v in d["variants"]:
            rows.append([v["name"], run, _gpu_result(v)])
    head = (f"{a['device']}, jax {a['jax']}, XLA profile `{a['xla_profile']}`, bf16 matmul peak "
            f"{a['bf16_matmul_peak_tflops']:.0f} / {b['bf16_matmul_peak_tflops']:.0f} TFLOP/s (runs a / b).")
    return [head, ""] + _table(["variant", "run", "result"], rows)


def gpu_memory(d: dict) -> list[str]:
    """docs/perf/gpu_memory_cpu_proxy_flash_*.json: ``bench/gpu.py --memory-only --attention-model both``."""
    fit = d["fit_bytes"] / GIB
    rows = []
    for v in d["variants"]:
        m = v["memory_analysis_bytes"]
        cuda = v["cuda_stablehlo"]
        peak = f"{v['peak_bytes'] / GIB:.2f} GiB ({v['peak_bytes'] / 1e9:.1f} GB)"
        rows.append([v["name"], v["attention_model"], peak,
                     f"{m['argument'] / GIB:.2f} GiB", f"{m['temp'] / GIB:.2f} GiB",
                     "yes" if v["fits_48GB"] else "no", len(v["cpu_score_buffers"]),
                     f"{cuda['cudnn_attention_calls']} cuDNN calls, {len(cuda['score_tensors'])} S x S, "
                     f"{cuda['chlo_ragged_dot']} ragged_dot"])
    return _table(["variant", "attention model", "peak (XLA:CPU proxy)", "arguments", "temp",
                   f"under {fit:.0f} GiB", "CPU `[..,S,S]` buffers", "CUDA lowering"], rows)


# name -> (renderer, JSON files under ROOT, in the renderer's argument order)
def titan_steps(*reports: dict) -> list[str]:
    """docs/parity/titan-*-20steps.json: full reports of ``python -m parity run --reference
    torchtitan --titan F --steps 20`` (torchtitan's defaults: its expert bias and hook on)."""
    rows = []
    for r in reports:
        checks = r["checks"]
        grads = [c for c in checks if c["name"].startswith("grad:")]
        steps = [c["value"] for c in checks if c["name"].startswith("step_loss[")]
        params = [c["value"] for c in checks if c["name"].startswith(f"step{r['steps']}_param:")]
        bias = [c["value"] for c in checks if "expert_bias" in c["name"]]
        forced = r.get("forced_routing") or {}
        rows.append([f"`{r['titan']}`", "pass" if r["passed"] else f"**FAIL** ({r['n_failed']})", r["n_checks"],
                     f"{r['strict_fraction']:.0%}", len(grads), _e(max(c["value"] for c in grads)),
                     _e(max(steps)), _e(max(params)), f"{len(bias)}: max {_e(max(bias))}" if bias else "-",
                     "-" if r.get("forced_from_step") is None else
                     f"step {r['forced_from_step']} (margin {_e(forced.get('tie_margin') or 0)})"])
    return _table(["flavor", "result", "checks", "strict", "gradients", "worst grad rel L2", "worst step loss rel",
                   "worst param rel L2 after N", "bias checks", "routing forced from"], rows)


TABLES = {
    "parity-matrix": (parity_matrix, ["docs/parity/matrix-summary.json"]),
    "parity-selftest": (parity_selftest, ["docs/parity/selftest.json"]),
    "train-step": (train_step, ["docs/perf/train_step_2026-12-04.json",
                                "docs/perf/train_step_2026-12-04_malloc_env_all.json"]),
    "experts-small": (experts_small, ["docs/perf/experts_small_2026-12-04.json"]),
    "expert-shapes": (expert_shapes, ["docs/perf/expert_shapes_2026-12-04.json"]),
    "gpu-h200": (gpu_h200, ["docs/perf/gpu_h200_2026-12-04_a.json", "docs/perf/gpu_h200_2026-12-04_b.json"]),
    "gpu-memory": (gpu_memory, ["docs/perf/gpu_memory_cpu_proxy_flash_2026-12-06.json"]),
    "titan-steps": (titan_steps, ["docs/parity/titan-deepseek_v3-debugmodel-20steps.json",
                                  "docs/parity/titan-qwen3-debugmodel_moe-20steps.json",
                                  "docs/parity/titan-kimi_k2_7-debugmodel-20steps.json"]),
}


class DocTablesError(Exception):
    """Bad input: a missing JSON file or marker; the message says what and how to fix it."""


def render(name: str, root: Path | None = None) -> str:
    """The body of table ``name`` (without its markers), from its JSON files under ``root``
    (default: this checkout)."""
    root = root or ROOT
    fn, files = TABLES[name]
    data = []
    for f in files:
        try:
            data.append(json.loads((root / f).read_text()))
        except (OSError, ValueError) as e:
            raise DocTablesError(f"table {name}: cannot read {f} ({e}); restore it or change TABLES "
                                 "in bench/doc_tables.py") from e
    return "\n".join(fn(*data))


def _regions(text: str):
    """(name, start, end) of each generated region's body in ``text``."""
    for m in _BEGIN_RE.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise DocTablesError(f"{DOC}: region {m.group(1)} has no '{END}'; add it after the table")
        yield m.group(1), m.end(), end


def rewrite(text: str, root: Path | None = None) -> str:
    """``text`` with every generated region replaced by what its JSON gives."""
    out, pos = [], 0
    for name, start, end in list(_regions(text)):
        if name not in TABLES:
            raise DocTablesError(f"{DOC}: unknown generated table {name!r}; known: {', '.join(TABLES)}")
        out += [text[pos:start], "\n", render(name, root), "\n"]
        pos = end
    return "".join(out) + text[pos:]


def check(doc: Path | None = None, root: Path | None = None) -> str | None:
    """None when ``doc`` (default docs/MEASUREMENTS.md under ``root``, default this checkout) is
    current, else one line naming the first stale or missing table."""
    root = root or ROOT
    text = (doc or root / DOC).read_text()
    found = {name: text[start:end] for name, start, end in _regions(text)}
    for name in TABLES:
        if name not in found:
            return f"{DOC}: table {name} has no generated region; add its markers (bench/doc_tables.py)"
        if found[name] != "\n" + render(name, root) + "\n":
            return (f"{DOC}: table {name} is stale (its JSON: {', '.join(TABLES[name][1])}); "
                    "run python3 bench/doc_tables.py")
    unknown = sorted(set(found) - set(TABLES))
    return f"{DOC}: unknown generated table {unknown[0]!r}" if unknown else None


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    """The command line; ``root`` (default this checkout) holds docs/MEASUREMENTS.md and the JSON."""
    root = root or ROOT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated table is stale, rewrite nothing")
    args = p.parse_args(argv)
    try:
        if args.check:
            msg = check(root=root)
            if msg:
                print(msg, file=sys.stderr)
                return 1
            return 0
        path = root / DOC
        text = path.read_text()
        new = rewrite(text, root)
        if new != text:
            path.write_text(new)
        return 0
    except DocTablesError as e:
        print(f"doc_tables: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"doc_tables: cannot read {e.filename}: {e.strerror}; run it from a checkout", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
