"""The HF hub tensor names of each architecture, mapped onto the canonical jaxmoe layout.

One table, built from a :class:`~jaxmoe.config.Config`, drives everything: import (HF -> jaxmoe),
export (jaxmoe -> HF) and the "which tensors must exist, with which shapes" check. Each row
(:class:`Entry`) says: HF tensor ``hf_name`` (shape ``hf_shape``) is the slice ``index`` of the
jaxmoe leaf ``key``, transposed or not.

jaxmoe leaves (docs/LAYOUT.md) are keyed here as ``"params/<path>"`` or ``"buffers/<path>"``:

* layer stacks: HF layer ``i`` is row ``i`` of ``dense/*`` when ``i < first_k_dense``, else row
  ``i - first_k_dense`` of ``moe/*``  -> ``index = (row,)``;
* experts: ``moe/experts/*`` is ``[Lm, E, in, out]``; HF stores one tensor per expert
  -> ``index = (row, e)``;
* linear weights: HF ``[out, in]``, jaxmoe ``[in, out]`` -> ``transpose=True`` (norms, the
  embedding ``[V, D]`` and the expert bias are not transposed);
* tied embeddings: no ``lm_head.weight`` row at all.

Per architecture (names verified against transformers 5.x ``save_pretrained`` output):

=============  ==========================================  =========================================
               qwen3_moe / deepseek_v3                     mixtral
=============  ==========================================  =========================================
router         ``mlp.gate.weight``                         ``block_sparse_moe.gate.weight``
experts        ``mlp.experts.{e}.{gate,up,down}_proj``     ``block_sparse_moe.experts.{e}.{w1,w3,w2}``
shared         ``mlp.shared_experts.*`` (deepseek_v3)      --
expert bias    ``mlp.gate.e_score_correction_bias`` (ds)   --
dense FFN      ``mlp.{gate,up,down}_proj``                 --
=============  ==========================================  =========================================

Attention: GQA ``self_attn.{q,k,v,o}_proj`` (+ ``q_norm``/``k_norm``); MLA ``self_attn.q_proj`` or
``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``. The MLA output orders in LAYOUT.md are HF's, so no permutation is
needed; interleaved RoPE is a forward-time choice (config ``rope_layout``), not a weight layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxmoe.config import Config
from jaxmoe.errors import UserError

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
ZERO = ""  # Entry.key of HF-only tensors that must be zero (see Entry)

# HF names that are not weights and may be ignored on import (old checkpoints carry them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Entry:
    """One HF tensor: ``hf_name`` [hf_shape] == leaf ``key`` at ``index`` (transposed if asked)."""

    hf_name: str
    # "params/moe/experts/gate_proj", "buffers/moe/expert_bias", ...; ZERO for an HF tensor that
    # jaxmoe does not hold and that must be all zeros (written as zeros, checked on import)
    key: str
    index: tuple[int, ...]  # position in the leaf's leading (stack, expert) axes; () = whole leaf
    transpose: bool
    hf_shape: tuple[int, ...]

    @property
    def jax_shape(self) -> tuple[int, ...]:
        """Shape of the slice ``leaf[index]`` (the HF tensor, transposed back when needed)."""
        return tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape


def check_supported(cfg: Config) -> None:
    """Raise UserError if ``cfg`` cannot be expressed in its HF architecture's layout."""
    m, e = cfg.model, cfg.moe
    arch = m.hf_arch
    if arch not in ARCHS:
        raise UserError(f"model.hf_arch={arch!r}: no HF mapping; choose one of {', '.join(ARCHS)}")
    if arch in ("qwen3_moe", "mixtral") and m.attention != "gqa":
        raise UserError(f"model.hf_arch={arch} needs model.attention='gqa' (got {m.attention!r})")
    if arch == "deepseek_v3" and m.attention != "mla":
        raise UserError(f"model.hf_arch=deepseek_v3 needs model.attention='mla' (got {m.attention!r})")
    if arch in ("qwen3_moe", "mixtral") and e.n_shared_experts:
        raise UserError(f"model.hf_arch={arch} has no shared experts; set moe.n_shared_experts=0 "
                        "or use hf_arch=deepseek_v3")
    if arch in ("qwen3_moe", "mixtral") and e.use_expert_bias:
        raise UserError(f"model.hf_arch={arch} has no expert bias; set moe.use_expert_bias=false")
    if arch == "mixtral" and m.first_k_dense:
        raise UserError("model.hf_arch=mixtral has no dense layers; set model.first_k_dense=0")
    if arch == "mixtral" and m.qk_norm:
        raise UserError("model.hf_arch=mixtral has no QK-norm; set model.qk_norm=false")


def _attention(cfg: Config, pre: str, stack: str, row: int):
    """Rows for one layer's attention (HF prefix ``pre`` = "model.layers.{i}.")."""
    m = cfg.model
    a = f"params/{stack}/attn/"
    d, h = m.d_model, m.n_heads
    if m.attention == "gqa":
        hd, kv = m.head_dim, m.n_kv_heads
        yield Entry(pre + "self_attn.q_proj.weight", a + "q_proj", (row,), True, (h * hd, d))
        yield Entry(pre + "self_attn.k_proj.weight", a + "k_proj", (row,), True, (kv * hd, d))
        yield Entry(pre + "self_attn.v_proj.weight", a + "v_proj", (row,), True, (kv * hd, d))
        yield Entry(pre + "self_attn.o_proj.weight", a + "o_proj", (row,), True, (d, h * hd))
        if m.qk_norm:
            yield Entry(pre + "self_attn.q_norm.weight", a + "q_norm", (row,), False, (hd,))
            yield Entry(pre + "self_attn.k_norm.weight", a + "k_norm", (row,), False, (hd,))
        return
    qh = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank > 0:
        r = m.q_lora_rank
        yield Entry(pre + "self_attn.q_a_proj.weight", a + "q_a_proj", (row,), True, (r, d))
        yield Entry(pre + "self_attn.q_a_layernorm.weight", a + "q_a_norm", (row,), False, (r,))
        yield Entry(pre + "self_attn.q_b_proj.weight", a + "q_b_proj", (row,), True, (h * qh, r))
    else:
        yield Entry(pre + "self_attn.q_proj.weight", a + "q_proj", (row,), True, (h * qh, d))
    c, rope = m.kv_lora_rank, m.qk_rope_head_dim
    yield Entry(pre + "self_attn.kv_a_proj_with_mqa.weight", a + "kv_a_proj", (row,), True,
                (c + rope, d))
    yield Entry(pre + "self_attn.kv_a_layernorm.weight", a + "kv_a_norm", (row,), False, (c,))
    yield Entry(pre + "self_attn.kv_b_proj.weight", a + "kv_b_proj", (row,), True,
                (h * (m.qk_nope_head_dim + m.v_head_dim), c))
    yield Entry(pre + "self_attn.o_proj.weight", a + "o_proj", (row,), True, (d, h * m.v_head_dim))


def _swiglu(pre: str, key: str, index: tuple, d: int, f: int, names=("gate_proj", "up_proj",
                                                                    "down_proj")):
    """gate/up [f, d] and down [d, f] in HF orientation."""
    g, u, dn = names
    yield Entry(f"{pre}{g}.weight", key + "gate_proj", index, True, (f, d))
    yield Entry(f"{pre}{u}.weight", key + "up_proj", index, True, (f, d))
    yield Entry(f"{pre}{dn}.weight", key + "down_proj", index, True, (d, f))


def entries(cfg: Config) -> list[Entry]:
    """Every HF tensor of ``cfg`` in hub order (embed, layers 0.., norm, lm_head)."""
    check_supported(cfg)
    m, e = cfg.model, cfg.moe
    d = m.d_model
    arch = m.hf_arch
    out = [Entry("model.embed_tokens.weight", "params/embed", (), False, (m.vocab_size, d))]
    for i in range(m.n_layers):
        pre = f"model.layers.{i}."
        stack, row = ("dense", i) if i < m.first_k_dense else ("moe", i - m.first_k_dense)
        out.append(Entry(pre + "input_layernorm.weight", f"params/{stack}/attn_norm", (row,),
                         False, (d,)))
        out.extend(_attention(cfg, pre, stack, row))
        out.append(Entry(pre + "post_attention_layernorm.weight", f"params/{stack}/ffn_norm",
                         (row,), False, (d,)))
        if stack == "dense":
            out.extend(_swiglu(pre + "mlp.", "params/dense/mlp/", (row,), d, m.dense_ffn_dim))
            continue
        moe = pre + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        out.append(Entry(moe + "gate.weight", "params/moe/router", (row,), True, (e.n_experts, d)))
        if arch == "deepseek_v3":
            # HF DeepSeek-V3 always has the selection bias; without use_expert_bias it is zero.
            out.append(Entry(moe + "gate.e_score_correction_bias",
                             "buffers/moe/expert_bias" if e.use_expert_bias else ZERO,
                             (row,), False, (e.n_experts,)))
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for x in range(e.n_experts):
            out.extend(_swiglu(f"{moe}experts.{x}.", "params/moe/experts/", (row, x), d,
                               e.expert_ffn_dim, names))
        if e.n_shared_experts:
            out.extend(_swiglu(moe + "shared_experts.", "params/moe/shared/", (row,), d,
                               e.n_shared_experts * e.expert_ffn_dim))
    out.append(Entry("model.norm.weight", "params/final_norm", (), False, (d,)))
    if not m.tie_embeddings:
        out.append(Entry("lm_head.weight", "params/lm_head", (), True, (m.vocab_size, d)))
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


def hf_layer_index(name: str) -> int | None:
    """``model.layers.{i}.…`` -> i, else None."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a/b/c": leaf}."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, path))
        else:
            out[path] = v
    return out


def unflatten(flat: dict) -> dict:
    """{"a/b/c": leaf} -> nested dict."""
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return tree


__all__ = ["ARCHS", "ZERO", "Entry", "IGNORED_SUFFIXES", "check_supported", "entries", "flatten",
           "hf_layer_index", "leaf_entries", "leaf_shapes", "unflatten"]
