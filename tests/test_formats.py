"""The checkpoint-format table (jaxmoe.port.formats): its schemes, the one-line error for an
unknown one, and "a format is one module + one table row": a toy ``npz:`` format defined here
and registered in the table in-process converts through ``jaxmoe convert`` (its flag included)
with no change to convert, the CLI or anything else."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxmoe.cli import main
from jaxmoe.config import Config, config_from_dict, load_config, validate
from jaxmoe.errors import UserError
from jaxmoe.port import formats
from jaxmoe.port.commands.convert import convert
from jaxmoe.port.formats import FORMATS, parse_endpoint
from jaxmoe.port.formats.base import Endpoint, Format, Option, Sink, Source
from jaxmoe.port.maps import hf_map

# --------------------------------------------------------------------------------------------
# A toy format: DIR/config.json (the jaxmoe config) + DIR/leaves.npz (one array per leaf)
# --------------------------------------------------------------------------------------------


def _name(key: str) -> str:
    return key.replace("/", "__")


class NpzSource(Source):
    def __init__(self, ep: Endpoint):
        self.ep, self.notices = ep, []
        if not (ep.path / "config.json").is_file():
            raise UserError(f"{ep}: no config.json")
        self.cfg = validate(config_from_dict(json.loads((ep.path / "config.json").read_text())))
        with np.load(ep.path / "leaves.npz") as z:
            self.arrays = {k.replace("__", "/"): z[k] for k in z.files}
        self.shapes = {k: a.shape for k, a in self.arrays.items()}

    def leaf_dtype(self, key):
        return self.arrays[key].dtype

    def read_leaf(self, key, dtype=None, out=None):
        arr = self.arrays[key].astype(dtype or self.leaf_dtype(key))
        if out is None:
            return arr
        out[...] = arr
        return out

    def read_rows(self, key, n, dtype=None):
        return self.read_leaf(key, dtype)[:n]

    def content_files(self):
        return [self.ep.path / "config.json", self.ep.path / "leaves.npz"]


class NpzSink(Sink):
    def __init__(self, target: Path, cfg: Config, note: str | None):
        self.target, self.cfg, self.note, self.leaves = target, cfg, note, {}

    def write_leaf(self, key, arr):
        self.leaves[key] = np.array(arr)

    def finish(self):
        self.target.mkdir()
        (self.target / "config.json").write_text(self.cfg.to_json())
        np.savez(self.target / "leaves.npz", **{_name(k): a for k, a in self.leaves.items()})
        self.tensors = len(self.leaves)


class NpzFormat(Format):
    scheme = "npz"
    syntax = "npz:DIR"
    help = "a toy folder: config.json + leaves.npz"
    options = (Option("npz_note", "--npz-note", "sink", help="a note kept with the leaves",
                      report=True),)
    output_what = "an npz folder"

    @classmethod
    def open_source(cls, ep):
        return NpzSource(ep)

    @classmethod
    def open_sink(cls, ep, target, cfg, dtypes, log):
        return NpzSink(target, cfg, ep.options.get("npz_note"))

    @classmethod
    def is_output(cls, path):
        return (path / "leaves.npz").is_file()


@pytest.fixture
def npz_table(monkeypatch):
    monkeypatch.setitem(FORMATS, "npz", NpzFormat)


def _write_npz(d: Path, cfg: Config) -> dict:
    rng = np.random.default_rng(0)
    leaves = {k: rng.standard_normal(s).astype(np.float32)
              for k, s in hf_map.leaf_shapes(cfg).items()}
    d.mkdir()
    (d / "config.json").write_text(cfg.to_json())
    np.savez(d / "leaves.npz", **{_name(k): a for k, a in leaves.items()})
    return leaves


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_table_lists_the_schemes():
    assert list(FORMATS) == ["hf", "orbax", "torch", "dcp"]
    assert all(f.scheme == s for s, f in FORMATS.items())
    assert formats.endpoint_help() == "hf:DIR | orbax:RUN_DIR[@STEP] | torch:FILE.safetensors | dcp:STEP_DIR"
    assert {o.flag for o in formats.options()} == {"--shard-size", "--hf-layout", "--titan", "--with-optimizer"}


def test_unknown_scheme_is_one_line_naming_the_valid_ones(tmp_path, capsys):
    with pytest.raises(UserError) as e:
        parse_endpoint("gguf:model.gguf", "--from")
    msg = str(e.value)
    assert "\n" not in msg and "'gguf:model.gguf'" in msg
    assert all(f.syntax in msg for f in FORMATS.values()), msg
    rc = main(["convert", "--from", "gguf:x", "--to", f"hf:{tmp_path}/out"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "hf:DIR" in err[0] and "torch:" in err[0], err


def test_a_new_format_is_one_class_and_one_row(npz_table, tmp_path, capsys):
    cfg = load_config("tiny")
    leaves = _write_npz(tmp_path / "src", cfg)
    stats = convert(parse_endpoint(f"npz:{tmp_path}/src"),
                    parse_endpoint(f"torch:{tmp_path}/m.safetensors"))
    assert stats["tensors"] == len(hf_map.entries(cfg)) and stats["npz_note"] is None
    assert "npz:DIR" in formats.endpoint_help()

    rc = main(["convert", "--from", f"torch:{tmp_path}/m.safetensors", "--to",
               f"npz:{tmp_path}/back", "--npz-note", "hi", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    stats = json.loads(out)
    assert stats["dst"] == f"npz:{tmp_path}/back" and stats["npz_note"] == "hi"
    assert stats["hf_layout"] is None
    back = NpzSource(parse_endpoint(f"npz:{tmp_path}/back"))
    assert back.cfg == cfg and set(back.arrays) == set(leaves)
    for k, a in leaves.items():
        assert np.array_equal(back.arrays[k], a), k

    # its flag is checked like the built-in ones: one line, nothing written
    rc = main(["convert", "--from", f"npz:{tmp_path}/src", "--to", f"hf:{tmp_path}/hf",
               "--npz-note", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "npz: destinations only" in err[0], err
    assert not (tmp_path / "hf").exists()


def test_a_read_only_format_refuses_to_be_written(npz_table, monkeypatch, tmp_path):
    cfg = load_config("tiny")
    _write_npz(tmp_path / "src", cfg)
    monkeypatch.setattr(NpzFormat, "can_write", False)
    with pytest.raises(UserError, match="read, not written") as e:
        convert(parse_endpoint(f"npz:{tmp_path}/src"), parse_endpoint(f"npz:{tmp_path}/out"))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
