"""HF tensor names <-> the canonical jaxmoe layout, built from two declarations and nothing else.

* the model's parameter declarations (:func:`jaxmoe.model.transformer.model_declarations`): every
  leaf's path, shape, logical axes (a leading ``layers`` axis = one HF tensor per layer, an
  ``experts`` axis = per expert) and type (a linear weight is stored transposed by HF);
* the architecture record (:mod:`jaxmoe.archs`): the HF name template of each path, per on-disk
  expert layout.

One table (:func:`entries`) drives everything: import (HF -> jaxmoe), export (jaxmoe -> HF) and the
"which tensors must exist, with which shapes" check. Each row (:class:`Entry`) says: HF tensor
``hf_name`` (shape ``hf_shape``) -- or, for the fused layout's ``gate_up_proj``, the part
``hf_part`` of it -- is the slice ``index`` of the jaxmoe leaf ``key``, with its last two dims
swapped or not. Leaves are keyed ``"params/<path>"`` / ``"buffers/<path>"``:

* layer stacks: HF layer ``i`` is row ``i - offset`` of the stack holding it (``dense/*`` for the
  first ``first_k_dense`` layers, ``moe/*`` after) -> ``index = (row,)``;
* experts ``[Lm, E, in, out]``: per-expert layout -> one row per expert, ``index = (row, e)``;
  fused layout -> one row per layer for ``[E, ...]`` (``gate_up_proj`` holds gate then up along
  its dim 1: two rows with ``hf_part``);
* linear weights: HF ``[out, in]``, jaxmoe ``[in, out]`` -> ``transpose=True`` (norms, the
  embedding and the expert bias are not transposed);
* HF-only tensors jaxmoe does not hold (DeepSeek-V3's selection bias without
  ``use_expert_bias``) have ``key == ZERO``: written as zeros, checked to be zero on import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxmoe.archs import get_arch
from jaxmoe.archs.base import GLOBAL_NAMES, LAYER_PREFIX, LAYOUTS
from jaxmoe.config import Config
from jaxmoe.errors import UserError
from jaxmoe.trees import flatten, unflatten

ZERO = ""  # Entry.key of HF-only tensors that must be zero (see Entry)

# HF names that are not weights and may be ignored on import (old checkpoints carry them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Entry:
    """One HF tensor (or one part of it): ``hf_name`` [hf_shape] == leaf ``key`` at ``index``."""

    hf_name: str
    key: str  # "params/moe/experts/gate_proj", "buffers/moe/expert_bias", ... or ZERO
    index: tuple[int, ...]  # position in the leaf's leading (layer, expert) axes; () = whole leaf
    transpose: bool  # the last two dims are swapped between HF and jaxmoe
    hf_shape: tuple[int, ...]  # the whole HF tensor
    hf_part: tuple[int, int, int] | None = None  # (dim, start, stop): this row is that range

    @property
    def part_shape(self) -> tuple[int, ...]:
        """Shape of the HF tensor's part this row covers (the whole tensor without hf_part)."""
        if self.hf_part is None:
            return self.hf_shape
        dim, start, stop = self.hf_part
        return self.hf_shape[:dim] + (stop - start,) + self.hf_shape[dim + 1:]

    @property
    def jax_shape(self) -> tuple[int, ...]:
        """Shape of the slice ``leaf[index]`` (the HF part, with the last two dims swapped back)."""
        s = self.part_shape
        return s[:-2] + (s[-1], s[-2]) if self.transpose else s


def check_supported(cfg: Config, allow: frozenset = frozenset()) -> None:
    """Raise UserError if ``cfg`` cannot be expressed in its HF architecture's layout (features in
    ``allow`` aside)."""
    try:
        arch = get_arch(cfg.model.hf_arch)
        problems = arch.problems(cfg, allow)
    except ValueError as e:
        raise UserError(str(e)) from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"model.hf_arch={arch.name!r} cannot express {problems[0]}{more}")


def entries(cfg: Config, layout: str = "per-expert", *, any_bias: bool = False) -> list[Entry]:
    """Every HF tensor of ``cfg`` in hub order (embed, layers 0.., norm, lm_head).

    ``any_bias``: an expert bias the architecture cannot store (torchtitan's bias on softmax
    scores, on a Qwen3/Mixtral layout) is named ``{moe}.gate.e_score_correction_bias`` instead of
    refused -- torch_ref's buffer name, for the in-memory exchange with torch_ref; never a file."""
    from jaxmoe.model.transformer import LAYER_STACKS, model_declarations

    check_supported(cfg, frozenset({"expert_bias"}) if any_bias else frozenset())
    if layout not in LAYOUTS:
        raise UserError(f"HF expert layout {layout!r} is not one of: {', '.join(LAYOUTS)}")
    arch = get_arch(cfg.model.hf_arch)
    names = arch.names(layout)
    decls = model_declarations(cfg)
    out: list[Entry] = []

    def key_of(path, d):
        return ("params/" if d.trained else "buffers/") + path

    def add_global(path):
        d = decls.get(path)
        if d is not None:
            hf = d.shape[:-2] + (d.shape[-1], d.shape[-2]) if d.hf_transpose else d.shape
            out.append(Entry(GLOBAL_NAMES[path], key_of(path, d), (), d.hf_transpose, hf))

    add_global("embed")
    for stack, offset, n in LAYER_STACKS(cfg):
        sub = {p[len(stack) + 1:]: d for p, d in decls.items() if p.startswith(stack + "/")}
        per_expert = [(name, d) for name, d in sub.items() if d.axes[1:2] == ("experts",)]
        for row in range(n):
            pre = LAYER_PREFIX.format(i=offset + row)
            experts_done = False
            for name in names:  # hub order
                d = sub.get(name)
                if d is None:
                    if name == "expert_bias" and "router" in sub and arch.bias_tensor:
                        e = cfg.moe.n_experts
                        out.append(Entry(pre + names[name], ZERO, (row,), False, (e,)))
                    continue
                if d.axes[0] != "layers":
                    raise ValueError(f"{stack}/{name}: a layer stack leaf must start with 'layers'")
                inner = d.shape[1:]
                key = key_of(f"{stack}/{name}", d)
                if d.axes[1:2] == ("experts",) and layout == "per-expert":
                    if not experts_done:  # all experts here, expert-major (gate, up, down of e)
                        out.extend(_per_expert(pre, names, per_expert, row, stack, key_of))
                        experts_done = True
                    continue
                hf = inner[:-2] + (inner[-1], inner[-2]) if d.hf_transpose else inner
                if name in ("experts/gate_proj", "experts/up_proj"):  # fused gate_up_proj
                    i_dim = hf[-2]
                    start = 0 if name.endswith("gate_proj") else i_dim
                    full = hf[:-2] + (2 * i_dim, hf[-1])
                    out.append(Entry(pre + names[name], key, (row,), d.hf_transpose, full,
                                     (len(full) - 2, start, start + i_dim)))
                    continue
                out.append(Entry(pre + names[name], key, (row,), d.hf_transpose, hf))
    add_global("final_norm")
    add_global("lm_head")
    seen = {(e.hf_name, e.hf_part) for e in out}
    known = {key_of(p, d) for p, d in decls.items()}
    covered = {e.key for e in out}
    if len(seen) != len(out) or known - covered:
        raise ValueError(f"hf_map: declarations without an HF name in {arch.name}: "
                         f"{sorted(known - covered)}")
    return out


def detect_entries(cfg: Config, present) -> tuple[list[Entry], dict[int, str]]:
    """The table of a checkpoint whose tensor names are ``present`` (a container of names):
    each HF layer's rows come from the layout (:data:`LAYOUTS`) its tensor names use, so
    per-expert and fused layers may even mix. A layer counts as fused when any name only the
    fused layout has (``{moe}.experts.gate_up_proj``, Mixtral's ``mlp.gate.weight``, ...) is
    present; else it is read per expert (and missing tensors are reported by that layout's
    names). Returns ``(table, {hf layer: layout})``.
    """
    tables = {lay: entries(cfg, lay) for lay in LAYOUTS}
    by_layer: dict[str, dict[int, list[Entry]]] = {}
    for lay, table in tables.items():
        for ent in table:
            by_layer.setdefault(lay, {}).setdefault(hf_layer_index(ent.hf_name), []).append(ent)
    base = by_layer[LAYOUTS[0]]
    chosen: dict[int, str] = {}
    for i in base:
        if i is None:
            continue
        names = {e.hf_name for e in base[i]}
        chosen[i] = LAYOUTS[0]
        for lay in LAYOUTS[1:]:
            own = {e.hf_name for e in by_layer[lay].get(i, [])} - names
            if any(n in present for n in own):
                chosen[i] = lay
                break
    out: list[Entry] = []
    done: set[int] = set()
    for ent in tables[LAYOUTS[0]]:
        i = hf_layer_index(ent.hf_name)
        if i is None:
            out.append(ent)
        elif i not in done:
            done.add(i)
            out.extend(by_layer[chosen[i]][i])
    return out, chosen


def tensors(table: list[Entry]) -> dict[str, list[Entry]]:
    """Rows grouped by HF tensor, in table order: one HF tensor per key, its rows (two for a
    fused ``gate_up_proj``: the gate part, then the up part; one otherwise). What a writer of
    the fused layout assembles each tensor from: ``tensor[part] = leaf[index]`` (transposed)."""
    out: dict[str, list[Entry]] = {}
    for ent in table:
        out.setdefault(ent.hf_name, []).append(ent)
    return out


def _per_expert(pre, names, leaves, row, stack, key_of):
    """The per-expert rows of one layer's expert leaves ``[E, in, out]`` each, expert-major."""
    n_exp = leaves[0][1].shape[1]
    order = [(name, d) for name in names for n2, d in leaves if n2 == name]
    for x in range(n_exp):
        for name, d in order:
            inner = d.shape[2:]
            hf = (inner[-1], inner[-2]) if d.hf_transpose else inner
            yield Entry(pre + names[name].replace("{e}", str(x)), key_of(f"{stack}/{name}", d),
                        (row, x), d.hf_transpose, hf)


def fp32_leaves(cfg: Config) -> set[str]:
    """Leaves stored fp32 whatever dtype the other weights get (``--dtype``, a bf16 checkpoint):
    those whose declared type says ``keep_fp32`` -- the router weight and the expert bias, which
    HF keeps fp32 too -- and every buffer."""
    from jaxmoe.model.transformer import model_declarations

    out = set()
    for path, d in model_declarations(cfg).items():
        if getattr(d.kind, "keep_fp32", False) or not d.trained:
            out.add(("params/" if d.trained else "buffers/") + path)
    return out


def leaf_shapes(cfg: Config, table: list[Entry] | None = None) -> dict[str, tuple[int, ...]]:
    """Shape of every jaxmoe leaf ("params/..." / "buffers/..."), derived from the table.

    A leaf's shape is (number of stacked rows, [number of experts], *slice shape).
    """
    table = entries(cfg) if table is None else table
    lead: dict[str, list[int]] = {}
    inner: dict[str, tuple[int, ...]] = {}
    for ent in table:
        if ent.key == ZERO:
            continue
        sizes = lead.setdefault(ent.key, [0] * len(ent.index))
        for ax, i in enumerate(ent.index):
            sizes[ax] = max(sizes[ax], i + 1)
        inner[ent.key] = ent.jax_shape
    return {k: tuple(lead[k]) + inner[k] for k in lead}


def leaf_entries(cfg: Config, table: list[Entry] | None = None) -> dict[str, list[Entry]]:
    """Rows grouped by jaxmoe leaf, in table order (what one leaf read/write touches).

    ZERO rows (HF-only tensors) belong to no leaf and are left out."""
    table = entries(cfg) if table is None else table
    groups: dict[str, list[Entry]] = {}
    for ent in table:
        if ent.key == ZERO:
            continue
        groups.setdefault(ent.key, []).append(ent)
    return groups


def without_absent_mtp(cfg: Config, names) -> str | None:
    """A config whose ``model.mtp_layers > 0`` read from a checkpoint holding no tensor of any MTP
    layer (transformers' DeepseekV3 writes ``num_nextn_predict_layers = 1`` but builds no MTP
    layer): set ``mtp_layers = 0`` in place and return the note saying so; else None."""
    n = cfg.model.n_layers
    if cfg.model.mtp_layers == 0 or any((hf_layer_index(x) or 0) >= n for x in names):
        return None
    was, cfg.model.mtp_layers = cfg.model.mtp_layers, 0
    return (f"note: the config says {was} multi-token-prediction layers (num_nextn_predict_layers) but "
            "the checkpoint holds none: reading it with model.mtp_layers=0")


def mtp_mismatch(cfg: Config, missing: list[str], beyond: dict[int, int]) -> str | None:
    """The one line for a checkpoint whose multi-token-prediction layers do not match
    ``model.mtp_layers``: ``beyond`` = {HF layer past the config's MTP depths: tensor count},
    ``missing`` = the expected tensor names the checkpoint lacks. None when they match."""
    n_main, n_mtp = cfg.model.n_layers, cfg.model.mtp_layers
    if beyond:
        layers = ", ".join(f"model.layers.{i}.*" for i in sorted(beyond))
        return (f"the checkpoint has multi-token-prediction layers {layers} ({sum(beyond.values())} "
                f"tensors) but model.mtp_layers={n_mtp}: set model.mtp_layers={max(beyond) - n_main + 1} "
                "(config.json num_nextn_predict_layers)")
    absent = sorted({hf_layer_index(n) for n in missing} - {None})
    if n_mtp and absent and absent[0] >= n_main:  # only MTP layers missing: say how many exist
        have = absent[0] - n_main
        return (f"model.mtp_layers={n_mtp} but the checkpoint has {have} multi-token-prediction "
                f"layers: set model.mtp_layers={have}")
    return None


def hf_layer_index(name: str) -> int | None:
    """``model.layers.{i}.…`` -> i, else None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


__all__ = ["ZERO", "Entry", "IGNORED_SUFFIXES", "check_supported", "detect_entries", "entries", "fp32_leaves",
           "flatten", "hf_layer_index", "leaf_entries", "mtp_mismatch", "without_absent_mtp", "leaf_shapes",
           "tensors", "unflatten"]
