"""torchtitan native tensor names <-> the canonical jaxmoe layout: ONE table per config.

torchtitan (0.3.0) names its tensors without a ``model.`` prefix and keeps the routed experts
stacked ``[E, ...]``: ``tok_embeddings.weight``, ``layers.N.attention.{wq | wq_a, q_norm, wq_b},
wkv_a, kv_norm, wkv_b, wo}.weight`` (MLA), ``layers.N.attention.qkv_linear.wqkv.weight`` +
``q_norm`` / ``k_norm`` + ``wo`` (GQA, Qwen3's fused QKV), ``layers.N.{attention_norm, ffn_norm}``,
``layers.N.feed_forward.w{1,2,3}`` (dense layers), ``layers.N.moe.router.gate.weight``,
``layers.N.moe.routed_experts.inner_experts.{w1_EFD, w2_EDF, w3_EFD}`` ``[E, F, D] / [E, D, F]``,
``layers.N.moe.shared_experts.w{1,2,3}.weight``, the buffer ``layers.N.moe.expert_bias_E``,
``norm.weight`` and ``lm_head.weight``. Linear weights are ``[out, in]`` (w1 = gate, w3 = up,
w2 = down); jaxmoe stores ``[in, out]`` (and ``[L, E, in, out]`` for experts).

Each row (:class:`TitanEntry`) says: torchtitan tensor ``name`` (shape ``shape``) -- or, for the
fused ``wqkv``, its ``q``/``k``/``v`` rows -- is ``leaf[index]`` of the jaxmoe leaf ``key``
(``"params/<path>"`` / ``"buffers/<path>"``), with its last two dims swapped when ``transpose``.

Pure Python + numpy (no jax, no torch): the parity side (parity.titan_side) names every gradient
with it, and a reader of torchtitan's DCP checkpoints can use the same rows. The table is built
from the config alone; tests/test_titan.py checks that it covers exactly the model's declared
leaves, shape for shape.

``wqkv`` layout (torchtitan ``FusedQKVLinear``): rows ``[n_kv, R, head_dim]`` with
``R = n_heads / n_kv + 2``: per KV group, its query heads, then its key head, then its value head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmoe.config import Config
from jaxmoe.trees import flatten

# jaxmoe leaf path (inside a layer stack) -> torchtitan name inside ``layers.N.``
LAYER_NAMES = {
    "attn_norm": "attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    # MLA
    "attn/q_proj": "attention.wq.weight",
    "attn/q_a_proj": "attention.wq_a.weight",
    "attn/q_a_norm": "attention.q_norm.weight",
    "attn/q_b_proj": "attention.wq_b.weight",
    "attn/kv_a_proj": "attention.wkv_a.weight",
    "attn/kv_a_norm": "attention.kv_norm.weight",
    "attn/kv_b_proj": "attention.wkv_b.weight",
    "attn/o_proj": "attention.wo.weight",
    # GQA (q/k/v are row groups of one fused tensor; see the module doc)
    "attn/q_norm": "attention.q_norm.weight",
    "attn/k_norm": "attention.k_norm.weight",
    # dense FFN
    "mlp/gate_proj": "feed_forward.w1.weight",
    "mlp/up_proj": "feed_forward.w3.weight",
    "mlp/down_proj": "feed_forward.w2.weight",
    # MoE
    "router": "moe.router.gate.weight",
    "expert_bias": "moe.expert_bias_E",
    "experts/gate_proj": "moe.routed_experts.inner_experts.w1_EFD",
    "experts/up_proj": "moe.routed_experts.inner_experts.w3_EFD",
    "experts/down_proj": "moe.routed_experts.inner_experts.w2_EDF",
    "shared/gate_proj": "moe.shared_experts.w1.weight",
    "shared/up_proj": "moe.shared_experts.w3.weight",
    "shared/down_proj": "moe.shared_experts.w2.weight",
}
WQKV = "attention.qkv_linear.wqkv.weight"
# what a state dict (so every torchtitan checkpoint) holds instead of wqkv: FusedQKVLinear's
# state-dict hooks split it into stock wq/wk/wv on save (and merge them on load)
SPLIT_QKV = {"q": "attention.qkv_linear.wq.weight", "k": "attention.qkv_linear.wk.weight",
             "v": "attention.qkv_linear.wv.weight"}
GLOBAL_NAMES = {"embed": "tok_embeddings.weight", "final_norm": "norm.weight", "lm_head": "lm_head.weight"}


@dataclass(frozen=True)
class TitanEntry:
    """torchtitan tensor ``name`` [shape] (or its ``qkv`` rows) == jaxmoe leaf ``key`` at ``index``."""

    name: str
    key: str  # "params/moe/experts/gate_proj", "buffers/moe/expert_bias", ...
    index: tuple[int, ...]  # row of the layer stack; () = a whole global leaf
    transpose: bool  # last two dims swapped between torchtitan and jaxmoe
    shape: tuple[int, ...]  # the whole torchtitan tensor
    qkv: str | None = None  # "q" | "k" | "v": these row groups of the fused wqkv
    n_kv: int = 0  # wqkv only: KV groups, query heads per group, head width
    per_kv: int = 0
    head_dim: int = 0

    @property
    def part_shape(self) -> tuple[int, ...]:
        """torchtitan shape of what this row covers (the whole tensor, or its q/k/v rows)."""
        return self.shape if self.qkv is None else (len(self.rows()), self.shape[1])

    @property
    def jax_shape(self) -> tuple[int, ...]:
        s = self.part_shape
        return s[:-2] + (s[-1], s[-2]) if self.transpose else s

    def rows(self) -> np.ndarray:
        """wqkv: indices of this part's rows in the fused tensor, in jaxmoe's head order."""
        r, hd = self.per_kv + 2, self.head_dim
        grid = np.arange(self.n_kv * r * hd).reshape(self.n_kv, r, hd)
        sl = {"q": slice(0, self.per_kv), "k": slice(self.per_kv, self.per_kv + 1),
              "v": slice(self.per_kv + 1, r)}[self.qkv]
        return grid[:, sl].reshape(-1)


def _layer_leaves(cfg: Config, stack: str) -> list[tuple[str, tuple[int, ...]]]:
    """(path inside the stack, jaxmoe slice shape per layer) of one layer stack, in titan order."""
    m, e = cfg.model, cfg.moe
    d = m.d_model
    out = [("attn_norm", (d,)), ("ffn_norm", (d,))]
    if m.attention == "mla":
        qh = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            out += [("attn/q_a_proj", (d, m.q_lora_rank)), ("attn/q_a_norm", (m.q_lora_rank,)),
                    ("attn/q_b_proj", (m.q_lora_rank, m.n_heads * qh))]
        else:
            out += [("attn/q_proj", (d, m.n_heads * qh))]
        out += [("attn/kv_a_proj", (d, m.kv_lora_rank + m.qk_rope_head_dim)),
                ("attn/kv_a_norm", (m.kv_lora_rank,)),
                ("attn/kv_b_proj", (m.kv_lora_rank, m.n_heads * (m.qk_nope_head_dim + m.v_head_dim))),
                ("attn/o_proj", (m.n_heads * m.v_head_dim, d))]
    else:
        hd = m.head_dim
        out += [("attn/q_proj", (d, m.n_heads * hd)), ("attn/k_proj", (d, m.n_kv_heads * hd)),
                ("attn/v_proj", (d, m.n_kv_heads * hd)), ("attn/o_proj", (m.n_heads * hd, d))]
        if m.qk_norm:
            out += [("attn/q_norm", (hd,)), ("attn/k_norm", (hd,))]
    if stack == "dense":
        f = m.dense_ffn_dim
        out += [("mlp/gate_proj", (d, f)), ("mlp/up_proj", (d, f)), ("mlp/down_proj", (f, d))]
        return out
    n, f = e.n_experts, e.expert_ffn_dim
    out += [("router", (d, n))]
    if e.use_expert_bias:
        out += [("expert_bias", (n,))]
    out += [("experts/gate_proj", (n, d, f)), ("experts/up_proj", (n, d, f)), ("experts/down_proj", (n, f, d))]
    if e.n_shared_experts > 0:
        s = e.n_shared_experts * f
        out += [("shared/gate_proj", (d, s)), ("shared/up_proj", (d, s)), ("shared/down_proj", (s, d))]
    return out


def _swap(shape):
    return shape[:-2] + (shape[-1], shape[-2])


def titan_entries(cfg: Config, split_qkv: bool = False) -> list[TitanEntry]:
    """Every torchtitan tensor of ``cfg`` (``tok_embeddings``, layers 0.., ``norm``, ``lm_head``):
    the module's parameters, or with ``split_qkv`` its *state dict* (what checkpoints hold),
    where a GQA layer's fused ``wqkv`` is three tensors ``wq`` / ``wk`` / ``wv`` -- the rows
    :meth:`TitanEntry.rows` picks, in that order (torchtitan ``FusedQKVLinear._split_qkv_on_save``)."""
    m = cfg.model
    if m.mtp_layers > 0:  # never drop the MTP depths silently (their torchtitan names: issue 39 d)
        from jaxmoe.errors import UserError

        raise UserError(f"model.mtp_layers={m.mtp_layers}: the torchtitan (dcp:) name map has no "
                        "multi-token-prediction layers yet; use hf:, orbax: or torch:")
    out = [TitanEntry(GLOBAL_NAMES["embed"], "params/embed", (), False, (m.vocab_size, m.d_model))]
    stacks = ([("dense", 0, m.first_k_dense)] if m.first_k_dense else []) + \
        ([("moe", m.first_k_dense, m.n_moe_layers)] if m.n_moe_layers else [])
    for stack, first, n in stacks:
        leaves = _layer_leaves(cfg, stack)
        for row in range(n):
            pre = f"layers.{first + row}."
            for path, jshape in leaves:
                kind = "buffers/" if path == "expert_bias" else "params/"
                key = f"{kind}{stack}/{path}"
                if path in ("attn/q_proj", "attn/k_proj", "attn/v_proj") and m.attention == "gqa":
                    hd, kv = m.head_dim, m.n_kv_heads
                    full = ((m.n_heads + 2 * kv) * hd, m.d_model)
                    part = path[-6]
                    if split_qkv:
                        heads = m.n_heads if part == "q" else kv
                        out.append(TitanEntry(pre + SPLIT_QKV[part], key, (row,), True, (heads * hd, m.d_model)))
                        continue
                    out.append(TitanEntry(pre + WQKV, key, (row,), True, full, part, n_kv=kv,
                                         per_kv=m.n_heads // kv, head_dim=hd))
                    continue
                transpose = len(jshape) >= 2
                out.append(TitanEntry(pre + LAYER_NAMES[path], key, (row,), transpose,
                                      _swap(jshape) if transpose else jshape))
    out.append(TitanEntry(GLOBAL_NAMES["final_norm"], "params/final_norm", (), False, (m.d_model,)))
    if not m.tie_embeddings:
        out.append(TitanEntry(GLOBAL_NAMES["lm_head"], "params/lm_head", (), True, (m.vocab_size, m.d_model)))
    return out


def leaf_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Shape of every jaxmoe leaf the table covers (stack rows first), from the table alone."""
    rows: dict[str, int] = {}
    inner: dict[str, tuple[int, ...]] = {}
    for ent in titan_entries(cfg):
        if ent.index:
            rows[ent.key] = max(rows.get(ent.key, 0), ent.index[0] + 1)
        inner[ent.key] = ent.jax_shape
    return {k: ((rows[k],) if k in rows else ()) + s for k, s in inner.items()}


def jax_part(tensor: np.ndarray, ent: TitanEntry) -> np.ndarray:
    """The jaxmoe slice of one torchtitan tensor (its q/k/v rows for wqkv), as a view where it can be."""
    a = tensor[ent.rows()] if ent.qkv else tensor
    return np.swapaxes(a, -1, -2) if ent.transpose else a


def titan_part(leaf_slice: np.ndarray, ent: TitanEntry) -> np.ndarray:
    """The torchtitan tensor (or, for wqkv, its q/k/v rows) of one jaxmoe leaf slice
    ``leaf[ent.index]``: :func:`jax_part` inverted."""
    return np.swapaxes(leaf_slice, -1, -2) if ent.transpose else leaf_slice


def to_titan(cfg: Config, params, buffers=None, *, with_buffers: bool = True) -> dict[str, np.ndarray]:
    """jaxmoe params/buffers (nested dicts) -> {torchtitan name: fp32 numpy array}.

    Same call as :func:`parity.sides.to_hf` (so it can name a side's gradients); with
    ``with_buffers=False`` the expert-bias rows are skipped."""
    flat = {"params/" + k: v for k, v in flatten(params).items()}
    if buffers:
        flat.update({"buffers/" + k: v for k, v in flatten(buffers).items()})
    cache: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for ent in titan_entries(cfg):
        if ent.key.startswith("buffers/") and not with_buffers:
            continue
        if ent.key not in cache:
            cache[ent.key] = np.asarray(flat[ent.key], dtype=np.float32)
        a = cache[ent.key][ent.index] if ent.index else cache[ent.key]
        a = np.swapaxes(a, -1, -2) if ent.transpose else a
        if ent.qkv:
            full = out.setdefault(ent.name, np.zeros(ent.shape, np.float32))
            full[ent.rows()] = a
        else:
            out[ent.name] = np.ascontiguousarray(a)
    return out


def from_titan(cfg: Config, tensors: dict, split_qkv: bool = False) -> dict[str, np.ndarray]:
    """{torchtitan name: array} -> {"params/..." / "buffers/...": stacked fp32 leaf} (a state
    dict's names with ``split_qkv``, see :func:`titan_entries`).

    Every tensor of the table must be present with its shape (one line naming the first that is
    not); tensors the table does not know are left out (e.g. ``tokens_per_expert_E``)."""
    from jaxmoe.errors import UserError

    shapes = leaf_shapes(cfg)
    out = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for ent in titan_entries(cfg, split_qkv):
        if ent.name not in tensors:
            raise UserError(f"torchtitan tensor {ent.name} is missing (config {cfg.model.name})")
        t = np.asarray(tensors[ent.name], dtype=np.float32)
        if tuple(t.shape) != ent.shape:
            raise UserError(f"torchtitan tensor {ent.name}: shape {tuple(t.shape)}, the config says {ent.shape}")
        if ent.index:
            out[ent.key][ent.index] = jax_part(t, ent)
        else:
            out[ent.key] = np.ascontiguousarray(jax_part(t, ent))
    return out


__all__ = ["GLOBAL_NAMES", "LAYER_NAMES", "SPLIT_QKV", "TitanEntry", "WQKV", "from_titan", "jax_part", "leaf_shapes",
           "titan_entries", "titan_part", "to_titan"]
