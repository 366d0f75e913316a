"""bench/train_step.py's torchtitan peer (``--peer torchtitan --titan FLAVOR``) and bench/step_parts.py:
both sides train on the same tokens at the same shape, the last line is the issue's contract, and
bad input gets one line and exit 2. Figures are never asserted (speed lives in bench/, not in tests)."""

import math
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_parts
import train_step

SMALL = ["--set", "train.batch_size=2", "--set", "train.seq_len=32"]


def test_both_sides_see_the_same_shape_and_tokens():
    cfg = train_step.jax_config("titan:deepseek_v3/debugmodel", ["train.batch_size=2", "train.seq_len=32"])
    assert (cfg.model.name, cfg.train.batch_size, cfg.train.seq_len) == ("titan:deepseek_v3/debugmodel", 2, 32)
    run, sync = train_step.make_titan(cfg)
    loss = sync(run())
    # torchtitan's model at its own init on uniform random tokens: near ln(vocab) (8.17 against 7.62)
    assert 0.8 * math.log(cfg.model.vocab_size) < loss < 1.25 * math.log(cfg.model.vocab_size)
    a, b = train_step.cfg_batch(cfg), train_step.cfg_batch(cfg)
    assert a["inputs"].shape == (2, 32) and (a["inputs"] == b["inputs"]).all()
    assert a["inputs"].max() < cfg.model.vocab_size


def test_peer_run_ends_with_the_ratio_line(capsys):
    rc = train_step.main(["--peer", "torchtitan", "--titan", "deepseek_v3/debugmodel", "--rounds", "1",
                          "--steps", "1", "--skip", "jaxmoe_train,torchtitan_compile", *SMALL])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert re.fullmatch(r"jaxmoe / torchtitan train step \(deepseek_v3/debugmodel, 2x32, fp32, CPU\): "
                        r"\d+\.\d\d \[\d+\.\d\d-\d+\.\d\d\]", out[-1]), out[-1]
    assert any("experts in fp32" in line for line in out)  # the handicaps are stated


def test_step_parts_table_has_every_part():
    res = step_parts.profile("deepseek_v3/debugmodel", 1, 1, ["train.batch_size=2", "train.seq_len=32"],
                             log=lambda m: None)
    parts = {r["part"]: r for r in res["parts"]}
    for p in step_parts.PARTS:
        assert parts[p]["jaxmoe_ms"] > 0 and parts[p]["torchtitan_ms"] > 0, p
    assert parts["attention"]["count"] == 6 and parts["moe block"]["count"] == 5
    assert parts["dense mlp"]["count"] == 1
    assert set(res["limit"]) == {"jaxmoe", "torchtitan"}
    assert "rest (whole - parts)" in step_parts.render(res)


@pytest.mark.parametrize("argv, needle", [
    (["--peer", "torchtitan"], "--titan FAMILY/FLAVOR"),
    (["--peer", "torchtitan", "--titan", "deepseek_v3/nosuch"], "nosuch"),
    (["--peer", "torchtitan", "--titan", "nofamily"], "nofamily"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    assert train_step.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_titan_without_peer_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        train_step.main(["--titan", "deepseek_v3/debugmodel"])
    assert e.value.code == 2 and "--titan needs --peer torchtitan" in capsys.readouterr().err
