"""The emergency checkpoint tier (jaxmoe/checkpoint/emergency.py, ``train.local_checkpoint_every``):
frequent per-process local checkpoints beside the persistent Orbax ones; a restart restores from
the newest complete tier; a torn or missing shard skips that step with one line; the restore
goes onto another mesh (resharded). In-process on 8 fake CPU devices; the two-process kill test
is in tests/test_multihost.py."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.cli import main
from jaxmoe.errors import UserError

TINY = ["--preset", "tiny", "--set", "train.seq_len=16", "--set", "train.eval_every=0", "--quiet",
        "--steps", "6"]
MESH2 = ["--mesh", "replica=2,fsdp=2,expert=2"]


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_restart_from_the_newest_complete_tier(tmp_path, capsys):
    """Local every step, persistent every 3: after 5 steps the tiers hold local {2, 4} (1, 2, 4
    written, the newest 2 kept; 3 and 5 are persistent steps) and persistent {3, 5}. The "crash"
    loses persistent 5 (never committed), so the newest complete tier is local 4. With its shards
    torn, local 4 is skipped with one line and persistent 3 (newer than local 2) is used. Either
    way the re-run steps equal, bit for bit, the ones the run logged before the "crash" (the
    restore onto a smaller mesh, after a killed process: tests/test_multihost.py)."""
    out = tmp_path / "run"
    base = [*TINY, "--set", "train.local_checkpoint_every=1", "--set", "checkpoint.every=3"]
    assert main(["train", *base, *MESH2, "--stop-after", "5", "--out", str(out)]) == 0
    local = out / "local_checkpoints" / "process_0"
    assert sorted(int(p.name) for p in local.iterdir()) == [2, 4]
    reference = losses(out)  # steps 1-5 with no failure
    shutil.rmtree(out / "checkpoints" / "5")  # the crash: step 5 never reached the persistent tier
    capsys.readouterr()

    small = MESH2  # the same compiled step (the smaller mesh: tests/test_multihost.py)
    keep = tmp_path / "copy"
    shutil.copytree(out, keep)
    assert main(["train", *base, *small, "--resume", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "resuming from local checkpoint 4" in err, err
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got[5] == reference[5]

    # the same crash with local 4's shards torn: one line, and the persistent step 3 restores
    data = keep / "local_checkpoints" / "process_0" / "4" / "shards.bin"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert main(["train", *base, *small, "--resume", "--out", str(keep)]) == 0
    err = capsys.readouterr().err
    skipped = [line for line in err.splitlines() if "local checkpoint 4 skipped" in line]
    assert len(skipped) == 1 and "torn" in skipped[0], err
    assert "resuming from local checkpoint" not in err
    got = losses(keep)
    assert [got[s] for s in (4, 5)] == [reference[s] for s in (4, 5)]


def test_tier_check_names_a_missing_shard(tmp_path):
    """A step whose process directories do not cover an array (one process's shards gone) is
    refused, naming the leaf and the elements covered; a complete one passes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxmoe.checkpoint.emergency import LocalTier

    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp")))
    state = {"w": x, "s": jnp.int32(7)}
    tier = LocalTier(tmp_path, 0, 1)
    tier.save(2, state, {"step": 2})
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))),
              "s": jax.ShapeDtypeStruct((), jnp.int32)}
    step, mans = tier.newest_complete(target, print)
    back, meta = tier.restore(target, mans)
    assert step == 2 and meta == {"step": 2} and int(back["s"]) == 7
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(x))  # resharded on restore
    man = tmp_path / "process_0" / "2" / "manifest.json"
    m = json.loads(man.read_text())
    m["leaves"]["w"]["shards"] = m["leaves"]["w"]["shards"][1:]
    man.write_text(json.dumps(m))
    with pytest.raises(UserError, match="the shards of w in process_0 cover 24 of 32 elements"):
        tier.check(2, target)
    lines = []
    assert tier.newest_complete(target, lines.append) is None and len(lines) == 1


def test_bad_local_checkpoint_every_is_one_line(tmp_path):
    """A negative train.local_checkpoint_every is refused in one line, nothing written."""
    from jaxmoe.config import load_config
    from jaxmoe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.local_checkpoint_every=-1 must be >= 0") as e:
        load_config(preset="tiny", overrides=["train.local_checkpoint_every=-1"])
    assert "\n" not in str(e.value)
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--quiet", "--set", "train.local_checkpoint_every=-2",
                 "--out", str(out)]) == 2
    assert not out.exists()
