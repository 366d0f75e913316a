"""Read and write HuggingFace checkpoints (config.json + safetensors) for the PyTorch reference.

* :func:`load_hf` / :func:`save_hf`: an HF model directory (``model.safetensors``, or shards
  listed in ``model.safetensors.index.json``), loadable by ``transformers``' ``from_pretrained``.
* :func:`save_torch` / :func:`load_torch`: one safetensors file with HF tensor names and the full
  jaxmoe config as JSON in the file's metadata (key ``jaxmoe_config``).

Tensors are read one at a time straight into the model's parameters, so loading holds at most one
extra tensor in memory. Any missing, unexpected or mis-shaped tensor raises a one-line
:class:`~jaxmoe.errors.UserError` naming it (and both shapes) before the model is used.
The router weight and the expert bias stay fp32 whatever ``dtype`` the rest is loaded in (as HF
keeps them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jaxmoe.config import Config, ConfigError, config_from_dict
from jaxmoe.config.hf import from_hf_config, to_hf_config
from jaxmoe.errors import UserError
from torch_ref.transformer import TorchTransformer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FP32_ALWAYS = ("gate.weight", "e_score_correction_bias")


def _keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_ALWAYS)


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def _tensor_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index} is not a valid safetensors index ({e})") from None
        return {name: directory / fname for name, fname in weight_map.items()}
    single = directory / SINGLE
    if not single.exists():
        raise UserError(f"no {SINGLE} or {INDEX} in {directory}; is it a HuggingFace model directory?")
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def _load_into(model: TorchTransformer, files: dict[str, Path], where: str, dtype: torch.dtype, skip=None) -> None:
    """Copy every tensor of ``files`` into ``model`` after checking names and shapes."""
    targets = model.state_dict(keep_vars=True)
    names = {n for n in files if not (skip and skip(n))}
    missing = sorted(set(targets) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{where} is missing tensor {missing[0]} (shape {_shape(targets[missing[0]].shape)}){more}; "
            "the checkpoint does not match its config"
        )
    extra = sorted(names - set(targets))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise UserError(
            f"{where} has unexpected tensor {extra[0]}{more}, which the model built from its config "
            "does not have; the checkpoint does not match its config"
        )
    by_file: dict[Path, list[str]] = {}
    for n in sorted(names):
        by_file.setdefault(files[n], []).append(n)
    # shapes first (cheap: read from headers), so nothing is half-loaded when one is wrong
    for path, ns in by_file.items():
        with safe_open(str(path), "pt") as f:
            for n in ns:
                got = f.get_slice(n).get_shape()
                want = tuple(targets[n].shape)
                if tuple(got) != want:
                    raise UserError(
                        f"tensor {n} has shape {_shape(got)} in {path.name} but the config expects "
                        f"{_shape(want)}"
                    )
    with torch.no_grad():
        for path, ns in by_file.items():
            with safe_open(str(path), "pt") as f:
                for n in ns:
                    target = targets[n]
                    target.data = f.get_tensor(n).to(torch.float32 if _keeps_fp32(n) else dtype)


# the copies of the shared embedding and head DeepSeek-V3 stores in each MTP layer
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def load_hf(directory, dtype: torch.dtype = torch.float32, base: Config | None = None):
    """``(cfg, model)`` from an HF directory: config.json via :func:`jaxmoe.config.hf.from_hf_config`
    (fields HF has no key for come from ``base``), weights from safetensors (single or sharded).

    Multi-token-prediction layers (``model.layers.{i}`` with ``i >= num_hidden_layers``, present
    when config.json has ``num_nextn_predict_layers > 0``) load into the model's MTP depths
    (``model.mtp_layers`` is set from that key); their stored copies of the shared embedding and
    head (``embed_tokens.weight``, ``shared_head.head.weight``) are skipped (the model shares them).
    """
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise UserError(f"no config.json in {directory}; is it a HuggingFace model directory?")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path} is not valid JSON: {e}") from None
    cfg = from_hf_config(hf, base=base)
    files = _tensor_files(directory)
    n_layers = cfg.model.n_layers
    layer = re.compile(r"model\.layers\.(\d+)\.")
    if not any((mt := layer.match(n)) and int(mt.group(1)) >= n_layers for n in files):
        cfg.model.mtp_layers = 0  # transformers writes num_nextn_predict_layers=1 but no MTP layer
    model = TorchTransformer(cfg)
    skip = None
    if int(hf.get("num_nextn_predict_layers") or 0) > 0:
        pattern = re.compile(r"model\.layers\.(\d+)\.")

        def skip(name: str) -> bool:
            mt = pattern.match(name)
            return bool(mt) and int(mt.group(1)) >= n_layers and name.endswith(MTP_COPIES)

    _load_into(model, files, str(directory), dtype, skip)
    return cfg, model


def _stored(model: TorchTransformer) -> dict[str, torch.Tensor]:
    return {n: t.detach().contiguous() for n, t in model.state_dict().items()}


def _weights_dtype(tensors: dict[str, torch.Tensor]) -> str:
    for n, t in tensors.items():
        if not _keeps_fp32(n):
            return DTYPE_NAMES.get(t.dtype, "float32")
    return "float32"


def save_hf(model: TorchTransformer, directory, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the weights (HF names) to ``directory``; with
    ``max_shard_bytes`` the tensors are packed greedily, in name order, into
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _stored(model)
    hf = to_hf_config(model.cfg, dtype=_weights_dtype(tensors))
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    meta = {"format": "pt"}
    if not max_shard_bytes:
        save_file(tensors, str(directory / SINGLE), metadata=meta)
        return directory
    shards: list[list[str]] = [[]]
    size = 0
    for n in sorted(tensors):
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(directory / fname), metadata=meta)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return directory


def save_torch(model: TorchTransformer, file) -> Path:
    """One safetensors file: HF tensor names, the config as JSON in metadata ``jaxmoe_config``."""
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(_stored(model), str(file), metadata={"format": "pt", "jaxmoe_config": model.cfg.to_json()})
    return file


# fields that change what the weights mean (loss coefficients, init, names may differ)
_FUNCTIONAL_KEYS = {
    "model": None,  # every model field except _MODEL_IGNORED
    "moe": ("n_experts", "top_k", "expert_ffn_dim", "n_shared_experts", "score_func", "norm_topk_prob",
            "route_scale", "n_groups", "topk_groups", "use_expert_bias"),
}
_MODEL_IGNORED = ("name", "init_std", "max_seq_len")


def _model_diff(given: Config, stored: Config) -> str | None:
    """The first architecture/routing field where two configs differ, as 'section.key=...'."""
    for section, keys in _FUNCTIONAL_KEYS.items():
        g, s = given.to_dict()[section], stored.to_dict()[section]
        for k in keys or [k for k in g if k not in _MODEL_IGNORED]:
            if g[k] != s[k]:
                return f"{section}.{k}={s[k]!r} in the file but {g[k]!r} in the given config"
    return None


def load_torch(file, cfg: Config | None = None, dtype: torch.dtype = torch.float32) -> TorchTransformer:
    """A model from :func:`save_torch`'s file. With ``cfg``, it must agree with the embedded config
    on the model (architecture and routing) fields; its train/mesh settings are used."""
    file = Path(file)
    if not file.exists():
        raise UserError(f"checkpoint file not found: {file}")
    with safe_open(str(file), "pt") as f:
        meta = f.metadata() or {}
        names = list(f.keys())
    text = meta.get("jaxmoe_config")
    if text is None and cfg is None:
        raise UserError(f"{file} has no embedded jaxmoe_config metadata; pass the config explicitly")
    if text is not None:
        try:
            stored = config_from_dict(json.loads(text))
        except (json.JSONDecodeError, ConfigError) as e:
            raise UserError(f"{file}: embedded jaxmoe_config is invalid: {e}") from None
        if cfg is not None:
            diff = _model_diff(cfg, stored)
            if diff:
                raise UserError(f"{file} contradicts the given config: {diff}")
        else:
            cfg = stored
    model = TorchTransformer(cfg)
    _load_into(model, {n: file for n in names}, str(file), dtype)
    return model


__all__ = ["load_hf", "load_torch", "save_hf", "save_torch"]
