"""``dcp:`` checkpoints (issue 29): torchtitan checkpoints written by torchtitan's own
``CheckpointManager`` (one rank model-only; two gloo ranks, FSDP-sharded, full state; its HF
export) read bit-exactly, converted, run (logits against torchtitan's own forward) and trained
from; reading one never runs code from it (a planted ``.metadata``, ``data.pkl`` and byte item);
and ``dcp:`` destinations -- a checkpoint converted and a run trained in jaxmoe -- restored by
torchtitan's own ``CheckpointManager`` into the flavor's model.

The checkpoints come from ``tests/titan_dcp_save.py`` in subprocesses (torchtitan's DeepSeek-V3
``debugmodel``, fp32, ~130 MB of weights). Everything that needs torchtitan is skipped, with the
reason, when it is not importable; the safe-unpickling tests need neither torch nor torchtitan.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from support import free_port, needs_titan

from jaxmoe.cli import main
from jaxmoe.errors import UserError
from jaxmoe.port.formats import bind_options, open_source, parse_endpoint
from jaxmoe.port.io.dcp_io import DcpDir, safe_loads
from jaxmoe.port.maps import titan_map

ROOT = Path(__file__).resolve().parents[1]
FLAVOR = "deepseek_v3/debugmodel"






def _save(out: Path, world: int, mode: str, flavor: str = FLAVOR) -> Path:
    """torchtitan's CheckpointManager saves step 1 of FLAVOR from ``world`` gloo ranks (``mode``:
    full, model_only or hf)."""
    port, env = free_port(), {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "titan_dcp_save.py"), str(out), flavor,
                               str(world), str(r), str(port), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("dcp1") / "ckpt", 1, "model_only")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("dcp2") / "ckpt", 2, "full")


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("hfx") / "ckpt", 1, "hf")


def _sigmoid_toml(path: Path) -> Path:
    """FLAVOR with a sigmoid router (so the expert bias maps) and HF's fixed MLA norm eps: a model
    HF's DeepseekV3 expresses, with the flavor's tensor shapes."""
    assert main(["config", "--from-titan", FLAVOR, "--set", "moe.score_func=sigmoid", "--set",
                 "moe.use_expert_bias=true", "--set", "model.mla_norm_eps=1e-6", "--out", str(path)]) == 0
    return path


def _open(spec: str, titan: str | None = FLAVOR):
    ep, _ = bind_options({"titan": titan}, source=parse_endpoint(spec))
    return open_source(ep)


def _expected(src, ckpt: Path) -> dict:
    ref = np.load(ckpt / "reference.npz")
    return titan_map.from_titan(src.cfg, {k: ref[k] for k in ref.files}, split_qkv=True)


def _assert_leaves(src, ckpt: Path) -> None:
    want = _expected(src, ckpt)
    assert set(src.keys()) == set(want)
    for k, a in want.items():
        got = src.read_leaf(k)
        assert got.dtype == np.float32 and np.array_equal(got, a), k


def _one_line(capsys) -> str:
    """The one error line on stderr (notes printed before it aside)."""
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note: ")]
    assert len(err) == 1, err
    return err[0]


# --------------------------------------------------------------------------------------------
# reading torchtitan's checkpoints
# --------------------------------------------------------------------------------------------


@needs_titan
def test_model_only_checkpoint_reads_bit_exact_and_converts_to_orbax(one_rank, tmp_path, capsys):
    step = one_rank / "step-1"
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp"]
    with _open(f"dcp:{step}") as src:
        _assert_leaves(src, one_rank)
        # torchtitan's default expert bias on the flavor's softmax router is read in (zero at init)
        assert src.cfg.moe.use_expert_bias and src.cfg.moe.score_func == "softmax"
        assert not any("expert_bias_E" in n for n in src.notices), src.notices
        assert not any("training state" in n for n in src.notices)
        rows = src.read_rows("params/moe/experts/gate_proj", 2)
        assert np.array_equal(rows, src.read_leaf("params/moe/experts/gate_proj")[:2])
    rc = main(["convert", "--from", f"dcp:{step}", "--titan", FLAVOR, "--to", f"orbax:{tmp_path}/run", "--json",
               "--verify", "--verify-layers", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    v = json.loads(out)["verify"]  # torchtitan's own model on its own files vs jaxmoe on the run dir
    assert (v["src_framework"], v["dst_framework"]) == ("titan", "jax") and v["ok"], v
    with _open(f"orbax:{tmp_path}/run", None) as back:
        _assert_leaves(back, one_rank)


@needs_titan
def test_two_rank_sharded_full_checkpoint_assembles(two_ranks, tmp_path, capsys):
    step = two_ranks / "step-1"
    d = DcpDir(step, "x")
    chunks = d.chunks("layers.1.moe.routed_experts.inner_experts.w1_EFD")
    assert [c.offsets for c in chunks] == [(0, 0, 0), (4, 0, 0)]
    assert {c.file.name for c in chunks} == {"__0_0.distcp", "__1_0.distcp"}
    assert any(n.startswith("optimizer.state.") for n in d.tensors) and "lr_scheduler.last_epoch" in d.byte_items
    with _open(f"dcp:{step}") as src:
        _assert_leaves(src, two_ranks)
        notes = " ".join(src.notices)
        assert "dataloader, lr_scheduler, optimizer, train_state" in notes, notes

    # to hf: with a jaxmoe config .toml naming the model (the flavor with a sigmoid router and
    # the expert bias it then maps; HF's fixed MLA norm eps), the expert-bias leaves included
    toml = _sigmoid_toml(tmp_path / "m.toml")
    rc = main(["convert", "--from", f"dcp:{step}", "--titan", str(toml), "--to", f"hf:{tmp_path}/hf"])
    assert rc == 0, capsys.readouterr().err
    with _open(f"hf:{tmp_path}/hf", None) as back:
        assert back.cfg.moe.use_expert_bias
        _assert_leaves(back, two_ranks)


@needs_titan
def test_two_rank_training_state_reads_for_resume(two_ranks):
    """The training state ``--resume-from`` reads, from the 2-rank FSDP-sharded full checkpoint
    (each moment's rows in two files): one AdamW update of lr 1e-3 on gradients of 1e-3 everywhere
    gives exp_avg = (1 - 0.9) * 1e-3 = 1e-4 and exp_avg_sq = (1 - 0.95) * 1e-6 = 5e-8 in every
    element of every leaf; step = AdamW count = last_epoch = 1; the group's betas, eps, decay."""
    from jaxmoe.port.maps.titan_state import grouped, optimizer_entries, read_moment
    from jaxmoe.train.titan_resume import open_resume

    res = open_resume(f"dcp:{two_ranks}/step-1", FLAVOR)
    ts = res.ts
    assert (ts.step, ts.count, ts.last_epoch, ts.ntokens_seen) == (1, 1, 1, 4096)
    assert (ts.initial_lr, ts.lr, ts.betas, ts.eps, ts.weight_decay) == (1e-3, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    d, cfg = res.src.dir, res.src.cfg
    assert len(d.chunks("optimizer.state.layers.1.moe.routed_experts.inner_experts.w1_EFD.exp_avg")) == 2
    groups = grouped(optimizer_entries(cfg))
    assert len(groups) == sum(k.startswith("params/") for k in res.src.shapes)  # every trained leaf
    for key, ents in groups.items():
        mu = read_moment(d, ents, res.src.shapes[key], "exp_avg")
        nu = read_moment(d, ents, res.src.shapes[key], "exp_avg_sq")
        assert np.allclose(mu, 1e-4, rtol=1e-6, atol=0) and np.allclose(nu, 5e-8, rtol=1e-6, atol=0), key


@needs_titan
def test_logits_of_a_dcp_checkpoint_match_torchtitan(one_rank, tmp_path):
    import torch

    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model

    tokens = np.random.default_rng(0).integers(0, 2048, size=(2, 16)).astype(np.int64)
    np.save(tmp_path / "tok.npy", tokens)
    rc = main(["logits", "--ckpt", f"dcp:{one_rank}/step-1", "--titan", FLAVOR, "--tokens",
               str(tmp_path / "tok.npy"), "--out", str(tmp_path / "jax.npy")])
    assert rc == 0
    model = build_titan_model(titan_model_config(FLAVOR), fp32_experts=True)
    ref = np.load(one_rank / "reference.npz")
    model.load_state_dict({k: torch.from_numpy(ref[k]) for k in ref.files}, strict=False)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).numpy()
    got = np.load(tmp_path / "jax.npy")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


# --------------------------------------------------------------------------------------------
# writing dcp: torchtitan restores it
# --------------------------------------------------------------------------------------------


def _titan_load(step: Path, folder: Path, flavor: str = FLAVOR) -> dict:
    """torchtitan's CheckpointManager loads ``step`` model-only (``initial_load_path``) into a
    fresh FLAVOR model: its state dict as numpy."""
    import torch
    from torchtitan.components.checkpoint import CheckpointManager

    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model

    model = build_titan_model(titan_model_config(flavor), fp32_experts=False)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.fill_(7.0)
    cfg = CheckpointManager.Config(enable=True, folder=str(folder), initial_load_path=str(step),
                                   initial_load_model_only=True, keep_latest_k=0)
    ckpt = CheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=None,
                             lr_schedulers=None, states={}, sd_adapter=None)
    assert ckpt.load()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("dcpt") / "ckpt", 1, "trained")


@needs_titan
def test_a_checkpoint_torchtitan_trained_with_its_bias_hook_runs_in_jaxmoe(trained, tmp_path, capsys):
    """torchtitan trains deepseek_v3/debugmodel (softmax router, its default expert bias) for 10
    steps with its own AdamW, schedule and load-balancing hook: the biases are non-zero, and
    ``jaxmoe logits`` on the model-only DCP gives torchtitan's logits; converting it to a jaxmoe run
    and back to dcp: keeps every tensor, the biases included, bit for bit."""
    import torch

    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model

    ref = np.load(trained / "reference.npz")
    biases = [k for k in ref.files if k.endswith("moe.expert_bias_E")]
    assert biases and all(np.abs(ref[k]).max() > 0 for k in biases)
    tokens = np.random.default_rng(0).integers(0, 2048, size=(2, 16)).astype(np.int64)
    np.save(tmp_path / "tok.npy", tokens)
    step = trained / "step-10"
    assert main(["logits", "--ckpt", f"dcp:{step}", "--titan", FLAVOR, "--tokens", str(tmp_path / "tok.npy"),
                 "--out", str(tmp_path / "jax.npy")]) == 0
    model = build_titan_model(titan_model_config(FLAVOR), fp32_experts=True)
    model.load_state_dict({k: torch.from_numpy(ref[k]) for k in ref.files}, strict=False)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).numpy()
    got = np.load(tmp_path / "jax.npy")
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # and without the biases the logits differ by well over the tolerance above: the test sees them
    model.load_state_dict({k: torch.zeros_like(torch.from_numpy(ref[k])) for k in biases}, strict=False)
    with torch.no_grad():
        assert np.abs(model(torch.from_numpy(tokens)).numpy() - want).max() > 5e-4 * np.abs(want).max()
    assert main(["convert", "--from", f"dcp:{step}", "--titan", FLAVOR, "--to", f"orbax:{tmp_path}/run"]) == 0
    assert main(["convert", "--from", f"orbax:{tmp_path}/run", "--to", f"dcp:{tmp_path}/back"]) == 0, \
        capsys.readouterr().err
    back = _titan_load(tmp_path / "back", tmp_path / "folder")
    for k in ref.files:
        assert np.array_equal(back[k], ref[k]), k


@needs_titan
def test_torchtitan_restores_what_dcp_destinations_hold(one_rank, tmp_path, capsys):
    # torchtitan -> jaxmoe run dir -> torchtitan: the model comes back bit for bit
    assert main(["convert", "--from", f"dcp:{one_rank}/step-1", "--titan", FLAVOR,
                 "--to", f"orbax:{tmp_path}/run"]) == 0
    assert main(["convert", "--from", f"orbax:{tmp_path}/run", "--to", f"dcp:{tmp_path}/step-9"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "step-9").iterdir()) == [".metadata", "__0_0.distcp"]
    got = _titan_load(tmp_path / "step-9", tmp_path / "ckpt")
    ref = np.load(one_rank / "reference.npz")
    for k in ref.files:
        assert np.array_equal(got[k], ref[k]), k
    # ... and jaxmoe reads its own dcp: like torchtitan's (the zero expert biases included)
    with _open(f"dcp:{tmp_path}/step-9") as src:
        _assert_leaves(src, one_rank)
    # an existing destination is not overwritten
    rc = main(["convert", "--from", f"orbax:{tmp_path}/run", "--to", f"dcp:{tmp_path}/step-9"])
    assert rc == 2 and "exists" in _one_line(capsys)


@needs_titan
def test_a_run_trained_in_jaxmoe_goes_back_to_torchtitan(one_rank, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--init-from", f"dcp:{one_rank}/step-1", "--titan", FLAVOR,
                 "--steps", "2", "--out", str(run), "--quiet", "--set", "train.seq_len=32",
                 "--set", "train.batch_size=2"]) == 0, capsys.readouterr().err
    rec = json.loads((run / "run.json").read_text())["init_from"]  # --resume re-opens it with --titan
    assert rec["options"] == {"titan": FLAVOR} and rec["source"] == f"dcp:{one_rank / 'step-1'}"
    assert main(["train", "--preset", "tiny", "--titan", FLAVOR, "--steps", "1", "--out", str(tmp_path / "x")]) == 2
    assert "--init-from" in _one_line(capsys)
    assert main(["convert", "--from", f"orbax:{run}", "--to", f"dcp:{tmp_path}/step-2"]) == 0
    got = _titan_load(tmp_path / "step-2", tmp_path / "ckpt")
    with _open(f"orbax:{run}", None) as src:
        leaves = {k: src.read_leaf(k) for k in src.keys()}
        cfg = src.cfg
    tree = {"params": {}, "buffers": {}}
    for k, a in leaves.items():
        top, rest = k.split("/", 1)
        tree[top][rest] = a
    from jaxmoe.trees import unflatten

    want = titan_map.to_titan(cfg, unflatten(tree["params"]), unflatten(tree["buffers"]))
    ref = np.load(one_rank / "reference.npz")
    moved = 0
    for k, a in want.items():
        assert np.array_equal(got[k], a), k
        moved += not np.array_equal(a, ref[k])
    assert moved > len(want) // 2  # the weights trained in jaxmoe, not the initial ones
    # without torch a model-only dcp: is still written (the same tensors: jaxmoe lays out torch's
    # bytes itself); the training state (--with-optimizer) needs torch: one line naming the extra,
    # before anything is written
    monkeypatch.setitem(sys.modules, "torch", None)
    capsys.readouterr()
    assert main(["convert", "--from", f"orbax:{run}", "--to", f"dcp:{tmp_path}/notorch"]) == 0
    again = DcpDir(tmp_path / "notorch", "t")
    assert all(np.array_equal(again.read(k), got[k]) for k in want)
    rc = main(["convert", "--from", f"orbax:{run}", "--to", f"dcp:{tmp_path}/no", "--with-optimizer"])
    assert rc == 2 and "pip install" in _one_line(capsys) and not (tmp_path / "no").exists()


@needs_titan
@pytest.mark.slow  # a 1.3 GB checkpoint: ~30 s here
def test_gqa_flavor_reads_and_writes_state_dict_names(tmp_path, capsys):
    """Qwen3's fused wqkv is saved as stock wq / wk / wv (FusedQKVLinear's state-dict hooks):
    read bit-exact, and written so torchtitan merges them back on load."""
    flavor = "qwen3/debugmodel_moe"
    ckpt = _save(tmp_path / "q", 1, "model_only", flavor)
    with _open(f"dcp:{ckpt}/step-1", flavor) as src:
        _assert_leaves(src, ckpt)
    assert main(["convert", "--from", f"dcp:{ckpt}/step-1", "--titan", flavor, "--to", f"dcp:{tmp_path}/back"]) == 0
    got = _titan_load(tmp_path / "back", tmp_path / "folder", flavor)
    ref = np.load(ckpt / "reference.npz")
    for k in ref.files:
        assert np.array_equal(got[k], ref[k]), k


# --------------------------------------------------------------------------------------------
# bad input: one line, nothing written
# --------------------------------------------------------------------------------------------


@needs_titan
def test_bad_dcp_input_is_one_line_and_writes_nothing(one_rank, tmp_path, capsys):
    import shutil

    step, out = one_rank / "step-1", tmp_path / "out"

    def fails(src_dir, *extra) -> str:
        rc = main(["convert", "--from", f"dcp:{src_dir}", *extra, "--to", f"orbax:{out}"])
        assert rc == 2 and not out.exists()
        return _one_line(capsys)

    assert "holds no model config" in fails(step)
    assert "it holds step-1" in fails(one_rank, "--titan", FLAVOR)
    # a config whose shapes disagree: the tensor and both shapes
    toml = tmp_path / "wide.toml"
    assert main(["config", "--from-titan", FLAVOR, "--set", "model.vocab_size=4096", "--out", str(toml)]) == 0
    capsys.readouterr()
    msg = fails(step, "--titan", str(toml))
    assert "tok_embeddings.weight has shape [2048, 256] in the checkpoint" in msg and "[4096, 256]" in msg
    # fewer layers than the checkpoint: its extra tensors are listed, not dropped
    toml5 = tmp_path / "five.toml"
    assert main(["config", "--from-titan", FLAVOR, "--set", "model.n_layers=5", "--out", str(toml5)]) == 0
    capsys.readouterr()
    msg = fails(step, "--titan", str(toml5))
    assert "has no place for: layers.5." in msg, msg
    # a foreign state dict: none of the model's tensors
    assert "not a torchtitan checkpoint" in fails(step, "--titan", "tiny")
    # a missing or truncated shard file
    broken = tmp_path / "broken"
    shutil.copytree(step, broken)
    (broken / "__0_0.distcp").rename(tmp_path / "aside.distcp")
    assert "shard file __0_0.distcp is missing" in fails(broken, "--titan", FLAVOR)
    with open(tmp_path / "aside.distcp", "rb") as f, open(broken / "__0_0.distcp", "wb") as g:
        g.write(f.read(1000))
    assert "__0_0.distcp is truncated" in fails(broken, "--titan", FLAVOR)
    (broken / ".metadata").unlink()
    assert "no .metadata" in fails(broken, "--titan", FLAVOR)


# --------------------------------------------------------------------------------------------
# reading runs no code from the checkpoint
# --------------------------------------------------------------------------------------------


class _Touch:
    """Unpickling this creates ``path`` (what a hostile checkpoint would do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_planted_metadata_pickle_is_refused_before_running(tmp_path, capsys):
    marker = tmp_path / "pwned"
    step = tmp_path / "step-1"
    step.mkdir()
    (step / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Touch(marker)}))
    with pytest.raises(UserError, match=r"refusing to unpickle io\.open") as e:
        DcpDir(step, "dcp:x")
    assert "\n" not in str(e.value) and not marker.exists()
    rc = main(["convert", "--from", f"dcp:{step}", "--titan", "tiny", "--to", f"orbax:{tmp_path}/out"])
    assert rc == 2 and "refusing to unpickle io.open" in _one_line(capsys)
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the same payload through plain pickle does run (the test would catch a reader that ran it)
    pickle.loads(pickle.dumps(_Touch(tmp_path / "control")))
    assert (tmp_path / "control").exists()


def test_safe_loads_refuses_every_name_off_the_allow_list():
    for payload in (pickle.dumps(os.getcwd), pickle.dumps(io.BytesIO), b"cposix\nsystem\n(S'true'\ntR."):
        with pytest.raises(UserError, match="refusing to unpickle"):
            safe_loads(payload, "x")
    assert safe_loads(pickle.dumps({"a": (1, 2.0, "s")}), "x") == {"a": (1, 2.0, "s")}


def _forge(step: Path, src_step: Path, data_pkl: bytes | None, byte_item: bytes | None) -> None:
    """A copy of ``src_step`` whose ``norm.weight`` chunk carries ``data_pkl`` as its torch.save
    data.pkl, and/or with a ``train_state`` byte item holding ``byte_item`` (written with
    torch's own metadata classes, as a real checkpoint would be)."""
    import shutil

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as dm

    shutil.copytree(src_step, step)
    md = pickle.loads((src_step / ".metadata").read_bytes())  # our own test checkpoint, trusted
    extra = step / "__9_0.distcp"
    with open(extra, "wb") as f:
        if data_pkl is not None:
            n = int(np.prod(md.state_dict_metadata["norm.weight"].size))
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
                z.writestr("archive/data.pkl", data_pkl)
                z.writestr("archive/data/0", np.zeros(n, np.float32).tobytes())
            idx = next(i for i in md.storage_data if i.fqn == "norm.weight")
            md.storage_data[idx] = fs._StorageInfo("__9_0.distcp", f.tell(), len(buf.getvalue()))
            f.write(buf.getvalue())
        if byte_item is not None:
            md.state_dict_metadata["train_state"] = dm.BytesStorageMetadata()
            md.storage_data[dm.MetadataIndex("train_state")] = fs._StorageInfo("__9_0.distcp", f.tell(),
                                                                                 len(byte_item))
            f.write(byte_item)
    (step / ".metadata").write_bytes(pickle.dumps(md))


@needs_titan
def test_planted_data_pkl_and_byte_item_run_nothing(one_rank, tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Touch(marker), protocol=2)

    bad_tensor = tmp_path / "bad_tensor"
    _forge(bad_tensor, one_rank / "step-1", data_pkl=evil, byte_item=None)
    rc = main(["convert", "--from", f"dcp:{bad_tensor}", "--titan", FLAVOR, "--to", f"orbax:{tmp_path}/o1"])
    msg = _one_line(capsys)
    assert rc == 2 and "norm.weight (data.pkl): refusing to unpickle io.open" in msg, msg
    assert not marker.exists() and not (tmp_path / "o1").exists()

    # a byte item is never unpickled: the weights convert, the payload stays inert
    bad_item = tmp_path / "bad_item"
    _forge(bad_item, one_rank / "step-1", data_pkl=None, byte_item=evil)
    rc = main(["convert", "--from", f"dcp:{bad_item}", "--titan", FLAVOR, "--to", f"orbax:{tmp_path}/o2"])
    assert rc == 0, capsys.readouterr().err
    assert not marker.exists() and (tmp_path / "o2").is_dir()
