"""The asynchronous training loop: bit-identical to the synchronous loop (losses, skipped steps,
checkpoints), evaluation not charged to the steps' tokens/s, and the persistent compilation cache
used by a second run of the same config."""

import json
from pathlib import Path

from jaxmoe.cli import main
from jaxmoe.train import compile_cache

SMALL = ["--preset", "tiny", "--set", "train.batch_size=4", "--set", "train.seq_len=32"]


def cli(*args):
    return main(["train", "--quiet", *args])


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_async_loop_equals_sync_loop(tmp_path):
    common = [*SMALL, "--steps", "8", "--checkpoint-every", "3", "--set", "train.eval_every=4"]
    a, s = tmp_path / "async", tmp_path / "sync"
    assert cli(*common, "--out", str(a)) == 0
    assert cli(*common, "--out", str(s), "--set", "train.async_loop=false") == 0
    ra, rs = rows(a), rows(s)
    assert [r["loss"] for r in ra] == [r["loss"] for r in rs]  # bit for bit
    assert [r["step"] for r in ra] == list(range(1, 9))
    assert [r.get("eval_ce") for r in ra] == [r.get("eval_ce") for r in rs]
    assert ra[3]["eval_ce"] is not None and "eval_ce" not in ra[2]
    ck = lambda d: sorted(int(p.name) for p in (d / "checkpoints").iterdir() if p.name.isdigit())  # noqa: E731
    assert ck(a) == ck(s)


def test_non_finite_steps_skipped_at_the_same_steps_async(tmp_path, capsys):
    bad = [*SMALL, "--steps", "30", "--set", "optim.lr=1e30", "--set", "optim.warmup_steps=0",
           "--set", "optim.grad_clip=0", "--set", "train.eval_every=0", "--set", "train.max_bad_steps=3",
           "--checkpoint-every", "1"]
    a, s = tmp_path / "a", tmp_path / "s"
    assert cli(*bad, "--out", str(a)) == 3
    err_a = capsys.readouterr().err
    assert cli(*bad, "--out", str(s), "--set", "train.async_loop=false") == 3
    err_s = capsys.readouterr().err
    ra, rs = rows(a), rows(s)
    assert [(r["step"], r["skipped"]) for r in ra] == [(r["step"], r["skipped"]) for r in rs]
    skipped = [r["step"] for r in ra if r["skipped"]]
    assert len(skipped) == 3 and skipped[-1] == ra[-1]["step"]  # the stop step is the last row
    for err in (err_a, err_s):
        assert f"step {skipped[0]}: non-finite" in err and f"at step {skipped[-1]}" in err
        assert f"last good checkpoint (step {skipped[0] - 1})" in err


def test_second_run_hits_the_compilation_cache(tmp_path, capsys):
    # the suite already points jax at a per-session cache directory (tests/conftest.py), which
    # jaxmoe uses as it is; two runs of one config: the second compiles from the cache
    common = [*SMALL, "--steps", "3", "--set", "train.eval_every=0", "--set", "train.seed=7"]
    for name in ("one", "two"):
        assert main(["train", *common, "--out", str(tmp_path / name)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "compiling the train step" in line]
    assert len(lines) == 2 and "from the compilation cache" in lines[1], lines


def test_cache_location_and_opt_out(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXMOE_CACHE_DIR", str(tmp_path / "c"))
    d = compile_cache.cache_dir()
    assert d.parent == tmp_path / "c" and d.name.startswith("jax-") and d.name.endswith("-cpu")
    monkeypatch.delenv("JAXMOE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir().parent == tmp_path / "xdg" / "jaxmoe"
    assert compile_cache.enable(False) is None
    monkeypatch.setenv("JAXMOE_COMPILE_CACHE", "0")
    assert compile_cache.enable(True) is None
