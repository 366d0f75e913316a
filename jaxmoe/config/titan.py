"""From a torchtitan model flavor to a jaxmoe :class:`~jaxmoe.config.Config` (``--from-titan``).

``FAMILY/FLAVOR`` names a torchtitan (0.3.0) model registry entry: ``deepseek_v3/671B``,
``qwen3/30B-A3B``, ``kimi_k2_7/Kimi-K2.5`` (:data:`FAMILIES`). :func:`config_from_titan` reads
the flavor's *config objects* (no model is built): dims, dense layers, experts, top-k, shared
experts, score function, expert groups, ``route_norm`` / ``route_scale``, the expert bias
(``load_balance_coeff``), RoPE (complex = interleaved pairs, cos/sin = half-split) and YaRN with
MLA's ``mscale`` (torchtitan folds ``mscale(f, mscale)^2`` into the softmax scale and leaves the
rotation unscaled: jaxmoe's ``yarn_mscale = yarn_mscale_all_dim = mscale``), and every RMSNorm eps
(torchtitan's default is 1e-5 for all norms incl. MLA's q/kv norms; Qwen3 sets 1e-6).

Every layer must agree (one attention config, one MoE config); anything jaxmoe cannot represent
raises :class:`jaxmoe.errors.UserError` with one line naming the field (a bias on a linear, Llama
RoPE scaling, untruncated YaRN, multi-token-prediction layers, ...). Kimi's vision tower is left
out with a note (:attr:`TitanConfig.notes`); its text tower is mapped. torchtitan's expert bias
(``load_balance_coeff``, 1e-3 by default, on every MoE layer) maps to ``moe.use_expert_bias`` with
``bias_update_rate = load_balance_coeff`` whatever the score function, softmax included.

torchtitan is imported here, lazily: ``jaxmoe config --from-titan`` fails with one line naming
the ``[titan]`` extra when it is missing (:func:`import_titan`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from jaxmoe.config.load import Config, config_from_dict, parse_override, validate
from jaxmoe.errors import UserError

# family -> (torchtitan module, its flavor dict)
FAMILIES = {
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_configs"),
    "kimi_k2_7": ("torchtitan.models.kimi_k2_7", "kimi_k2_5_configs"),
    "qwen3": ("torchtitan.models.qwen3", "qwen3_configs"),
}


@dataclass
class TitanConfig:
    """The mapped config, the torchtitan model config it came from, and notes on what was left out."""

    name: str
    config: Config
    titan: object  # the torchtitan model config (Decoder.Config subclass)
    notes: list[str] = field(default_factory=list)


def import_titan(module: str = "torchtitan"):
    """``import module`` (a torchtitan module) or one line naming the ``[titan]`` extra, whichever
    of its dependencies is missing (torchtitan itself, triton, tyro, spmd_types, torch)."""
    from jaxmoe.extras import hint

    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or module
        raise UserError(hint("torchtitan", "torchtitan (--from-titan, --reference torchtitan)")
                        + f" [import of {missing} failed]") from None


def parse_name(spec: str) -> tuple[str, str]:
    spec = spec.removeprefix("titan:")
    if "/" not in spec:
        raise UserError(f"--from-titan {spec!r}: expected FAMILY/FLAVOR, e.g. deepseek_v3/671B "
                        f"(families: {', '.join(FAMILIES)})")
    family, flavor = spec.split("/", 1)
    if family not in FAMILIES:
        raise UserError(f"torchtitan family {family!r} is not mapped; families: {', '.join(FAMILIES)}")
    return family, flavor


def flavors(family: str) -> list[str]:
    """Every flavor of ``family`` that has MoE layers (the ones jaxmoe maps)."""
    mod, table = FAMILIES[family]
    configs = getattr(import_titan(mod), table)
    out = []
    for name in configs:
        cfg = titan_model_config(f"{family}/{name}")
        if any(getattr(layer, "moe", None) is not None for layer in cfg.layers):
            out.append(name)
    return out


def titan_model_config(spec: str, attn_backend: str = "flex"):
    """The torchtitan model config of ``FAMILY/FLAVOR`` (its registry's ``ModelSpec.model``)."""
    family, flavor = parse_name(spec)
    mod, table = FAMILIES[family]
    m = import_titan(mod)
    if flavor not in getattr(m, table):
        raise UserError(f"torchtitan {family} has no flavor {flavor!r}; flavors: {', '.join(getattr(m, table))}")
    return m.model_registry(flavor, attn_backend=attn_backend).model


def _one(values, what: str):
    """All layers must agree on ``what``."""
    vals = set(values)
    if len(vals) != 1:
        raise UserError(f"{what} differs between layers ({sorted(map(str, vals))}): jaxmoe stacks identical layers")
    return vals.pop()


def _no_bias(lin, where: str) -> None:
    if lin is not None and getattr(lin, "bias", False):
        raise UserError(f"{where}.bias=True: jaxmoe linears have no bias")


def apply_overrides(tc, overrides) -> None:
    """Edit the torchtitan config ``tc`` in place: each ``PATH=VALUE`` sets the attribute ``PATH``
    (dotted, relative to a layer config, e.g. ``moe.router.score_func=sigmoid``) on every layer
    that has it; VALUE is JSON (numbers, true/false/null) or else a string. The parity suite uses
    this to run torchtitan's own router with settings a debug flavor does not have (sigmoid
    scores, expert groups, route_norm, route_scale); the jaxmoe config is then derived from the
    edited config, as from any flavor."""
    import json

    for text in overrides:
        if "=" not in text:
            raise UserError(f"--titan-set {text!r}: expected PATH=VALUE, e.g. moe.router.score_func=sigmoid")
        path, raw = text.split("=", 1)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, last = path.strip().split(".")
        hit = 0
        for layer in tc.layers:
            node = layer
            for part in parents:
                node = getattr(node, part, None)
            if node is not None and hasattr(node, last):
                setattr(node, last, value)
                hit += 1
        if not hit:
            raise UserError(f"--titan-set {text!r}: no layer config has {path.strip()}")


def config_from_titan(spec: str, overrides=()) -> TitanConfig:
    """Map ``FAMILY/FLAVOR`` (after :func:`apply_overrides`) to a validated jaxmoe Config (see
    the module doc)."""
    family, flavor = parse_name(spec)
    tc = titan_model_config(spec)
    apply_overrides(tc, overrides)
    name = f"titan:{family}/{flavor}"
    notes: list[str] = []
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.name, cfg.description = name, f"torchtitan {family} flavor {flavor} (jaxmoe config --from-titan)"
    m.vocab_size, m.d_model, m.n_layers = tc.vocab_size, tc.dim, len(tc.layers)
    if getattr(tc, "mtp_layers", None):
        raise UserError(f"{name}: mtp_layers ({len(tc.mtp_layers)} multi-token-prediction layers): jaxmoe has none")
    if getattr(tc, "vision_encoder", None) is not None:
        notes.append(f"{name}: vision_encoder not mapped (the text tower is)")
    m.tie_embeddings = bool(tc.enable_weight_tying)
    _no_bias(tc.lm_head, "lm_head")
    moe_flags = [layer.moe is not None for layer in tc.layers]
    if not any(moe_flags):
        raise UserError(f"{name}: no MoE layers (a dense flavor): jaxmoe maps MoE flavors")
    m.first_k_dense = moe_flags.index(True)
    if not all(moe_flags[m.first_k_dense:]):
        raise UserError(f"{name}: layers: dense layers after the first MoE layer (jaxmoe: dense layers come first)")
    eps = {tc.norm.eps}
    for i, layer in enumerate(tc.layers):
        eps |= {layer.attention_norm.eps, layer.ffn_norm.eps}
    m.rms_norm_eps = float(_one(eps, "RMSNorm eps (attention_norm / ffn_norm / norm)"))
    _map_attention(tc, m, name)
    dense = [layer.feed_forward for layer in tc.layers[:m.first_k_dense]]
    if dense:
        m.dense_ffn_dim = _one((f.w1.out_features for f in dense), "feed_forward.w1.out_features")
        for f in dense:
            for w in ("w1", "w2", "w3"):
                _no_bias(getattr(f, w), f"feed_forward.{w}")
    _map_moe([layer.moe for layer in tc.layers[m.first_k_dense:]], e, name, notes)
    cfg.train.seq_len = min(cfg.train.seq_len, m.max_seq_len)
    cfg.train.z_loss_coef = 0.0  # torchtitan's loss: summed CE / global valid tokens, nothing else
    map_titan_training(cfg.optim)
    validate(cfg)
    return TitanConfig(name, cfg, tc, notes)


def _map_attention(tc, m, name: str) -> None:
    attns = [layer.attention for layer in tc.layers]
    kind = _one((type(a).__qualname__ for a in attns), "attention config type")
    ropes = [a.rope for a in attns]
    rope_kind = _one((type(r).__qualname__.removesuffix(".Config") for r in ropes), "rope config type")
    r = ropes[0]
    if any(x != r for x in ropes):
        raise UserError(f"{name}: attention.rope differs between layers")
    m.rope_layout = {"ComplexRoPE": "interleaved", "CosSinRoPE": "half"}.get(rope_kind)
    if m.rope_layout is None:
        raise UserError(f"{name}: attention.rope is {rope_kind}: jaxmoe maps ComplexRoPE and CosSinRoPE")
    m.rope_theta, m.max_seq_len = float(r.theta), int(r.max_seq_len)
    yarn = r.scaling == "yarn" and r.rope_factor > 1.0
    if r.scaling == "llama":
        raise UserError(f"{name}: attention.rope.scaling='llama': jaxmoe has no Llama-3 RoPE scaling")
    if yarn:
        if not r.truncate:
            raise UserError(f"{name}: attention.rope.truncate=False (fractional YaRN cut-offs): jaxmoe floors/ceils")
        m.rope_scaling, m.yarn_factor = "yarn", float(r.rope_factor)
        m.yarn_original_max_pos = int(r.original_seq_len)
        m.yarn_beta_fast, m.yarn_beta_slow = float(r.beta_fast), float(r.beta_slow)
    if kind == "Attention.Config" and hasattr(attns[0], "kv_lora_rank"):  # MLA (deepseek_v3.model.Attention)
        a = attns[0]
        m.attention, m.hf_arch = "mla", "deepseek_v3"
        m.n_heads = _one((x.n_heads for x in attns), "attention.n_heads")
        for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            setattr(m, f, _one((getattr(x, f) for x in attns), f"attention.{f}"))
        norms = [x.kv_norm.eps for x in attns] + ([x.q_norm.eps for x in attns] if m.q_lora_rank else [])
        m.mla_norm_eps = float(_one(norms, "attention.q_norm/kv_norm eps"))
        ms = float(_one((x.mscale for x in attns), "attention.mscale"))
        if yarn:  # torchtitan: softmax scale x (0.1 * mscale * ln f + 1)^2, rotation unscaled
            m.yarn_mscale = m.yarn_mscale_all_dim = ms
            m.yarn_attention_factor = 0.0
        for w in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
            for x in attns:
                _no_bias(getattr(x, w), f"attention.{w}")
        if a.rope.dim != m.qk_rope_head_dim:
            raise UserError(f"{name}: attention.rope.dim={a.rope.dim} != qk_rope_head_dim={m.qk_rope_head_dim}")
        return
    if kind != "GQAttention.Config":
        raise UserError(f"{name}: attention config {kind}: jaxmoe maps MLA (Attention) and GQAttention")
    a = attns[0]
    m.attention, m.hf_arch = "gqa", "qwen3_moe"
    m.n_heads = _one((x.n_heads for x in attns), "attention.n_heads")
    m.n_kv_heads = _one((x.n_kv_heads or x.n_heads for x in attns), "attention.n_kv_heads")
    m.head_dim = _one((x.head_dim or tc.dim // x.n_heads for x in attns), "attention.head_dim")
    if yarn:
        raise UserError(f"{name}: attention.rope.scaling='yarn' on GQA attention: not mapped "
                        "(torchtitan leaves cos/sin unscaled; jaxmoe/HF multiply them by mscale(f))")
    qkv = a.qkv_linear
    lins = [getattr(qkv, w) for w in ("wqkv", "wq", "wkv") if getattr(qkv, w, None) is not None]
    for lin in lins + [a.wo]:
        _no_bias(lin, "attention.qkv_linear/wo")
    if type(qkv).__qualname__ != "FusedQKVLinear.Config":
        raise UserError(f"{name}: attention.qkv_linear without a fused wqkv: the titan name map covers "
                        "torchtitan's FusedQKVLinear (Qwen3 MoE flavors)")
    m.qk_norm = a.qk_norm is not None
    if m.qk_norm and a.qk_norm.eps != m.rms_norm_eps:
        raise UserError(f"{name}: attention.qk_norm.eps={a.qk_norm.eps} != the block norms' eps "
                        f"{m.rms_norm_eps} (jaxmoe's q/k norms use model.rms_norm_eps)")


def _map_moe(moes, e, name: str, notes: list[str]) -> None:
    routers = [x.router for x in moes]
    e.n_experts = _one((x.num_experts for x in moes), "moe.num_experts")
    e.top_k = _one((r.top_k for r in routers), "moe.router.top_k")
    e.score_func = _one((r.score_func for r in routers), "moe.router.score_func")
    e.norm_topk_prob = bool(_one((r.route_norm for r in routers), "moe.router.route_norm"))
    e.route_scale = float(_one((r.route_scale for r in routers), "moe.router.route_scale"))
    groups = _one((r.num_expert_groups for r in routers), "moe.router.num_expert_groups")
    limited = _one((r.num_limited_groups for r in routers), "moe.router.num_limited_groups")
    e.n_groups, e.topk_groups = (groups, limited) if groups else (1, 1)
    if any(r._debug_force_load_balance for r in routers):
        raise UserError(f"{name}: moe.router._debug_force_load_balance=True: jaxmoe has no round-robin routing")
    for r in routers:
        _no_bias(r.gate, "moe.router.gate")
    inner = [x.routed_experts.inner_experts for x in moes]
    e.expert_ffn_dim = _one((x.hidden_dim for x in inner), "moe.routed_experts.inner_experts.hidden_dim")
    shared = [x.shared_experts for x in moes]
    if any(s is None for s in shared) and not all(s is None for s in shared):
        raise UserError(f"{name}: moe.shared_experts present in some layers only")
    if shared[0] is None:
        e.n_shared_experts = 0
    else:
        width = _one((s.w1.out_features for s in shared), "moe.shared_experts.w1.out_features")
        if width % e.expert_ffn_dim:
            raise UserError(f"{name}: moe.shared_experts width {width} is not a multiple of the expert width "
                            f"{e.expert_ffn_dim} (jaxmoe: n_shared_experts x expert_ffn_dim)")
        e.n_shared_experts = width // e.expert_ffn_dim
        for s in shared:
            for w in ("w1", "w2", "w3"):
                _no_bias(getattr(s, w), f"moe.shared_experts.{w}")
    coeff = _one((x.load_balance_coeff for x in moes), "moe.load_balance_coeff")
    if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float))):
        raise UserError(f"{name}: moe.load_balance_coeff={coeff!r}: a number or null (--titan-set takes JSON)")
    # torchtitan's expert bias selects on scores + bias for softmax and sigmoid alike; so does jaxmoe's
    if coeff is None:
        e.use_expert_bias = False
    else:
        e.use_expert_bias, e.bias_update_rate = True, float(coeff)
    # torchtitan's losses: summed CE / global valid tokens, no aux losses by default
    e.lb_coef = e.seq_aux_coef = e.router_z_coef = 0.0


def titan_config(spec: str, overrides=(), notes=None) -> Config:
    """The jaxmoe Config of torchtitan's ``FAMILY/FLAVOR`` with ``--set`` overrides on top; what the
    mapping leaves out is appended to ``notes``."""
    tc = config_from_titan(spec)
    if notes is not None:
        notes.extend(tc.notes)
    data: dict = {}
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    return validate(config_from_dict(data, base=tc.config))


def titan_training_defaults() -> dict:
    """torchtitan 0.3.0's training defaults, read from its own objects: ``default_adamw()``'s
    param group (lr, betas, eps, weight decay on every parameter: one catch-all ``.*`` group),
    ``LRSchedulersContainer.Config()`` (warmup, decay_ratio, decay_type, min_lr_factor) and
    ``TrainingConfig().max_norm`` (gradient clipping)."""
    import_titan("torchtitan.components.optimizer")
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import TrainingConfig

    groups = default_adamw().param_groups
    if len(groups) != 1 or groups[0].pattern != r".*" or groups[0].optimizer_name != "AdamW":
        raise UserError("torchtitan's default_adamw() is no longer one AdamW group over every parameter")
    kw = groups[0].optimizer_kwargs
    sched = LRSchedulersContainer.Config()
    return {"lr": float(kw["lr"]), "betas": tuple(kw["betas"]), "eps": float(kw["eps"]),
            "weight_decay": float(kw["weight_decay"]), "warmup_steps": int(sched.warmup_steps),
            "decay_ratio": sched.decay_ratio, "decay_type": sched.decay_type,
            "min_lr_factor": float(sched.min_lr_factor), "max_norm": float(TrainingConfig().max_norm)}


def map_titan_training(t) -> None:
    """Set jaxmoe's optim section (``t``) to torchtitan's defaults (:func:`titan_training_defaults`):
    AdamW with decay on all parameters (``decay_norms`` / ``decay_embeddings`` on), gradient
    clipping, the ``titan_wsd`` schedule (``decay_ratio`` None = 1.0: decay from the end of
    warmup). The expert-bias rule is ``sign_centred`` (the default), torchtitan's pre-hook."""
    d = titan_training_defaults()
    t.optimizer, t.lr = "adamw", d["lr"]
    t.beta1, t.beta2 = d["betas"]
    t.eps, t.weight_decay = d["eps"], d["weight_decay"]
    t.decay_norms = t.decay_embeddings = True
    t.grad_clip = d["max_norm"]
    t.schedule, t.warmup_steps = "titan_wsd", d["warmup_steps"]
    t.titan_decay_ratio = 1.0 if d["decay_ratio"] is None else float(d["decay_ratio"])
    t.titan_decay_type, t.min_lr_ratio = d["decay_type"], d["min_lr_factor"]


def titan_param_count(spec: str) -> int:
    """torchtitan's own parameter count of the text model of ``FAMILY/FLAVOR``, built on the meta
    device (no memory): every parameter except a vision tower's (buffers are not parameters)."""
    import torch  # late: torch (the [ref] extra)

    tc = titan_model_config(spec)
    with torch.device("meta"):
        model = tc.build()
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("vision_encoder."))


__all__ = ["FAMILIES", "TitanConfig", "titan_config", "config_from_titan", "apply_overrides", "flavors", "import_titan",
           "map_titan_training", "parse_name", "titan_model_config", "titan_param_count", "titan_training_defaults"]
