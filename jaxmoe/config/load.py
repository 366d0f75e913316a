"""jaxmoe configuration: the single source of truth for shapes, routing, mesh and training.

Pure Python (dataclasses + tomllib): importing this module must never import jax, so that
``torch_ref`` shares it without pulling JAX in.

A config is four sections, each a dataclass::

    [model]  shapes, attention kind, norms, RoPE
    [moe]    experts, routing semantics, aux losses, expert compute path
    [mesh]   device mesh axes and the expert-parallel dispatcher
    [train]  optimizer, schedule, batch, precision, checkpoints, data

Presets are TOML files in ``jaxmoe/config/presets/``. ``load_config(preset=..., path=..., overrides=[...])``
builds a :class:`Config`, type-checks every key, and runs :func:`validate`, which rejects
impossible combinations with a one-line :class:`ConfigError` naming the key, before any compute.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from jaxmoe.archs import get_arch
from jaxmoe.config.schema import MOVED_KEYS, SECTIONS, Config, allows_auto, choices, field_type
from jaxmoe.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"


# --------------------------------------------------------------------------------------------
# Building configs: dicts, TOML, presets, --set overrides
# --------------------------------------------------------------------------------------------


def _coerce(section: str, key: str, value: Any, typ: type) -> Any:
    """Coerce ``value`` (a TOML value or a --set string) to ``typ`` or raise ConfigError."""
    where = f"{section}.{key}"
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
            if typ is list:
                parsed = json.loads(text)
                if not isinstance(parsed, list):
                    raise ValueError
                return parsed
        except ValueError:
            raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {value!r}")


#: old keys already noticed in this process (one line each, the first time it is used)
_NOTICED: set[tuple[str, str]] = set()


def canonical_key(section: str, key: str) -> tuple[str, str]:
    """Where ``section.key`` lives now: a key that moved out of ``[train]``
    (:data:`~jaxmoe.config.schema.MOVED_KEYS`) gives its new place, with one line of notice on stderr
    the first time this process sees it; any other key is returned as it is."""
    if (section, key) not in MOVED_KEYS:
        return section, key
    new = MOVED_KEYS[(section, key)]
    if (section, key) not in _NOTICED:
        _NOTICED.add((section, key))
        print(f"note: {section}.{key} is now {new[0]}.{new[1]} (the old key still works)", file=sys.stderr)
    return new


def apply_setting(cfg: Config, section: str, key: str, value: Any) -> None:
    """Set ``cfg.<section>.<key>`` to ``value`` coerced to the field's type, in place; an unknown
    section or key is a one-line ConfigError (with close names as a hint). A key that moved out of
    ``[train]`` (:data:`~jaxmoe.config.schema.MOVED_KEYS`) is set where it lives now, with one line of
    notice on stderr the first time this process sees it."""
    section, key = canonical_key(section, key)
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section {section!r} (in {section}.{key}); sections are: "
            + ", ".join(SECTIONS)
        )
    obj = getattr(cfg, section)
    names = [f.name for f in fields(obj)]
    if key not in names:
        close = [n for n in names if key in n or n in key]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config key {section}.{key}{hint}")
    if allows_auto(type(obj), key) and isinstance(value, str) and value.strip() == "auto":
        setattr(obj, key, "auto")  # resolved per backend and shape by jaxmoe.config.autoconf
        return
    setattr(obj, key, _coerce(section, key, value, field_type(type(obj), key)))


def config_from_dict(data: dict, base: Config | None = None) -> Config:
    """Build a Config from a nested dict ({section: {key: value}}), on top of ``base``."""
    cfg = dataclasses.replace(base) if base is not None else Config()
    if base is not None:  # deep copy sections so the base is not mutated
        cfg = Config(
            **{s: dataclasses.replace(getattr(base, s)) for s in SECTIONS},
            description=base.description,
        )
    for section, values in data.items():
        if section == "description":
            cfg.description = str(values)
            continue
        if section == "preset":
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"config entry {section!r} must be a [section] table")
        for key, value in values.items():
            apply_setting(cfg, section, key, value)
    return cfg


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_file(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {e}") from None


def load_preset_dict(name: str) -> dict:
    path = PRESET_DIR / f"{name}.toml"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; presets are: {', '.join(list_presets())}")
    return _read_file(path)


def parse_override(text: str) -> tuple[str, str, str]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    lhs, value = text.split("=", 1)
    if "." not in lhs:
        raise ConfigError(f"--set {text!r}: key must be section.key (e.g. moe.top_k=2)")
    section, key = canonical_key(*lhs.strip().split(".", 1))
    return section, key, value


def load_config(
    preset: str | None = None,
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    validate_config: bool = True,
) -> Config:
    """Preset (default ``tiny`` when neither preset nor path is given) + file + ``--set`` overrides.

    A config file may name a preset to start from with a top-level ``preset = "NAME"``.
    """
    cfg = Config()
    if path is not None:
        data = _read_file(Path(path))
        base_name = data.get("preset", preset)
        if base_name:
            cfg = config_from_dict(load_preset_dict(base_name))
        cfg = config_from_dict(data, cfg)
    else:
        cfg = config_from_dict(load_preset_dict(preset or "tiny"))
    for text in overrides:
        section, key, value = parse_override(text)
        apply_setting(cfg, section, key, value)
    if validate_config:
        validate(cfg)
    return cfg


def config_to_toml(cfg: Config) -> str:
    """Serialise to TOML (flat scalar/list values only, which is all a Config holds)."""

    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        raise TypeError(v)

    lines = [f"description = {fmt(cfg.description)}"]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for f in fields(getattr(cfg, section)):
            lines.append(f"{f.name} = {fmt(getattr(getattr(cfg, section), f.name))}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Validation: impossible combinations are rejected before any compute
# --------------------------------------------------------------------------------------------


def _positive(cfg: Config, section: str, *keys: str, allow_zero: bool = False) -> None:
    obj = getattr(cfg, section)
    for k in keys:
        v = getattr(obj, k)
        if v == "auto" and allows_auto(type(obj), k):
            continue
        if isinstance(v, str) or isinstance(v, bool):
            raise ConfigError(f"{section}.{k}={v!r} must be a number"
                              + (" or 'auto'" if allows_auto(type(obj), k) else ""))
        if v < 0 or (v == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{k}={v} must be {need}")


def profile_window(spec: str, steps: int) -> tuple[int, int] | None:
    """``train.profile_steps`` ``"A:B"`` -> ``(A, B)``, steps numbered from 1 as in metrics.jsonl
    (``1 <= A <= B <= train.steps``); ``""`` -> None; anything else: a one-line ConfigError."""
    if not spec:
        return None
    a, sep, b = str(spec).partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = int(a), int(b)
    except ValueError:
        raise ConfigError(f"train.profile_steps={spec!r} must be 'A:B', two step numbers (e.g. '3:5')") from None
    if not 1 <= lo <= hi <= steps:
        raise ConfigError(f"train.profile_steps={spec!r} must satisfy 1 <= A <= B <= train.steps={steps} "
                          "(steps are numbered from 1, as in metrics.jsonl)")
    return lo, hi


def validate(cfg: Config) -> Config:
    """``cfg`` itself if every field is allowed and the fields agree; else a one-line ConfigError
    naming the key (before any compute)."""
    _check_fields(cfg)
    _check_run(cfg)
    _check_model(cfg)
    _check_moe(cfg)
    _check_mesh(cfg)
    _check_fp8(cfg)
    return cfg


def _check_fp8(cfg: Config) -> None:
    """compute.fp8 covers every expert path; its grouped matmuls are ``lax.ragged_dot`` on the
    quantised operands (jaxmoe/model/fp8.py), so an explicitly chosen grouped-GEMM kernel would be
    silently unused: refused. Mesh conditions: jaxmoe.parallel.expert_dispatch.check_fp8."""
    c, e = cfg.compute, cfg.moe
    if c.fp8 != "none" and cfg.model.n_moe_layers > 0 and e.ragged_kernel in ("mosaic_gpu", "tokamax"):
        raise ConfigError(f"compute.fp8={c.fp8!r} runs the routed experts' grouped matmuls as lax.ragged_dot, "
                          f"not moe.ragged_kernel={e.ragged_kernel!r}; set moe.ragged_kernel=auto (or xla) "
                          "or compute.fp8=none")


def _check_fields(cfg: Config) -> None:
    """Every field one of its declared choices, every float finite."""
    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        for f in fields(cls):
            v = getattr(obj, f.name)
            allowed = choices(cls, f.name)
            if allowed is not None and v not in allowed:
                raise ConfigError(f"{section}.{f.name}={v!r} is not one of: {', '.join(allowed)}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{section}.{f.name}={v!r} must be a finite number")


def _check_run(cfg: Config) -> None:
    """The train, optim, compute, data and checkpoint sections."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    _positive(cfg, "train", "batch_size", "seq_len", "micro_batches", "steps", "log_every",
              "max_bad_steps")
    _positive(cfg, "train", "eval_every", "local_checkpoint_every", allow_zero=True)
    _positive(cfg, "checkpoint", "every", "keep", allow_zero=True)
    _positive(cfg, "optim", "warmup_steps", "muon_ns_steps", allow_zero=True)
    _positive(cfg, "compute", "ce_chunk_tokens", "scan_unroll", allow_zero=True)
    _positive(cfg, "data", "workers", allow_zero=True)
    if t.eval_every > 0 and t.eval_batches <= 0:
        raise ConfigError(f"train.eval_batches={t.eval_batches} must be > 0 when train.eval_every="
                          f"{t.eval_every} > 0 (or set train.eval_every=0 to turn evaluation off)")
    for section, k in (("checkpoint", "minutes"), ("optim", "weight_decay"), ("optim", "muon_weight_decay"),
                       ("optim", "grad_clip"), ("train", "z_loss_coef"), ("train", "mtp_loss_coef"),
                       ("optim", "eps"), ("optim", "muon_eps")):
        if getattr(getattr(cfg, section), k) < 0:
            raise ConfigError(f"{section}.{k}={getattr(getattr(cfg, section), k)} must be >= 0")
    if not 0 <= o.beta1 < 1 or not 0 <= o.beta2 < 1 or not 0 <= o.muon_momentum < 1:
        raise ConfigError("optim.beta1, optim.beta2 and optim.muon_momentum must be in [0, 1)")
    if not 0 <= o.min_lr_ratio <= 1 or not 0 <= o.wsd_decay_frac <= 1 or not 0 <= o.titan_decay_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio, optim.wsd_decay_frac and optim.titan_decay_ratio must be in [0, 1]")
    if t.profile_steps:
        profile_window(t.profile_steps, t.steps)
    if t.batch_size % t.micro_batches:
        raise ConfigError(
            f"train.micro_batches={t.micro_batches} does not divide train.batch_size={t.batch_size}"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    coeffs = o.muon_ns_coefficients
    if len(coeffs) != 3 or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coeffs
    ):
        raise ConfigError(f"optim.muon_ns_coefficients={coeffs!r} must be a list of 3 finite numbers (a, b, c)")
    if o.lr < 0 or o.muon_lr < 0:
        raise ConfigError("optim.lr and optim.muon_lr must be >= 0")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    _positive(cfg, "model", "vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
    _positive(cfg, "model", "first_k_dense", "mtp_layers", allow_zero=True)
    if m.first_k_dense > m.n_layers:
        raise ConfigError(
            f"model.first_k_dense={m.first_k_dense} exceeds model.n_layers={m.n_layers}"
        )
    if m.first_k_dense > 0 and m.dense_ffn_dim <= 0:
        raise ConfigError(f"model.dense_ffn_dim={m.dense_ffn_dim} must be > 0 when first_k_dense > 0")
    if m.rms_norm_eps <= 0 or m.mla_norm_eps <= 0:
        raise ConfigError(f"model.rms_norm_eps={m.rms_norm_eps} and model.mla_norm_eps="
                          f"{m.mla_norm_eps} must be > 0")
    if m.attention == "gqa":
        _positive(cfg, "model", "n_kv_heads", "head_dim")
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}"
            )
        if m.head_dim % 2:
            raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE")
    else:
        _positive(cfg, "model", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _positive(cfg, "model", "q_lora_rank", allow_zero=True)
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
    arch = get_arch(m.hf_arch)  # the weight-naming architecture fixes the attention kind;
    if m.attention != arch.attention:  # the rest of arch.problems() matters only for HF export
        raise ConfigError(f"model.hf_arch={m.hf_arch!r} requires model.attention={arch.attention!r}")
    if m.rope_scaling == "yarn" and m.yarn_factor < 1.0:
        raise ConfigError(f"model.yarn_factor={m.yarn_factor} must be >= 1 for YaRN")


def _check_moe(cfg: Config) -> None:
    m, e = cfg.model, cfg.moe
    _positive(cfg, "moe", "n_experts", "top_k", "expert_ffn_dim", "n_groups", "topk_groups")
    _positive(cfg, "moe", "n_shared_experts", allow_zero=True)
    if e.top_k > e.n_experts:
        raise ConfigError(f"moe.top_k={e.top_k} exceeds moe.n_experts={e.n_experts}")
    if e.n_experts % e.n_groups:
        raise ConfigError(f"moe.n_groups={e.n_groups} does not divide moe.n_experts={e.n_experts}")
    if e.topk_groups > e.n_groups:
        raise ConfigError(f"moe.topk_groups={e.topk_groups} exceeds moe.n_groups={e.n_groups}")
    if e.n_groups > 1:
        per_group = e.n_experts // e.n_groups
        if per_group < 2:
            raise ConfigError(
                f"moe.n_groups={e.n_groups} leaves {per_group} expert per group; group scores "
                "sum each group's top-2, so each group needs >= 2 experts"
            )
        if e.top_k > e.topk_groups * per_group:
            raise ConfigError(
                f"moe.top_k={e.top_k} exceeds the {e.topk_groups * per_group} experts in "
                f"moe.topk_groups={e.topk_groups} groups of {per_group}"
            )
    if e.capacity_factor < 0:
        raise ConfigError(f"moe.capacity_factor={e.capacity_factor} must be >= 0 (0 = dropless)")
    if e.block_size <= 0:
        raise ConfigError(f"moe.block_size={e.block_size} must be > 0")
    if e.ragged_kernel == "tokamax" and e.compute_path not in ("ragged", "auto"):
        raise ConfigError(f"moe.ragged_kernel='tokamax' applies to moe.compute_path='ragged' only (this "
                          f"config uses {e.compute_path!r}); set one or the other")
    if e.ragged_kernel == "mosaic_gpu":  # the device itself is checked when the step is traced
        if e.compute_path not in ("ragged", "auto"):  # auto picks ragged for it (jaxmoe.config.autoconf)
            raise ConfigError(f"moe.ragged_kernel='mosaic_gpu' applies to moe.compute_path='ragged' "
                              f"only (this config uses {e.compute_path!r}); set one or the other")
        if cfg.compute.dtype != "bfloat16":
            raise ConfigError(f"moe.ragged_kernel='mosaic_gpu' needs compute.dtype=bfloat16 (the Hopper kernels "
                              f"take 16-bit operands), not {cfg.compute.dtype!r}; or use moe.ragged_kernel=xla")
        bad = {k: v for k, v in (("model.d_model", m.d_model), ("moe.expert_ffn_dim", e.expert_ffn_dim))
               if v % 64}
        if bad:
            raise ConfigError("moe.ragged_kernel='mosaic_gpu' needs model.d_model and moe.expert_ffn_dim "
                              "to be multiples of 64 (its 64-wide K tiles); got "
                              + ", ".join(f"{k}={v}" for k, v in bad.items()))
    for k in ("lb_coef", "seq_aux_coef", "router_z_coef", "bias_update_rate", "route_scale"):
        if getattr(e, k) < 0:
            raise ConfigError(f"moe.{k}={getattr(e, k)} must be >= 0")


def _check_mesh(cfg: Config) -> None:
    mesh = cfg.mesh
    for k in ("replica", "fsdp", "expert", "tensor"):
        v = getattr(mesh, k)
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{k}={v} must be a positive size or -1 (fill)")
    if sum(getattr(mesh, k) == -1 for k in ("replica", "fsdp", "expert", "tensor")) > 1:
        raise ConfigError("mesh: at most one axis may be -1 (fill)")
    if mesh.dispatch_chunks <= 0:
        raise ConfigError(f"mesh.dispatch_chunks={mesh.dispatch_chunks} must be > 0")


__all__ = [
    "Config",  # what load_config returns (defined in jaxmoe.config.schema)
    "ConfigError",  # what validation raises (defined in jaxmoe.errors)
    "apply_setting",
    "canonical_key",
    "config_from_dict",
    "config_to_toml",
    "list_presets",
    "load_config",
    "parse_override",
    "profile_window",
    "validate",
]
