"""``auto`` config values -> concrete ones, per backend and shape: the one place they are chosen.

Five fields take ``auto`` and default to it: ``moe.compute_path``, ``moe.ragged_kernel``,
``compute.attention_kernel``, ``compute.scan_unroll`` and ``compute.ce_chunk_tokens``.
:func:`resolve_auto` returns the config
with each ``auto`` replaced by the value the rules below pick for the backend (``cpu``, ``gpu``
(``cuda``/``rocm``), ``tpu``) and the config's shape; an explicit value (given by ``--set``, a
config file or a preset) is never changed. The model (:class:`jaxmoe.model.transformer.Model`,
``Transformer``) resolves its config on construction, so every reader sees concrete values;
``jaxmoe train`` keeps the asked config in ``config.toml`` (``auto`` stays ``auto``, so a resumed
run on another backend re-resolves) and writes what ran to ``run.json``'s ``resolved`` (and one
line to stderr, unless ``--quiet``).

The rules (evidence: docs/MEASUREMENTS.md, "auto defaults"):

* ``moe.compute_path``: ``blocked`` on CPU and GPU -- ``jax.lax.ragged_dot`` (the ``ragged``
  path) is lowered densely there (an ``[E, rows, K]`` operand: E times the memory and FLOPs;
  on CPU the bench's coarse step ran slower with it) and ``dense`` holds a worst-case capacity
  per expert; ``blocked`` is a grouped GEMM over 16..64-row blocks with no dense
  ``[groups, rows, K]`` operand. ``ragged`` on TPU, where ``ragged_dot`` is a native grouped
  matmul. With ``moe.ragged_kernel=mosaic_gpu`` or ``tokamax`` set (they apply to ``ragged``
  only): ``ragged``.
  On GPU the Mosaic grouped GEMM stays opt-in until ``bench/gpu.py``'s ``kernel_check`` has
  passed on a device; the reason is printed once per process.
* ``moe.ragged_kernel`` (the ``ragged`` path's grouped matmul): ``tokamax`` on CUDA when the
  ``tokamax`` package is installed (the ``[gpu]`` extra, Python >= 3.12), else ``xla``. It matters
  only where ``moe.compute_path`` is ``ragged``, which ``auto`` picks on GPU only when a kernel is
  set explicitly: the tokamax kernels have not been run on a device by this project yet.
* ``compute.attention_kernel``: ``dot_product`` on GPU (``jax.nn.dot_product_attention``, cuDNN
  flash attention), ``explicit`` elsewhere (what :func:`jaxmoe.model.attention.attend` did).
* ``compute.scan_unroll``: on CPU ``0`` (every layer unrolled: no stacked per-layer buffers to
  zero-fill, slice and write back) when each layer stack has at most :data:`UNROLL_MAX_LAYERS`
  layers, else ``1`` (a rolled scan: compile time flat in depth). Unrolling was faster on CPU on
  the 4-layer bench shapes; its price is compile time, which grows with the unrolled depth, so
  deep models (every large preset) keep the rolled scan. On GPU and TPU ``1``: there a layer's
  kernels are large next to the loop's bookkeeping, memory is what binds, and unrolling raises
  XLA's peak (tiny, remat save_dots, fsdp=2,expert=4: 4.41 MB unrolled against the 3.73 MB
  jaxmoe.plan.memory models for the rolled scan, which tests/test_plan.py checks within 15%), while
  compile time stays flat in depth. Not measured on a device.
* ``compute.ce_chunk_tokens``: :data:`CE_CHUNK` (cross-entropy fused with the LM head, chunked)
  when one micro-batch's ``[tokens, vocab]`` logits would hold at least :data:`CE_CHUNK_MIN_LOGITS`
  values (64 MiB in fp32), else ``0`` (whole logits). Same FLOPs, fewer bytes: faster on CPU at
  the bench shapes (2048 tokens x 8192 vocab), and on GPU it keeps the fp32 logits and their
  gradient (tokens x vocab x 8 bytes) out of memory. Tokens are the global micro-batch's
  (``batch_size / micro_batches * seq_len``).

Pure Python: importing this module does not import jax (``backend=None`` asks jax lazily).
"""

from __future__ import annotations

import dataclasses
import sys

from jaxmoe.config.schema import Config

UNROLL_MAX_LAYERS = 8
CE_CHUNK = 1024
CE_CHUNK_MIN_LOGITS = 1 << 24
AUTO_FIELDS = (("moe", "compute_path"), ("moe", "ragged_kernel"), ("compute", "attention_kernel"),
               ("compute", "scan_unroll"), ("compute", "ce_chunk_tokens"))
MOSAIC_NOTE = ("moe.compute_path=auto -> blocked on GPU; moe.ragged_kernel=mosaic_gpu (the Hopper "
               "grouped GEMM, with moe.compute_path=ragged) stays opt-in until bench/gpu.py's "
               "kernel_check has passed on a device")
_said: set = set()


def backend_kind(backend: str | None = None) -> str:
    """``cpu``, ``gpu`` or ``tpu`` for a jax backend/platform name (``None``: jax's default
    backend); ``cuda`` and ``rocm`` are ``gpu``; any other backend follows the CPU rules."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    b = backend.lower()
    if b in ("gpu", "cuda", "rocm"):
        return "gpu"
    return b if b == "tpu" else "cpu"


def _compute_path(cfg: Config, kind: str) -> str:
    if cfg.moe.ragged_kernel in ("mosaic_gpu", "tokamax"):
        return "ragged"
    return "ragged" if kind == "tpu" else "blocked"


def tokamax_importable() -> bool:
    """Whether the ``tokamax`` package is installed here (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec("tokamax") is not None


def _ragged_kernel(cfg: Config, kind: str) -> str:
    if kind == "gpu" and tokamax_importable():
        return "tokamax"
    return "xla"


def _scan_unroll(cfg: Config, kind: str) -> int:
    if kind != "cpu":
        return 1
    m = cfg.model
    deepest = max(m.first_k_dense, m.n_layers - m.first_k_dense)
    return 0 if deepest <= UNROLL_MAX_LAYERS else 1


def _ce_chunk_tokens(cfg: Config, kind: str) -> int:
    t = cfg.train
    tokens = t.batch_size // max(1, t.micro_batches) * t.seq_len
    return CE_CHUNK if tokens > CE_CHUNK and tokens * cfg.model.vocab_size >= CE_CHUNK_MIN_LOGITS else 0


_RULES = {
    ("moe", "compute_path"): _compute_path,
    ("moe", "ragged_kernel"): _ragged_kernel,
    ("compute", "attention_kernel"): lambda cfg, kind: "dot_product" if kind == "gpu" else "explicit",
    ("compute", "scan_unroll"): _scan_unroll,
    ("compute", "ce_chunk_tokens"): _ce_chunk_tokens,
}


def auto_choices(cfg: Config, backend: str | None = None) -> dict:
    """``{"section.key": value}`` for every field of ``cfg`` that is ``auto``: the value it resolves
    to on ``backend`` (empty when nothing is ``auto``)."""
    asked = [(s, k) for s, k in AUTO_FIELDS if getattr(getattr(cfg, s), k) == "auto"]
    if not asked:
        return {}
    kind = backend_kind(backend)
    return {f"{s}.{k}": _RULES[(s, k)](cfg, kind) for s, k in asked}


def resolve_auto(cfg: Config, backend: str | None = None) -> Config:
    """``cfg`` with every ``auto`` field replaced per the module's rules for ``backend`` (``None``:
    jax's default backend); ``cfg`` itself (the same object) when nothing is ``auto``. Never
    mutates ``cfg``."""
    chosen = auto_choices(cfg, backend)
    if not chosen:
        return cfg
    if chosen.get("moe.compute_path") == "blocked" and backend_kind(backend) == "gpu":
        say_once(MOSAIC_NOTE)
    sections = {}
    for name, value in chosen.items():
        s, k = name.split(".")
        sections.setdefault(s, {})[k] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def say_once(line: str) -> None:
    """Print ``line`` to stderr the first time it is said in this process."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)


__all__ = ["AUTO_FIELDS", "CE_CHUNK", "CE_CHUNK_MIN_LOGITS", "MOSAIC_NOTE", "UNROLL_MAX_LAYERS", "auto_choices",
           "backend_kind", "resolve_auto", "say_once", "tokamax_importable"]
