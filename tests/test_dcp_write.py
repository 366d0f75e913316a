"""Writing ``dcp:`` without ``torch.save``: the zip :class:`jaxmoe.port.io.torch_save.TensorZip`
lays out is torch's byte for byte, and ``convert.raw_copies`` pairs byte ranges of two namings by
their place in the leaf (hf per-expert tensors <-> torchtitan stacked ones) or refuses."""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxmoe.port.commands.convert import raw_copies
from jaxmoe.port.formats.base import RawTensor
from jaxmoe.port.io.torch_save import TensorZip, crc32_combine, tensor_pickle
from jaxmoe.storage.file_copy import crc32_of
from jaxmoe.storage.page_cache import pwrite_all

DATA = Path(__file__).parent / "data"


def _zip_bytes(a: np.ndarray, serial: bytes | None = None) -> bytes:
    z = TensorZip(a.dtype, a.shape)
    raw = a.reshape(-1).view(np.uint8).tobytes() if a.size else b""
    out = z.head + raw + z.tail(zlib.crc32(raw), serial=serial)
    assert len(out) == z.length and len(z.head) == z.data_offset and z.data_offset % 64 == 0
    return out


CASES = [((3, 4), np.float32), ((), np.float32), ((5,), ml_dtypes.bfloat16), ((2, 3, 4, 5), np.float32),
         ((300, 700), np.float32), ((0, 4), np.float32), ((1, 1, 7), np.int64), ((4, 64, 32), ml_dtypes.bfloat16),
         ((70000,), np.float16)]


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{s}-{np.dtype(d).name}" for s, d in CASES])
def test_tensor_zip_is_torch_save_byte_for_byte(shape, dtype):
    torch = pytest.importorskip("torch")
    a = (np.arange(int(np.prod(shape))) % 251).astype(np.float32).astype(dtype).reshape(shape)
    bf16 = a.dtype == ml_dtypes.bfloat16
    t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(a)
    buf = io.BytesIO()
    torch.save(t, buf)
    ref = buf.getvalue()
    serial = zipfile.ZipFile(io.BytesIO(ref)).read("archive/.data/serialization_id")
    mine = _zip_bytes(a, serial)
    assert mine == ref
    back = torch.load(io.BytesIO(_zip_bytes(a)), weights_only=True)  # a fresh random id loads too
    assert tuple(back.shape) == shape and back.dtype == t.dtype and torch.equal(back, t)
    assert zipfile.ZipFile(io.BytesIO(mine)).testzip() is None  # every CRC-32 right


def test_tensor_zip_zip64_matches_torch():
    """A >= 4 GiB storage (zip64 extra fields, 24-byte descriptors, offsets past 4 GiB): head and
    tail against what torch.save wrote for one (recorded in tests/data: 4 GiB is too big to make here)."""
    rec = json.loads((DATA / "torch_save_zip64.json").read_text())
    z = TensorZip(np.uint8, (rec["numel"],))
    assert z.length == rec["file_size"]
    assert z.head == bytes.fromhex(rec["head_hex"])
    tail = bytes.fromhex(rec["tail_hex"])
    crc = int.from_bytes(tail[4:8], "little")
    serial = tail[tail.rfind(b"ZZ") + 2:][:40]
    assert z.tail(crc, serial=serial) == tail


def test_tensor_pickle_reads_back_with_the_safe_reader():
    from jaxmoe.port.io.dcp_io import TensorRef, safe_loads

    ref = safe_loads(tensor_pickle(ml_dtypes.bfloat16, (3, 70000, 2)), "test")
    assert isinstance(ref, TensorRef) and ref.size == (3, 70000, 2) and ref.stride == (140000, 2, 1)
    assert str(ref.storage[1]) == "bfloat16" and ref.storage[4] == 3 * 70000 * 2


def test_pwrite_all_and_crc32_of(tmp_path):
    import os

    data = np.random.default_rng(0).integers(0, 255, 3_000_000, dtype=np.uint8)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        pwrite_all(fd, data, 100)
        assert crc32_of(fd, 100, data.size, block=1 << 20) == zlib.crc32(data)
    finally:
        os.close(fd)


def test_crc32_combine_matches_zlib():
    rng = np.random.default_rng(5)
    for n1, n2 in [(0, 0), (0, 9), (9, 0), (1, 1), (1000, 3), (5, 70_000), (123_457, 65_536)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b), (n1, n2)


def test_hf_to_dcp_crcs_come_from_the_copies(tmp_path, monkeypatch):
    """hf -> dcp copies every expert's bytes in the kernel and checksums each copy while it is
    cached: no tensor is read back (crc32_of would fail here), and every zip's CRC-32 is right."""
    from jaxmoe.config import load_config
    from jaxmoe.port.commands.convert import convert
    from jaxmoe.port.formats import dcp as dcp_format
    from jaxmoe.port.formats import parse_endpoint
    from jaxmoe.port.io.dcp_io import DcpDir, Window
    from jaxmoe.port.io.safetensors_io import SafetensorsWriter
    from jaxmoe.port.maps import hf_map

    cfg = load_config("tiny")
    table = hf_map.entries(cfg)
    hf = tmp_path / "hf"
    hf.mkdir()
    from jaxmoe.config.hf import to_hf_config

    (hf / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    w = SafetensorsWriter(hf, [(e.hf_name, e.hf_shape, np.float32) for e in table])
    rng = np.random.default_rng(6)
    for e in table:
        w.write(e.hf_name, rng.standard_normal(e.hf_shape, dtype=np.float32))
    w.close()

    def no_read_back(*a, **k):
        raise AssertionError("a tensor's CRC-32 was read back instead of taken from its copies")

    monkeypatch.setattr(dcp_format, "crc32_of", no_read_back)
    r = convert(parse_endpoint(f"hf:{hf}"), parse_endpoint(f"dcp:{tmp_path}/dcp"), log=lambda m: None)
    assert r["bytes_copied"] == r["bytes"] > 0, r  # every tensor copied, none written from memory
    d = DcpDir(tmp_path / "dcp", "dcp")
    checked = 0
    for fqn in d.tensors:
        for ch in d.chunks(fqn):
            with open(ch.file, "rb") as fh:
                assert zipfile.ZipFile(Window(fh, ch.offset, ch.length)).testzip() is None, fqn
            checked += 1
    assert checked == len(d.tensors) > 0


def test_dcp_leaf_view_reads_expert_blocks_ahead(tmp_path, monkeypatch):
    """A dcp: source's expert rows come from blocks read around the page cache, the next block
    read ahead (direct_io.ReadAhead): every slice equals the leaf read whole, in order or not."""
    from jaxmoe.config import load_config
    from jaxmoe.port.formats import dcp as dcp_format
    from jaxmoe.port.formats import parse_endpoint
    from jaxmoe.port.maps import titan_map
    from jaxmoe.storage import direct_io

    cfg = load_config("tiny")
    sink = dcp_format.DcpSink(tmp_path / "dcp", cfg)
    rng = np.random.default_rng(8)
    for key, shape in titan_map.leaf_shapes(cfg).items():
        sink.write_leaf(key, rng.standard_normal(shape).astype(np.float32))
    sink.finish()
    monkeypatch.setattr(direct_io, "BLOCK", 3 * 4 * int(np.prod(cfg.model.d_model * cfg.moe.expert_ffn_dim)))
    ep = parse_endpoint(f"dcp:{tmp_path}/dcp").with_options(titan="tiny")
    src = dcp_format.DcpSource(ep)
    try:
        expert = [k for k in src.keys() if "experts" in k]
        assert expert
        for key in expert:
            whole = src.read_leaf(key)
            view = src.leaf_view(key)
            layers, experts = whole.shape[:2]
            order = [(l, e) for l in range(layers) for e in range(experts)]
            for index in order + order[::-1]:
                got = view[index]
                np.testing.assert_array_equal(got, whole[index])
        assert src._ahead is not None  # the block path was taken
    finally:
        src.close()


def _rt(name, off, shape, index, transpose=True, dtype=np.float32):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return RawTensor(Path(name), off, n, np.dtype(dtype), tuple(shape), index, transpose)


def test_raw_copies_hf_experts_into_a_titan_layer_and_back():
    E, F, D = 3, 4, 2
    hf = {f"l1.e{e}": _rt("hf", 1000 * e, (F, D), (1, e)) for e in range(E)}
    titan = {"layers.1.w1": _rt("dcp", 64, (E, F, D), (1,))}
    pairs = raw_copies(hf, titan)
    got = sorted((a.file.name, a.offset, b.file.name, b.offset, a.nbytes) for a, b in pairs)
    assert got == [("hf", 1000 * e, "dcp", 64 + e * F * D * 4, F * D * 4) for e in range(E)]
    back = raw_copies(titan, hf)  # the converse: rows of the titan tensor into the hf files
    assert sorted((a.offset, b.offset) for a, b in back) == [(64 + e * F * D * 4, 1000 * e) for e in range(E)]


@pytest.mark.parametrize("why", ["transpose", "dtype", "missing_expert", "shape", "no_index", "extra_row"])
def test_raw_copies_refuses_what_is_not_the_same_bytes(why):
    E, F, D = 2, 4, 2
    hf = {f"e{e}": _rt("hf", 100 * e, (F, D), (0, e)) for e in range(E)}
    titan = {"w1": _rt("dcp", 0, (E, F, D), (0,))}
    if why == "transpose":
        hf["e1"] = _rt("hf", 100, (F, D), (0, 1), transpose=False)
    elif why == "dtype":
        titan = {"w1": _rt("dcp", 0, (E, F, D), (0,), dtype=ml_dtypes.bfloat16)}
    elif why == "missing_expert":
        del hf["e1"]
    elif why == "shape":
        hf["e1"] = _rt("hf", 100, (D, F), (0, 1))
    elif why == "no_index":
        hf["e1"] = RawTensor(Path("hf"), 100, F * D * 4, np.dtype(np.float32), (F, D))
    elif why == "extra_row":
        hf["e2"] = _rt("hf", 200, (F, D), (0, 2))
    assert raw_copies(hf, titan) is None


def test_raw_copies_same_names_pairs_by_name():
    a = {"x": _rt("a", 0, (2, 2), None), "y": _rt("a", 16, (3,), None)}
    b = {"x": _rt("b", 8, (2, 2), None), "y": _rt("b", 0, (3,), None)}
    assert [(p.offset, q.offset) for p, q in raw_copies(a, b, same_names=True)] == [(0, 8), (16, 0)]
    b["y"] = _rt("b", 0, (4,), None)
    assert raw_copies(a, b, same_names=True) is None


def test_metadata_pickle_equals_torchs_own():
    """.metadata written without torch unpickles (with torch) to the Metadata torch's classes build,
    and the safe reader reads it."""
    pickle = pytest.importorskip("pickle")
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as dm

    from jaxmoe.port.io.dcp_io import safe_loads
    from jaxmoe.port.io.dcp_meta import metadata_bytes

    z = torch.Size([0, 0])
    shapes = {"a.w": ((2, 3), torch.bfloat16, "bfloat16", 0, 100), "b": ((), torch.float32, "float32", 100, 50)}
    sdm, st = {}, {}
    for n, (shape, dt, _, at, ln) in shapes.items():
        zeros = torch.Size([0] * len(shape))
        sdm[n] = dm.TensorStorageMetadata(properties=dm.TensorProperties(dtype=dt), size=torch.Size(shape),
                                          chunks=[dm.ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))])
        st[dm.MetadataIndex(n, zeros, 0)] = fs._StorageInfo("f.distcp", at, ln)
    sdm["lr_scheduler.last_epoch"] = dm.BytesStorageMetadata()
    st[dm.MetadataIndex("lr_scheduler.last_epoch")] = fs._StorageInfo("f.distcp", 150, 9)
    planner = {"a.w": ("a.w",), "b": ("b",), "lr_scheduler.last_epoch": ("lr_scheduler", "last_epoch")}
    ref = dm.Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=st, version=fs.CURRENT_DCP_VERSION)
    raw = metadata_bytes({n: (name, shape, at, ln) for n, (shape, _, name, at, ln) in shapes.items()},
                         {"lr_scheduler.last_epoch": (150, 9)}, planner, "f.distcp")
    assert pickle.loads(raw) == ref
    assert z == torch.Size([0, 0])
    md = safe_loads(raw, "test")
    assert md.kind == "Metadata" and set(md.state_dict_metadata) == set(planner)
