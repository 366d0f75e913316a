"""Packaging: the wheel holds every subpackage and preset; jaxmoe works without torch.

torch/transformers are the ``[ref]`` extra. Without them ``import jaxmoe``, ``jaxmoe train`` and
``jaxmoe convert`` (hf:/orbax:/torch: files) work; ``--verify``, ``logits --framework torch|hf`` and
``parity`` fail with one line naming the extra. "Without torch" is simulated by a ``None`` entry in
``sys.modules`` (an import of it then raises ``ModuleNotFoundError``), in-process for the cheap
checks and in one subprocess for a real train + convert round trip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from jaxmoe.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers", "torch_ref", "tokenizers", "matplotlib", "tensorboardX", "torchtitan")


def _packages(root: Path) -> set[str]:
    out = set()
    for top in ("jaxmoe", "torch_ref", "parity"):
        for init in (root / top).rglob("__init__.py"):
            out.add(".".join(init.parent.relative_to(root).parts))
    return out


def test_core_dependencies_have_no_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    for name in ("torch", "transformers", "tokenizers", "matplotlib", "tensorboardX"):
        assert name not in core, name
    ref = " ".join(meta["optional-dependencies"]["ref"])
    assert "torch==2.13.0" in ref and "transformers" in ref
    titan = meta["optional-dependencies"]["titan"]  # pinned; torch via [ref], torchtitan --no-deps (.ci/run)
    assert "jaxmoe[ref]" in titan and all("==" in d for d in titan if d != "jaxmoe[ref]")
    assert "--no-deps \"torchtitan==0.3.0\"" in (ROOT / ".ci" / "run").read_text()


def test_wheel_holds_every_subpackage_and_preset(tmp_path):
    # ~12 s on 2 busy cores. Built from a copy of the tree: setuptools builds in place (build/,
    # *.egg-info), and a stale build/lib would carry deleted modules into later wheels.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "runs", "out", ".pytest_cache"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--quiet", str(src), "-w", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = tmp_path.glob("jaxmoe-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for pkg in sorted(_packages(ROOT)):
        assert pkg.replace(".", "/") + "/__init__.py" in names, pkg
    for pkg in ("jaxmoe.port", "jaxmoe.archs", "jaxmoe.model", "jaxmoe.config.presets"):
        assert pkg in _packages(ROOT)
    presets = sorted(p.name for p in (ROOT / "jaxmoe" / "config" / "presets").glob("*.toml"))
    assert presets
    for name in presets:
        assert f"jaxmoe/config/presets/{name}" in names, name
    assert not any(n.startswith("tests/") or n.startswith("bench/") for n in names)


@pytest.fixture
def no_torch(monkeypatch):
    # the packages and every submodule already imported (tests/test_titan.py imports torchtitan's
    # models at collection: a cached submodule would import without its blocked parent)
    for name in [n for n in sys.modules if n.split(".")[0] in BLOCKED] + list(BLOCKED):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("argv, extra", [
    (["convert", "--from", "hf:SRC", "--to", "orbax:DST", "--verify"], "ref"),
    (["logits", "--ckpt", "hf:SRC", "--tokens", "t.npy", "--out", "o.npy",
      "--framework", "torch"], "ref"),
    (["parity", "run", "--preset", "tiny"], "ref"),
    (["tokenizer", "--input", "SRC", "--vocab-size", "300", "--out", "tok.json"], "text"),
    (["plot", "RUN"], "plot"),
    (["config", "--from-titan", "deepseek_v3/671B"], "titan"),
    (["count", "--from-titan", "qwen3/30B-A3B"], "titan"),
])
def test_optional_extra_missing_is_one_line(no_torch, tmp_path, capsys, monkeypatch, argv, extra):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SRC").mkdir()
    (tmp_path / "SRC" / "a.txt").write_text("some text\n")
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert f"jaxmoe[{extra}]" in err and "Traceback" not in err, err
    assert not (tmp_path / "DST").exists() and not (tmp_path / "tok.json").exists()


SCRIPT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # this interpreter has no torch, transformers, tokenizers, ...
import json, os
from jaxmoe.cli import main
d = sys.argv[1]
rc = {{}}
rc["train"] = main(["train", "--preset", "tiny", "--steps", "3", "--out", d + "/run", "--quiet",
                    "--no-compile-cache"])
rc["to_hf"] = main(["convert", "--from", "orbax:" + d + "/run", "--to", "hf:" + d + "/hf"])
rc["to_orbax"] = main(["convert", "--from", "hf:" + d + "/hf", "--to", "orbax:" + d + "/back"])
rc["verify"] = main(["convert", "--from", "hf:" + d + "/hf", "--to", "orbax:" + d + "/v",
                     "--verify"])
rc["v_exists"] = os.path.exists(d + "/v")
rc["torch_loaded"] = any(m == "torch" or m.startswith("torch.") for m, v in sys.modules.items()
                         if v is not None)
print("RESULT " + json.dumps(rc))
"""


@pytest.mark.slow
def test_train_and_convert_without_torch(tmp_path):
    # slow: a real 3-step training run and three conversions in a fresh interpreter (~40 s)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT.format(blocked=BLOCKED)),
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert "RESULT " in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    import json

    res = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert res == {"train": 0, "to_hf": 0, "to_orbax": 0, "verify": 2, "v_exists": False,
                   "torch_loaded": False}, (res, r.stderr[-3000:])
    hint = [ln for ln in r.stderr.splitlines() if "--verify" in ln and "error" in ln]
    assert len(hint) == 1 and "jaxmoe[ref]" in hint[0], r.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert (tmp_path / "back" / "checkpoints").is_dir()
