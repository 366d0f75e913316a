"""`train.wandb` in offline mode: every metrics.jsonl key arrives in the W&B history (numbers under
their key, per-layer lists as ``KEY/moe_layer_N``, text in the summary), the project, name and tags
are the config's, and `--resume --resume-step 2` continues the same run id with steps after 2 (as
metrics.jsonl is cut there). The offline ``.wandb`` file is read back record by record."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from jaxmoe.cli import main

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402


def records(path: Path):
    """The protobuf records of an offline run file (LevelDB log blocks of 32 KiB, 7-byte headers:
    crc32, length, type 1 full / 2 first / 3 middle / 4 last; a 7-byte file header)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r
            buf = b""


def segment(path: Path) -> dict:
    """run id, project, name, tags, history rows by step, summary keys of one offline run file."""
    out = {"history": {}, "summary": set()}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name, tags=list(r.run.tags))
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out["history"][items["_step"]] = items
        elif kind == "summary":
            out["summary"] |= {i.key or "/".join(i.nested_key) for i in r.summary.update}
    return out


def test_wandb_offline_every_key_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    common = ["train", "--quiet", "--preset", "tiny", "--set", "train.eval_every=0", "--set", "train.batch_size=4",
              "--set", "train.seq_len=32", "--set", "train.wandb=true", "--set", "train.wandb_mode=offline",
              "--set", "train.wandb_project=proj", "--set", "train.wandb_tags=moe,tiny", "--out", str(out)]
    assert main(common + ["--steps", "3", "--checkpoint-every", "2"]) == 0
    assert main(common + ["--steps", "4", "--resume", "--resume-step", "2"]) == 0
    rid = json.loads((out / "wandb.json").read_text())["id"]
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    first, second = segment(files[0]), segment(files[1])
    assert first["id"] == second["id"] == rid
    assert (first["project"], first["name"], first["tags"]) == ("proj", "run", ["moe", "tiny"])
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == [3, 4]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        seg = second if r["step"] > 2 else first
        logged = seg["history"][r["step"]]
        for k, v in r.items():
            if k == "step":
                continue
            if isinstance(v, str):
                assert k in seg["summary"], k
            elif isinstance(v, dict):
                assert all(logged[f"{k}/{sub}"] == x for sub, x in v.items()), k
            elif isinstance(v, list):
                assert all(any(x.startswith(f"{k}/moe_layer_{i}") for x in logged) for i in range(len(v))), k
            else:
                assert logged[k] == pytest.approx(float(v), rel=1e-6), k


def test_missing_wandb_is_one_line(tmp_path, monkeypatch):
    import sys

    from jaxmoe.config import load_config
    from jaxmoe.errors import UserError
    from jaxmoe.train.wandb_log import open_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config("tiny", overrides=["train.wandb=true"])
    with pytest.raises(UserError) as e:
        open_wandb(cfg, tmp_path, 0)
    assert "pip install 'jaxmoe[wandb]'" in str(e.value) and "\n" not in str(e.value)
    assert open_wandb(load_config("tiny"), tmp_path, 0) is None  # off: nothing imported
