"""Conversion memory does not grow with the number of experts (nor the model, with --verify-layers).

Each conversion runs in a fresh interpreter that reports its own peak RSS (``VmHWM``; not
``getrusage(RUSAGE_CHILDREN)``, which also counts this test process's peak after exec). Same
per-expert size, 8 vs 64 experts: an expert leaf ``[L, E, D, I]`` is 17 MB vs 134 MB, the model
50 MB vs 400 MB. ``orbax -> hf`` reads one Zarr chunk (<= 4 MiB) of a leaf at a time, so its
peak stays within 1.3x (measured here: 1.49x with 64 MiB chunks, 1.21x with 16 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxmoe.config import config_from_dict, load_config
from jaxmoe.config.hf import to_hf_config
from jaxmoe.port.io.safetensors_io import SafetensorsWriter
from jaxmoe.port.maps import hf_map
from jaxmoe.storage import page_cache

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from jaxmoe.cli import main
rc = main(json.loads(sys.argv[1]))
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print("PEAK " + json.dumps({"rc": rc, "peak_rss": rss}))
"""


def _cfg(n_experts: int, n_layers: int = 2):
    d = {"model": {"name": f"mem-{n_experts}", "vocab_size": 256, "d_model": 256,
                   "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64},
         "moe": {"n_experts": n_experts, "top_k": 2, "expert_ffn_dim": 1024}}
    return config_from_dict(d, load_config("tiny"))


def _write_hf(cfg, out: Path) -> None:
    table = hf_map.entries(cfg)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    w = SafetensorsWriter(out, [(e.hf_name, e.hf_shape, np.float32) for e in table])
    rng = np.random.default_rng(0)
    for e in table:
        w.write(e.hf_name, rng.standard_normal(e.hf_shape, dtype=np.float32) * 0.05)
    w.close()


def _uncache(files) -> None:
    """Drop ``files`` from the page cache, written back first: a page the writer dirtied (a
    tensor's unaligned head or tail goes through the cache) outlives ``posix_fadvise(DONTNEED)``
    until writeback ends, which under load is after the test looks."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        page_cache.drop_path(f)


def _peak(argv) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True,
                       text=True, env=env, timeout=900)
    line = [x for x in r.stdout.splitlines() if x.startswith("PEAK ")]
    assert line and json.loads(line[-1][5:])["rc"] == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line[-1][5:])["peak_rss"]


@pytest.mark.slow
def test_orbax_to_hf_peak_rss_does_not_grow_with_experts(tmp_path):
    # slow: writes ~0.9 GB of checkpoints (~1-2 min on 2 busy cores)
    peaks = {}
    for e in (8, 64):
        cfg = _cfg(e)
        _write_hf(cfg, tmp_path / f"hf{e}")
        peaks[("hf->orbax", e)] = _peak(["convert", "--from", f"hf:{tmp_path}/hf{e}",
                                         "--to", f"orbax:{tmp_path}/run{e}"])
        peaks[("orbax->hf", e)] = _peak(["convert", "--from", f"orbax:{tmp_path}/run{e}",
                                         "--to", f"hf:{tmp_path}/back{e}"])
        leaf = hf_map.leaf_shapes(cfg)["params/moe/experts/gate_proj"]
        print(f"E={e}: expert leaf {list(leaf)} {np.prod(leaf) * 4 / 1e6:.0f} MB; peak RSS "
              + ", ".join(f"{k[0]} {v / 1e6:.0f} MB" for k, v in peaks.items() if k[1] == e))
    ratio = peaks[("orbax->hf", 64)] / peaks[("orbax->hf", 8)]
    assert ratio <= 1.3, (ratio, peaks)
    # hf -> orbax: each Zarr chunk is filled from the source's view, which holds one layer's
    # block ([E, I, D], 67 MB at E=64) by design, plus a few chunks in TensorStore: the peak
    # grows by about that block (~100 MB measured), never by the leaf (134 MB at E=64)
    leaf = int(np.prod(hf_map.leaf_shapes(_cfg(64))["params/moe/experts/gate_proj"])) * 4
    grew = peaks[("hf->orbax", 64)] - peaks[("hf->orbax", 8)]
    assert grew < leaf, (grew, leaf, peaks)


@pytest.mark.slow
def test_verify_layers_peak_rss_does_not_grow_with_depth(tmp_path):
    # slow: two conversions with --verify in transformers and jaxmoe (~1-2 min)
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    peaks = {}
    for n in (1, 8):
        cfg = _cfg(32, n_layers=n)
        _write_hf(cfg, tmp_path / f"hf{n}")
        peaks[n] = _peak(["convert", "--from", f"hf:{tmp_path}/hf{n}", "--to",
                          f"orbax:{tmp_path}/run{n}", "--verify", "--verify-layers", "1"])
    # the 8-layer model is ~8x the 1-layer one (~100 MB per layer); only layer 0 is read
    assert peaks[8] / peaks[1] <= 1.3, peaks


def test_orbax_destination_checks_free_disk_first(tmp_path, monkeypatch, capsys):
    import shutil as _shutil

    from jaxmoe.cli import main
    from jaxmoe.port.formats import orbax as orbax_format

    _write_hf(load_config("tiny"), tmp_path / "hf")
    real = _shutil.disk_usage
    monkeypatch.setattr(orbax_format.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=100_000))
    rc = main(["convert", "--from", f"hf:{tmp_path}/hf", "--to", f"orbax:{tmp_path}/run"])
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert rc == 2 and len(err) == 1 and "not enough free disk" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing left behind


# --------------------------------------------------------------------------------------------
# Conversion at disk speed: raw byte copies, their failure, fsync once per file
# --------------------------------------------------------------------------------------------


def _ep(text):
    from jaxmoe.port.formats import parse_endpoint

    return parse_endpoint(text)


def _same_tensors(a: Path, b: Path) -> None:
    from jaxmoe.port.io.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    assert sorted(ra.names()) == sorted(rb.names())
    for n in ra.names():
        x, y = ra.get(n), rb.get(n)
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), n


def test_safetensors_routes_copy_bytes_in_the_kernel_bit_exact(tmp_path):
    from jaxmoe.port.commands.convert import convert

    cfg = load_config("tiny")
    _write_hf(cfg, tmp_path / "hf")
    r1 = convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"torch:{tmp_path}/m.safetensors"), log=lambda m: None)
    r2 = convert(_ep(f"torch:{tmp_path}/m.safetensors"), _ep(f"hf:{tmp_path}/back"),
                 log=lambda m: None, shard_size=100_000)
    for r in (r1, r2):  # every leaf went file to file: same names, dtypes, per-expert layout
        assert r["bytes_copied"] == r["bytes"] > 0, r
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 1
    _same_tensors(tmp_path / "hf", tmp_path / "back")
    # a cast, or the fused layout, is not a byte copy: those leaves take the array path
    r3 = convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"hf:{tmp_path}/bf16"), dtype="bfloat16",
                 log=lambda m: None)
    r4 = convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"hf:{tmp_path}/fused"), log=lambda m: None,
                 hf_layout="fused")
    fp32 = hf_map.fp32_leaves(cfg)  # kept fp32 under --dtype: still copied as they are
    shapes = hf_map.leaf_shapes(cfg)
    assert r3["bytes_copied"] == sum(int(np.prod(shapes[k])) * 4 for k in fp32 if k in shapes)
    assert 0 < r4["bytes_copied"] < r4["bytes"]  # dense leaves copied, expert leaves fused
    r5 = convert(_ep(f"hf:{tmp_path}/fused"), _ep(f"hf:{tmp_path}/unfused"), log=lambda m: None)
    _same_tensors(tmp_path / "hf", tmp_path / "unfused")
    assert r5["bytes_copied"] < r5["bytes"]


def test_copy_bytes_falls_back_and_refuses_a_short_source(tmp_path, monkeypatch):
    from jaxmoe.errors import UserError
    from jaxmoe.storage import file_copy

    data = np.arange(300_000, dtype=np.uint8).tobytes()
    (tmp_path / "src").write_bytes(data)

    def no_copy(*a):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(file_copy, "COPY_BLOCK", 4096)  # several pieces
    for patched in (False, True):
        (tmp_path / "dst").write_bytes(b"\0" * 400_000)
        if patched:
            monkeypatch.setattr(file_copy.os, "copy_file_range", no_copy)
        file_copy.copy_bytes(tmp_path / "src", 1000, tmp_path / "dst", 50_000, 250_000)
        got = (tmp_path / "dst").read_bytes()
        assert got[50_000:300_000] == data[1000:251_000]
        assert got[:50_000] == b"\0" * 50_000 and got[300_000:] == b"\0" * 100_000
        with pytest.raises(UserError, match="truncated"):
            file_copy.copy_bytes(tmp_path / "src", 200_000, tmp_path / "dst", 0, 150_000)


def test_a_failing_copy_thread_leaves_nothing_written(tmp_path, monkeypatch):
    from jaxmoe.port.commands import convert as conv

    _write_hf(load_config("tiny"), tmp_path / "hf")
    calls = []
    real = conv.copy_bytes

    def flaky(*a):
        calls.append(a)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return real(*a)

    monkeypatch.setattr(conv, "copy_bytes", flaky)
    monkeypatch.setattr(conv, "_joined", lambda pairs: pairs)  # one copy per tensor: the 5th fails
    with pytest.raises(OSError, match="Input/output"):
        conv.convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"torch:{tmp_path}/m.safetensors"),
                     log=lambda m: None)
    assert len(calls) >= 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no temporary


def test_conversion_fsyncs_each_file_once(tmp_path, monkeypatch):
    from jaxmoe.port.commands import convert as conv

    _write_hf(_cfg(4), tmp_path / "hf")
    synced = []
    real = os.fsync

    def count(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(conv.os, "fsync", count)
    r = conv.convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"hf:{tmp_path}/out"), log=lambda m: None,
                     shard_size=1_000_000)
    files = sorted(str(f) for f in (tmp_path / "out").iterdir())
    assert r["tensors"] > len(files) > 3
    # every file once (under the temporary's name), its folder, and the destination's parent
    assert len(synced) == len(files) + 2, synced
    assert sorted(Path(s).name for s in synced[:-2]) == sorted(Path(f).name for f in files)
    assert synced[-1] == str(tmp_path)


def _flat(ep_text: str, **options) -> dict:
    from jaxmoe.port.formats import bind_options, open_source

    src_ep, _ = bind_options(options, source=_ep(ep_text))
    with open_source(src_ep) as src:
        return {k: src.read_leaf(k) for k in src.keys()}


def _spy_spills(monkeypatch) -> list:
    from jaxmoe.port.formats.orbax import OrbaxSink

    spilled, real = [], OrbaxSink._spill

    def spy(self, key, arr):
        spilled.append(key)
        return real(self, key, arr)

    monkeypatch.setattr(OrbaxSink, "_spill", spy)
    return spilled


def test_routes_into_orbax_stream_from_views_bit_exact(tmp_path, monkeypatch):
    """hf -> orbax -> hf, dcp -> orbax and orbax -> orbax: every leaf reads back bit-exactly
    (load_model and the partial reader), and none is copied to scratch files: an hf: global
    leaf is handed out as a map of its tensor (the embedding, and lm_head transposed), also when
    the leaf is cast (to bfloat16 here: read and cast as the leaf is written). The Zarr chunks of
    a leaf over STREAM_CHUNK_BYTES are filled from transposed per-expert views of the source."""
    from jaxmoe.checkpoint import checkpointer as checkpoint
    from jaxmoe.checkpoint.orbax_read import LeafSlices, open_array
    from jaxmoe.config import config_to_toml
    from jaxmoe.port.commands.convert import convert

    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 32 * 1024)  # experts: [1, 2, 64, 64]
    cfg = _cfg(4)
    cfg = config_from_dict({"model": {"d_model": 64, "head_dim": 16}, "moe": {"expert_ffn_dim": 64}},
                           cfg)
    _write_hf(cfg, tmp_path / "hf")
    want = _flat(f"hf:{tmp_path}/hf")
    spilled = _spy_spills(monkeypatch)
    quiet = {"log": lambda m: None}
    convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"orbax:{tmp_path}/run"), **quiet)
    assert spilled == [], spilled
    convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"orbax:{tmp_path}/bf16"), dtype="bfloat16", **quiet)
    assert spilled == [], spilled
    _, cast, _, _ = checkpoint.load_model(tmp_path / "bf16")
    for k in ("embed", "lm_head", "moe/experts/gate_proj"):
        got = np.asarray(hf_map.flatten(dict(cast))[k])
        assert got.dtype == ml_dtypes.bfloat16, k
        cast_want = want["params/" + k].astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.view(np.uint16), cast_want.view(np.uint16))
    spilled.clear()
    convert(_ep(f"orbax:{tmp_path}/run"), _ep(f"hf:{tmp_path}/back"), **quiet)
    _same_tensors(tmp_path / "hf", tmp_path / "back")

    torch_ok = __import__("importlib").util.find_spec("torch") is not None
    routes = [("orbax", f"orbax:{tmp_path}/run", {})]
    if torch_ok:
        (tmp_path / "m.toml").write_text(config_to_toml(cfg))
        convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"dcp:{tmp_path}/dcp"), **quiet)
        routes.append(("dcp", f"dcp:{tmp_path}/dcp", {"titan": str(tmp_path / "m.toml")}))
    for name, src, opts in routes:
        spilled.clear()
        convert(_ep(src), _ep(f"orbax:{tmp_path}/from-{name}"), **quiet, **opts)
        assert spilled == [], (name, spilled)  # every leaf a view: nothing copied to scratch
    from jaxmoe.checkpoint.checkpointer import load_model

    state = tmp_path / "run" / "checkpoints" / "0" / "state"
    expert = LeafSlices(open_array(state, "params/moe/experts/gate_proj"))
    assert expert.chunk == (1, 2, 64, 64)  # the slab chunks, filled from [64, 64] expert views
    for run in ["run"] + [f"from-{n}" for n, _, _ in routes]:
        _, params, buffers, _ = load_model(tmp_path / run)
        got = {"params/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(params)).items()}
        got.update({"buffers/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(buffers)).items()})
        assert sorted(got) == sorted(want), run
        for k, v in want.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k].view(np.uint8),
                                                              v.view(np.uint8)), (run, k)


def test_view_filler_fills_chunks_from_transposed_views():
    """Hand-made: a [2, 3, 4, 5] leaf whose view hands out per-(layer, expert) slices as
    transposed views ([4, 5] of [5, 4] memory), cut into [1, 2, 4, 5] and [1, 1, 2, 5] chunks;
    and a global leaf (depth 0) read once."""
    from jaxmoe.checkpoint.checkpointer import StreamLeaf
    from jaxmoe.port.formats.orbax import ViewFiller

    full = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    stored = np.ascontiguousarray(np.swapaxes(full, -1, -2))  # what a source holds: [2, 3, 5, 4]

    class View:  # an hf:/dcp:-like view: integer indices over the leading axes
        shape, dtype = full.shape, full.dtype

        def __getitem__(self, index):
            return np.swapaxes(stored[index], -1, -2)

    f = ViewFiller(View(), 2)
    leaf = StreamLeaf(full.shape, np.float32, f, f.release)
    chunk = leaf[0:1, 1:3, 0:4, 0:5]
    assert chunk.flags.c_contiguous and chunk.shape == (1, 2, 4, 5)
    assert chunk[0, 1, 2, 3] == 2 * 20 + 2 * 5 + 3  # full[0, 2, 2, 3] = 53
    np.testing.assert_array_equal(chunk, full[0:1, 1:3])
    np.testing.assert_array_equal(leaf[1:2, 2:3, 2:4, 0:5], full[1:2, 2:3, 2:4])
    assert f.calls == 3  # one view read per (layer, expert) in the boxes
    leaf.release()
    assert f.view is None  # the view (and the block it keeps) is dropped once written
    whole = ViewFiller(View(), 0)
    whole.view = type("W", (), {"__getitem__": lambda s, i: full[i]})()
    g = StreamLeaf(full.shape, np.float32, whole, whole.release)
    np.testing.assert_array_equal(g[0:2, 0:1, 0:4, 0:5], full[:, 0:1])
    np.testing.assert_array_equal(g[0:2, 1:3, 0:4, 0:5], full[:, 1:3])
    assert whole.calls == 1


def test_hf_leaf_view_reads_expert_groups_ahead_and_maps_global_leaves(tmp_path, monkeypatch):
    """An hf: source's per-expert tensors come in groups read around the page cache, the next
    group (or the next layer's first) read ahead (Source.read_ahead): every expert slice equals
    the leaf read whole, in order and reversed, and the file stays uncached. A global leaf in the
    asked dtype is a map of its tensor (nothing read until used), transposed like the leaf."""
    from support import resident

    from jaxmoe.port.formats import open_source
    from jaxmoe.storage import direct_io

    cfg = _cfg(4, n_layers=3)
    _write_hf(cfg, tmp_path / "hf")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    monkeypatch.setattr(direct_io, "BLOCK", 3 * 4 * cfg.model.d_model * cfg.moe.expert_ffn_dim)  # 3 experts
    monkeypatch.delenv("JAXMOE_KEEP_PAGE_CACHE", raising=False)
    with open_source(_ep(f"hf:{tmp_path}/hf")) as src:
        _uncache(files)
        expert = [k for k in src.keys() if "/experts/" in k]
        assert len(expert) == 3
        for key in expert:
            view = src.leaf_view(key)
            assert view._experts is not None  # the group path
            whole = src.read_leaf(key)
            layers, experts = whole.shape[:2]
            order = [(l, e) for l in range(layers) for e in range(experts)]
            _uncache(files)
            for index in order + order[::-1]:
                np.testing.assert_array_equal(view[index], whole[index])
            direct = page_cache.bounded() and all(direct_io._open_direct(f) is not None for f in files)
            if direct:
                assert sum(resident(f) for f in files) == 0, key
            for index in [(1, 2, 5), (0, 3), (0,), (0, 3), (1, 1), (1,), (1, 1)]:  # layers and experts mixed
                np.testing.assert_array_equal(view[index], whole[index])
        assert src._ahead is not None
        for key in ("params/embed", "params/lm_head"):
            want = src.read_leaf(key)
            got = src.leaf_view(key)[()]
            assert page_cache.file_mapping(got) is not None, key  # a map, not a copy
            np.testing.assert_array_equal(got, want)
            del got  # a mapped page stays cached while mapped
            _uncache(files)
            cast = src.leaf_view(key, np.dtype("float16"))[()]  # a cast: read directly, then cast
            assert cast.dtype == np.float16 and page_cache.file_mapping(cast) is None
            np.testing.assert_array_equal(cast, want.astype(np.float16))
            if direct:
                assert sum(resident(f) for f in files) == 0, key
        view = src.leaf_view(expert[0], np.dtype("float16"))  # experts cast one at a time
        whole = src.read_leaf(expert[0], np.dtype("float16"))
        for index in [(0, 0), (0, 1), (0, 0), (1, 3), (1, 3, 2)]:
            got = view[index]
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, whole[index])


def _expert_views_match(src, files, keys) -> None:
    """Every (layer, expert) slice of each leaf's view equals the leaf read whole, in order and
    reversed, the files uncached by those reads (where O_DIRECT works), then layer and expert
    indices mixed on one view."""
    from support import resident

    from jaxmoe.storage import direct_io

    for key in keys:
        view = src.leaf_view(key)
        assert view._experts is not None, key  # the group path
        whole = src.read_leaf(key)
        order = [(l, e) for l in range(whole.shape[0]) for e in range(whole.shape[1])]
        _uncache(files)
        for index in order + order[::-1]:
            np.testing.assert_array_equal(view[index], whole[index])
        if page_cache.bounded() and all(direct_io._open_direct(f) is not None for f in files):
            assert sum(resident(f) for f in files) == 0, key
        for index in [(1, 3), (1,), (1, 3), (0, 2, 1)]:
            np.testing.assert_array_equal(view[index], whole[index])


def test_hf_leaf_view_reads_fused_and_fp8_experts_a_group_at_a_time(tmp_path, monkeypatch):
    """The fused HF expert layout (each expert's slice of a layer's gate_up_proj / down_proj)
    and DeepSeek-style FP8 expert tensors (dequantised one expert at a time) come through the
    same expert groups as per-expert tensors: no stacked leaf read whole."""
    from jaxmoe.port.commands.convert import convert
    from jaxmoe.port.formats import open_source
    from jaxmoe.port.io.safetensors_io import SafetensorsReader
    from jaxmoe.storage import direct_io

    cfg = _cfg(4, n_layers=3)
    _write_hf(cfg, tmp_path / "hf")
    monkeypatch.setattr(direct_io, "BLOCK", 3 * 4 * cfg.model.d_model * cfg.moe.expert_ffn_dim)  # 3 experts
    monkeypatch.delenv("JAXMOE_KEEP_PAGE_CACHE", raising=False)
    convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"hf:{tmp_path}/fused"), log=lambda m: None, hf_layout="fused")
    with open_source(_ep(f"hf:{tmp_path}/fused")) as src:
        assert set(src.layouts.values()) == {"fused"}
        keys = [k for k in src.keys() if "/experts/" in k]
        _expert_views_match(src, sorted((tmp_path / "fused").glob("*.safetensors")), keys)

    r = SafetensorsReader(tmp_path / "hf")
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    tensors = {}
    for name in r.names():
        t = r.get(name)
        if "experts" in name and "gate_proj" in name:  # [I, H] = [1024, 256]: 8 x 2 blocks
            scale = np.random.default_rng(len(tensors)).uniform(0.5, 2.0, (8, 2)).astype(np.float32) / 64
            full = np.repeat(np.repeat(scale, 128, 0), 128, 1)
            tensors[name + "_scale_inv"] = scale
            t = (t / full).astype(fp8)
        tensors[name] = t
    plan = [(n, t.shape, t.dtype) for n, t in tensors.items()]
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    w = SafetensorsWriter(tmp_path / "fp8", plan)
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    with open_source(_ep(f"hf:{tmp_path}/fp8")) as src:
        key = "params/moe/experts/gate_proj"
        assert src.leaf_dtype(key) == np.float32
        _expert_views_match(src, sorted((tmp_path / "fp8").glob("*.safetensors")), [key])
        view, name = src.leaf_view(key), "model.layers.1.mlp.experts.2.gate_proj.weight"
        want = tensors[name].astype(np.float32) * np.repeat(np.repeat(tensors[name + "_scale_inv"], 128, 0), 128, 1)
        np.testing.assert_array_equal(view[(1, 2)], want.T)  # dequantised by hand, transposed
