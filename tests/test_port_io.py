"""Checkpoint I/O below the conversion: safetensors files (single, sharded, FP8) and the
streaming Orbax save that ``jaxmoe convert --to orbax:`` uses."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxmoe.errors import UserError
from jaxmoe.port.io.safetensors_io import (
    INDEX_FILE,
    SafetensorsReader,
    SafetensorsWriter,
    dequantize_fp8,
    parse_size,
    write_tensors,
)
from jaxmoe.port.maps import hf_map

torch = pytest.importorskip("torch")


def _flat_leaves(params, buffers) -> dict:
    out = {"params/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(params)).items()}
    out.update({"buffers/" + k: np.asarray(v) for k, v in hf_map.flatten(dict(buffers)).items()})
    return out


# --------------------------------------------------------------------------------------------
# safetensors I/O
# --------------------------------------------------------------------------------------------


def test_safetensors_files_are_readable_by_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
               "c": np.arange(6, dtype=np.int64).reshape(2, 3)}
    write_tensors(tmp_path / "x.safetensors", tensors, metadata={"k": "v"}, single_file=True)
    back = load_file(tmp_path / "x.safetensors")
    assert back["b"].dtype == torch.bfloat16
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k].float().numpy(), v.astype(np.float32))
    r = SafetensorsReader(tmp_path / "x.safetensors")
    assert r.metadata["k"] == "v" and r.get("b").dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(r.get("b").view(np.uint16), tensors["b"].view(np.uint16))


def test_sharded_write_and_read(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal((10, 10 + i)).astype(np.float32) for i in range(9)}
    # sizes 400, 440, ..., 720 bytes; greedy 1000-byte shards: [400+440] [480+520] [560] ... [720]
    w = write_tensors(tmp_path / "out", tensors, shard_size=parse_size("1KB"))
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(w.files) == 7 and files[0] == "model-00001-of-00007.safetensors"
    assert index["weight_map"]["t2"] == index["weight_map"]["t3"] == "model-00002-of-00007.safetensors"
    for f in files:
        size = sum(v.nbytes for k, v in tensors.items() if index["weight_map"][k] == f)
        assert size <= 1000
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    r = SafetensorsReader(tmp_path / "out")
    for k, v in tensors.items():
        assert np.array_equal(r.get(k), v)
    # one shard when the limit is large
    write_tensors(tmp_path / "one", tensors, shard_size=parse_size("5GB"))
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000 and parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    with pytest.raises(UserError):
        parse_size("lots")


def test_fp8_dequant_matches_numpy(tmp_path):
    """A block-quantised tensor written by torch (float8_e4m3fn + float32 scale_inv) ->
    our reader + dequantiser == an element-by-element numpy reference."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    out_dim, in_dim = 200, 300  # partial last blocks on both axes
    w = torch.randn(out_dim, in_dim, generator=g)
    scale = torch.rand(2, 3, generator=g) + 0.5
    full = scale.repeat_interleave(128, 0)[:out_dim].repeat_interleave(128, 1)[:, :in_dim]
    q = (w / full).to(torch.float8_e4m3fn)
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, str(tmp_path / "f.safetensors"))
    r = SafetensorsReader(tmp_path / "f.safetensors")
    assert r.dtype("w.weight") == np.dtype(ml_dtypes.float8_e4m3fn)
    got = dequantize_fp8(r.get("w.weight"), r.get("w.weight_scale_inv"))
    qf = q.float().numpy()
    s = scale.numpy()
    ref = np.empty((out_dim, in_dim), np.float32)
    for i in range(out_dim):
        for j in range(0, in_dim):
            ref[i, j] = qf[i, j] * s[i // 128, j // 128]
    np.testing.assert_array_equal(got, ref)
    # and the quantisation round trip is close to the original
    assert np.abs(got - w.numpy()).max() < 0.1 * np.abs(w.numpy()).max()


# --------------------------------------------------------------------------------------------
# streaming Orbax save (what `convert --to orbax:` uses)
# --------------------------------------------------------------------------------------------


def _memmap_copy(path: Path, arr: np.ndarray) -> np.ndarray:
    """``arr`` written to a raw file and re-opened read-only as an ``np.memmap``."""
    m = np.memmap(path, dtype=arr.dtype, mode="w+", shape=arr.shape)
    m[...] = arr
    m.flush()
    del m
    return np.memmap(path, dtype=arr.dtype, mode="r", shape=arr.shape)


def test_streaming_save_is_bit_exact_chunked_and_one_leaf_at_a_time(tmp_path, monkeypatch):
    """memmap leaves (odd shapes, bf16) -> stream_numpy save -> both readers
    (Checkpointer.restore onto a target, restore_subtree as load_model uses) give them back
    bit-exactly; leaves are written one after another, big ones in several chunks."""
    from jaxmoe.checkpoint import checkpointer as checkpoint

    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 4096)
    rng = np.random.default_rng(0)
    leaves = {
        "big": rng.standard_normal((3, 10, 40, 9)).astype(np.float32),  # chunks [1, 2, 40, 9]
        "wide": rng.standard_normal((2, 3000)).astype(np.float32),  # [1, 1024], clipped edges
        "bf16": rng.standard_normal((5, 700)).astype(ml_dtypes.bfloat16),  # chunks [2, 700]
        "small": np.arange(6, dtype=np.float32),
    }
    mapped = {k: _memmap_copy(tmp_path / f"{k}.bin", v) for k, v in leaves.items()}
    state = {"params": mapped, "buffers": {"b": np.ones(3, np.float32)}}
    ck = checkpoint.Checkpointer(tmp_path / "ck", keep=0, async_save=False, stream_numpy=True)
    ck.save(0, state, {"kind": "model"})
    trace = ck.stream_handler.trace
    ck.close()
    # one write at a time: start/end strictly alternate, one pair per numpy leaf
    assert [e for e, _ in trace] == ["start", "end"] * 5
    chunks = sorted(n for e, n in trace if e == "end")
    assert chunks == [1, 1, 3, 6, 15]  # small, b; bf16 [2, 700]; wide; big

    want = {"params": leaves, "buffers": {"b": np.ones(3, np.float32)}}
    ck = checkpoint.Checkpointer(tmp_path / "ck", async_save=False)
    try:
        got, meta = ck.restore(want)
        sub, _ = ck.restore_subtree(("params", "buffers"))
    finally:
        ck.close()
    assert meta["kind"] == "model"
    for tree in (got, sub):
        flat_w, flat_g = _flat_leaves(want["params"], want["buffers"]), _flat_leaves(
            tree["params"], tree["buffers"])
        assert sorted(flat_w) == sorted(flat_g)
        for k in flat_w:
            assert flat_w[k].dtype == flat_g[k].dtype and flat_w[k].shape == flat_g[k].shape, k
            assert np.array_equal(flat_w[k].view(np.uint8), flat_g[k].view(np.uint8)), k


def _status_bytes(field: str) -> int:
    return [int(x.split()[1]) * 1024 for x in open("/proc/self/status")
            if x.startswith(field + ":")][0]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_streaming_save_holds_chunks_not_leaves(tmp_path, monkeypatch):
    """Peak RSS of a streaming save of a 64 MiB memmap leaf grows by far less than the leaf.

    Any of: copying the leaf (Orbax's default deep copy), keeping its mapped pages, strided
    chunks (the kernel maps whole folios), or OCDBT buffering encoded chunks until a 2 GiB data
    file is full, adds >= ~60 MB here.
    """
    from jaxmoe.checkpoint import checkpointer as checkpoint

    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 2**20)
    leaf = np.memmap(tmp_path / "leaf.bin", np.float32, "w+", shape=(16, 1024, 1024))
    rng = np.random.default_rng(0)
    for i in range(16):  # incompressible data, 4 MiB at a time
        leaf[i] = rng.standard_normal((1024, 1024), dtype=np.float32)
    leaf.flush()
    del leaf
    leaf = np.memmap(tmp_path / "leaf.bin", np.float32, "r", shape=(16, 1024, 1024))

    def save(name, params):
        ck = checkpoint.Checkpointer(tmp_path / name, keep=0, async_save=False, stream_numpy=True)
        try:
            ck.save(0, {"params": params, "buffers": {}}, {})
        finally:
            ck.close()

    save("warm", {"w": np.ones((4, 4), np.float32)})  # imports, thread pools
    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    save("big", {"w": leaf})
    grew = _status_bytes("VmHWM") - base
    assert grew < 24 * 2**20, f"peak RSS grew by {grew / 2**20:.0f} MiB for a 64 MiB leaf"
    # the same leaf as a StreamLeaf read from the file chunk by chunk (what convert's views do)
    src = np.memmap(tmp_path / "leaf.bin", np.float32, "r", shape=(16, 1024, 1024))

    def fill(box, out):
        out[...] = src[box]
        checkpoint.release_pages(src)

    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    save("lazy", {"w": checkpoint.StreamLeaf(src.shape, src.dtype, fill)})
    grew = _status_bytes("VmHWM") - base
    assert grew < 24 * 2**20, f"peak RSS grew by {grew / 2**20:.0f} MiB for a 64 MiB StreamLeaf"


def test_stream_leaf_saves_the_same_checkpoint_as_an_array(tmp_path, monkeypatch):
    """A StreamLeaf (filled chunk by chunk at save time, never whole) and the same values as
    numpy leaves give the same tree metadata, Zarr metadata (chunks, no compressor) and bytes;
    its chunks are asked for in order, each once, then it is released."""
    import json

    from jaxmoe.checkpoint import checkpointer as checkpoint
    from jaxmoe.checkpoint.orbax_read import open_array

    monkeypatch.setattr(checkpoint, "STREAM_CHUNK_BYTES", 4096)
    rng = np.random.default_rng(2)
    vals = {"big": rng.standard_normal((3, 10, 40, 9)).astype(np.float32),  # 15 chunks
            "bf16": rng.standard_normal((5, 700)).astype(ml_dtypes.bfloat16)}  # 3, last clipped
    boxes, released = [], []

    def lazy(k):
        def fill(box, out):
            boxes.append((k, box))
            out[...] = vals[k][box]
        return checkpoint.StreamLeaf(vals[k].shape, vals[k].dtype, fill, lambda: released.append(k))

    for name, params in (("arr", dict(vals)), ("lazy", {k: lazy(k) for k in vals})):
        ck = checkpoint.Checkpointer(tmp_path / name, keep=0, async_save=False, stream_numpy=True)
        try:
            ck.save(0, {"params": params, "buffers": {}}, {})
        finally:
            ck.close()
    assert released == ["bf16", "big"] and len(boxes) == 18
    assert [b for k, b in boxes if k == "bf16"] == [(slice(0, 2), slice(0, 700)), (slice(2, 4), slice(0, 700)),
                                                   (slice(4, 5), slice(0, 700))]
    a, b = (tmp_path / n / "0" / "state" for n in ("arr", "lazy"))
    assert json.loads((a / "_METADATA").read_text()) == json.loads((b / "_METADATA").read_text())
    for k, v in vals.items():
        ta, tb = open_array(a, "params/" + k), open_array(b, "params/" + k)
        assert ta.spec().to_json()["metadata"] == tb.spec().to_json()["metadata"]
        got = np.asarray(tb.read().result())
        assert got.dtype == v.dtype and np.array_equal(got.view(np.uint8), v.view(np.uint8)), k


def test_byte_copies_of_consecutive_leaves_run_in_destination_order(tmp_path, monkeypatch):
    """hf -> torch copies every leaf's bytes in one pass over the destination (one batch, sorted
    by place: an HF file interleaves gate / up / down per expert, so leaf by leaf was a strided
    pass per leaf), neighbouring tensors joined into copies of at most COPY_BLOCK, and the
    result is the source's bytes; a dcp: sink, which places each leaf at its current end, still
    gets its copies leaf by leaf."""
    from jaxmoe.config import config_from_dict, load_config
    from jaxmoe.config.hf import to_hf_config
    from jaxmoe.port.commands import convert as convert_mod
    from jaxmoe.port.formats import parse_endpoint as _ep
    from jaxmoe.storage.file_copy import COPY_BLOCK

    cfg = config_from_dict({"model": {"n_layers": 3}, "moe": {"n_experts": 4}}, load_config("tiny"))
    table = hf_map.entries(cfg)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    w = SafetensorsWriter(tmp_path / "hf", [(e.hf_name, e.hf_shape, np.float32) for e in table])
    rng = np.random.default_rng(0)
    for e in table:
        w.write(e.hf_name, rng.standard_normal(e.hf_shape, dtype=np.float32))
    w.close()
    batches = []
    real = convert_mod._copy_raw

    def spy(pool, pairs, *args):
        batches.append([(str(b.file), b.offset, b.nbytes) for _, b in pairs])
        return real(pool, pairs, *args)

    monkeypatch.setattr(convert_mod, "_copy_raw", spy)
    convert_mod.convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"torch:{tmp_path}/m.safetensors"), log=lambda m: None)
    copies = [b for b in batches if b]
    assert len(copies) == 1 and copies[0] == sorted(copies[0])
    src, out = SafetensorsReader(tmp_path / "hf"), SafetensorsReader(tmp_path / "m.safetensors")
    assert sorted(src.names()) == sorted(out.names())
    assert sum(n for _, _, n in copies[0]) == sum(out.infos[name].nbytes for name in out.names())
    assert all(n <= COPY_BLOCK for _, _, n in copies[0]) and len(copies[0]) < len(out.names()) // 2
    assert all(o + n <= o2 for (_, o, n), (_, o2, _) in zip(copies[0], copies[0][1:]))
    for name in src.names():
        np.testing.assert_array_equal(out.get(name), src.get(name))

    batches.clear()
    convert_mod.convert(_ep(f"hf:{tmp_path}/hf"), _ep(f"dcp:{tmp_path}/step-1"), log=lambda m: None)
    copies = [b for b in batches if b]
    assert len(copies) > 3  # one batch per byte-copied leaf
