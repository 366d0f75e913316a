"""Non-weight HF files (tokenizer, generation config, token ids) carried across conversions.

An HF checkpoint's tokenizer*.json, generation_config.json and the like travel with its weights:
a run dir keeps them, with the original config.json, in ``RUN_DIR/hf_meta/`` (from
``convert --to orbax:`` and ``train --init-from``), and converting to ``hf:`` puts them back next
to the weights, with the original config.json's token ids (:data:`CARRIED_CONFIG_KEYS`) in the
written config.json. A source says where its files are (``Source.meta_dir``); a sink keeps them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HF_META_DIR = "hf_meta"
# config.json keys that are not architecture but must survive a round trip
CARRIED_CONFIG_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
                       "decoder_start_token_id")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_META_MAX_BYTES = 256 * 2**20  # a "non-weight" file larger than this is not copied (with a note)


def meta_files(directory: Path | None, log=None) -> list[Path]:
    """The non-weight regular files at the top of ``directory`` (config.json included)."""
    if directory is None or not directory.is_dir():
        return []
    out = []
    for f in sorted(directory.iterdir()):
        if not f.is_file() or f.name.startswith(".") or f.name in _WEIGHT_NAMES:
            continue
        if f.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if f.stat().st_size > _META_MAX_BYTES:
            if log is not None:
                log(f"note: not carrying {f} ({f.stat().st_size / 1e6:.0f} MB; not a weight file "
                    "jaxmoe knows, too large for metadata)")
            continue
        out.append(f)
    return out


def keep_in_run_dir(files: list[Path], run_dir: Path) -> list[str]:
    """Copy ``files`` into ``run_dir/hf_meta/`` (the original config.json included); the names."""
    if not files:
        return []
    out = Path(run_dir) / HF_META_DIR
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, out / f.name)
    return [f.name for f in files]


def merge_into_hf_dir(files: list[Path], target: Path) -> list[str]:
    """Copy ``files`` into the HF dir ``target``, except config.json, which its sink wrote from
    the model config: only its token ids (:data:`CARRIED_CONFIG_KEYS`) are taken from the
    original. The names carried (``config.json:KEY,...`` for the ids)."""
    carried = []
    for f in files:
        if f.name == "config.json":
            try:
                orig = json.loads(f.read_text())
            except ValueError:
                continue
            written = json.loads((target / "config.json").read_text())
            keep = {k: orig[k] for k in CARRIED_CONFIG_KEYS if k in orig}
            if keep:
                written.update(keep)
                (target / "config.json").write_text(json.dumps(written, indent=2) + "\n")
                carried.append("config.json:" + ",".join(keep))
            continue
        shutil.copy2(f, target / f.name)
        carried.append(f.name)
    return carried


__all__ = [
    "CARRIED_CONFIG_KEYS",
    "HF_META_DIR",
    "keep_in_run_dir",
    "merge_into_hf_dir",
    "meta_files",
]
