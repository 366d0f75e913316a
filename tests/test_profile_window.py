"""``train.profile_steps = "A:B"``: ``jaxmoe train`` writes an XLA trace of steps A..B into the run
directory (TensorBoard/xprof layout) and says where; a bad window is one line, before any write."""

import gzip
import json
from pathlib import Path

import pytest

from jaxmoe.cli import main
from jaxmoe.config import ConfigError, load_config

SMALL = ["--preset", "tiny", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
         "--set", "train.eval_every=0"]


def test_trace_of_the_window_opens(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "4", "--set", "train.profile_steps=2:3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("profile:")]
    assert len(lines) == 1 and "steps 2..3" in lines[0], err
    runs = list((out / "tb" / "plugins" / "profile").iterdir())
    assert len(runs) == 1 and str(runs[0]) in lines[0]  # one trace, and the line names it
    (xplane,) = runs[0].glob("*.xplane.pb")
    assert xplane.stat().st_size > 0
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    # the train step's executions are in the window (its jitted function, as jax names it)
    assert sum("jit(step)" in e.get("name", "") for e in events) >= 2, sorted({e.get("name") for e in events})[:50]
    assert len(json.loads((out / "run.json").read_text())) > 0  # the run itself finished normally


def test_no_window_no_trace(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--quiet", *SMALL, "--steps", "2", "--out", str(out)]) == 0
    assert not (out / "tb" / "plugins").exists()


@pytest.mark.parametrize("spec, needle", [
    ("3", "must be 'A:B'"), ("a:b", "must be 'A:B'"), ("2:x", "must be 'A:B'"),
    ("0:2", "1 <= A <= B"), ("3:2", "1 <= A <= B"), ("2:9", "train.steps=4"),
])
def test_bad_window_is_one_line(spec, needle):
    with pytest.raises(ConfigError, match="train.profile_steps") as e:
        load_config("tiny", overrides=["train.steps=4", f"train.profile_steps={spec}"])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_window_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "4", "--set", "train.profile_steps=5:6", "--out", str(out)]) == 2
    assert not Path(out).exists()
    assert "train.profile_steps" in capsys.readouterr().err
