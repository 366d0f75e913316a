"""The comparisons of a parity run: each ``compare_*`` adds checks to one :class:`Checks` list.

* **Routing** (:func:`compare_routing`): index sets per MoE layer (exact; mismatches classified
  as near-ties, by :func:`selection_gap`, or real).
* **Forward** (:func:`compare_forward`): gate weights, counts, dropped tokens and every probe in
  forward order, then the logits (and their KL).
* **Losses** (:func:`compare_losses`): ce, z_loss, lb, seq_aux, router_z, total.
* **Gradients and parameters by HF name** (:func:`compare_named`), and after N optimizer steps
  (:func:`compare_steps`): loss curves, every parameter and the expert biases.
* **First divergence** (:func:`first_divergence`): the earliest check in forward order that fails.
"""

from __future__ import annotations

import math

import numpy as np

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from parity.tolerances import REL_FLOOR, Tolerances

LOSS_KEYS = ("ce", "z_loss", "lb", "seq_aux", "router_z", "loss")


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------


class Checks:
    """The list of checks; each ``{"name", "metric", "value", "tolerance", "passed", ...}``.

    ``order`` (a list of numbers) places forward-pass checks in forward order, for
    :func:`first_divergence`; checks without it come after the forward pass (losses, gradients,
    steps)."""

    def __init__(self):
        self.items: list[dict] = []

    def add(self, name, metric, value, tolerance, *, stage, order=None, passed=None, **extra) -> dict:
        value = float(value)
        if passed is None:
            passed = tolerance is None or (math.isfinite(value) and value <= tolerance)
        item = {"name": name, "stage": stage, "metric": metric, "value": value,
                "tolerance": None if tolerance is None else float(tolerance), "passed": bool(passed)}
        if order is not None:
            item["order"] = list(order)
        item.update(extra)
        self.items.append(item)
        return item


def selection_gap(scores: np.ndarray, bias: np.ndarray | None, e) -> np.ndarray:
    """Per token, the smallest selection-score gap at a decision boundary ``[T]`` (float64):
    the k-th minus the (k+1)-th selection score among the experts of the kept groups, and for
    grouped routing also the kept-vs-first-dropped group score. A flip with a gap this small can
    come from rounding alone."""
    s = scores.astype(np.float64)
    t, n = s.shape
    biased = e.use_expert_bias and bias is not None
    sel = s + bias.astype(np.float64)[None] if biased else s
    gap = np.full(t, np.inf)
    if e.n_groups > 1:
        g = sel.reshape(t, e.n_groups, n // e.n_groups)
        gs = np.sort(g, -1)[..., -2:].sum(-1)  # [T, G]
        order = np.argsort(-gs, axis=-1, kind="stable")
        gs_sorted = np.take_along_axis(gs, order, -1)
        if e.topk_groups < e.n_groups:
            gap = np.minimum(gap, gs_sorted[:, e.topk_groups - 1] - gs_sorted[:, e.topk_groups])
        keep = np.zeros((t, e.n_groups), bool)
        np.put_along_axis(keep, order[:, :e.topk_groups], True, -1)
        sel = np.where(np.repeat(keep, n // e.n_groups, -1), sel, -np.inf)
    srt = -np.sort(-sel, -1)
    if e.top_k < n:
        with np.errstate(invalid="ignore"):
            eg = srt[:, e.top_k - 1] - srt[:, e.top_k]
        gap = np.minimum(gap, np.where(np.isfinite(eg), eg, np.inf))
    return gap


def routing_record(moe, idx: np.ndarray, scores: np.ndarray, bias: np.ndarray | None) -> dict:
    """One training step's routing as a side saw it: ``idx [Lm, T, k]`` and each token's decision
    gap ``[Lm, T]`` (:func:`selection_gap` of its own scores and the bias it selected with, under
    the ``moe`` config section), what
    :func:`compare_steps` needs to tell a near-tie flip from a real one."""
    idx = np.asarray(idx).astype(np.int64)
    gap = np.stack([selection_gap(np.asarray(scores[j]).reshape(idx.shape[1], -1),
                                  None if bias is None else np.asarray(bias[j]), moe)
                    for j in range(idx.shape[0])]) if idx.shape[0] else np.zeros((0, idx.shape[1]))
    return {"idx": idx, "gap": gap, "bias": None if bias is None else np.asarray(bias, np.float32)}


def classify_flips(cfg: Config, ji: np.ndarray, ti: np.ndarray, gap_j: np.ndarray, gap_t: np.ndarray,
                   tol: Tolerances) -> list[dict]:
    """Per MoE layer, the tokens whose top-k sets differ (``ji``/``ti`` ``[Lm, T, k]``), each a
    near-tie when the smaller of the two sides' decision gaps (``[Lm, T]``) is <= ``tie_gap``.

    A near-tie flip at one layer changes that token's output, and through causal attention every
    later position of its sequence, so a later layer may then disagree on those tokens by more
    than a near-tie: such a mismatch is counted with the near-ties (as ``downstream``: it has an
    earlier near-tie flip at or before it in its sequence), not as real. Tokens are flattened
    row-major, ``t = b * seq_len + s``."""
    m = cfg.model
    n_tok = ji.shape[1]
    seq = cfg.train.seq_len if cfg.train.seq_len and n_tok % cfg.train.seq_len == 0 else n_tok
    tok = np.arange(n_tok)
    first_flip = np.full(n_tok // seq, seq, np.int64)  # per sequence: earliest near-tie position so far
    layers = []
    for j in range(m.n_moe_layers):
        a, b = np.sort(ji[j], -1), np.sort(ti[j], -1)
        bad = np.nonzero((a != b).any(-1))[0]
        gaps = np.minimum(gap_j[j], gap_t[j])[bad] if len(bad) else np.zeros(0)
        downstream = (tok[bad] % seq) >= first_flip[tok[bad] // seq]
        near = (gaps <= tol.tie_gap) | downstream
        for t in bad[near]:  # later layers: this token and its sequence's later positions may differ
            first_flip[t // seq] = min(first_flip[t // seq], t % seq)
        n_real = int((~near).sum())
        tie_only = near & ~downstream
        layers.append({"layer": m.first_k_dense + j, "mismatched_tokens": int(len(bad)), "near_tie": int(near.sum()),
                       "real": n_real, "downstream": int(downstream.sum()),
                       "max_near_tie_gap": float(gaps[tie_only].max()) if tie_only.any() else None,
                       "min_real_gap": float(gaps[~near].min()) if n_real else None,
                       "tokens": [int(x) for x in bad[:20]]})
    return layers


def compare_routing(cfg: Config, ja: dict, ta: dict, bias: np.ndarray | None, tol: Tolerances,
                    checks: Checks) -> dict:
    """Index sets per MoE layer (:func:`classify_flips`, gaps from each side's scores with the
    shared ``bias``); returns {"near_tie": n, "real": n, "layers": [...]} and adds one
    ``routing[layer]`` check per MoE layer (fails only on real mismatches)."""
    e = cfg.moe
    ji, ti = ja["router"]["topk_idx"].astype(np.int64), ta["router"]["topk_idx"].astype(np.int64)
    gaps = [np.stack([selection_gap(side["router"]["scores"][j], None if bias is None else bias[j], e)
                      for j in range(cfg.model.n_moe_layers)]) if cfg.model.n_moe_layers else np.zeros((0, ji.shape[1]))
            for side in (ja, ta)]
    layers = classify_flips(cfg, ji, ti, gaps[0], gaps[1], tol)
    for info in layers:
        checks.add(f"routing[{info['layer']}]", "tokens with a real (non-near-tie) top-k set mismatch", info["real"], 0,
                   stage="forward", order=(1 + info["layer"], 2), layer=info["layer"], near_tie=info["near_tie"],
                   tokens=int(ji.shape[1]))
    return {"near_tie": sum(i["near_tie"] for i in layers), "real": sum(i["real"] for i in layers), "layers": layers}


def _stats(a: np.ndarray, b: np.ndarray) -> dict:
    """Error of ``a`` (jax) against ``b`` (torch reference), in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    d = np.abs(a - b)
    scale = float(np.abs(b).max()) if b.size else 0.0
    max_abs = float(d.max()) if d.size else 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cos = float((a * b).sum() / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return {"max_abs": max_abs, "max_rel": max_abs / max(scale, REL_FLOOR), "cosine": cos, "scale": scale}


class _NoProbes(dict):
    """The probes of a reference that has none: every lookup (and index) gives this again."""

    def __missing__(self, key):
        return self

    def __getitem__(self, key):
        return self


def compare_forward(cfg: Config, jf: dict, tf: dict, tol: Tolerances, checks: Checks,
                    routing: dict | None = None) -> dict:
    """Gate weights, counts, dropped and every probe, in forward order. Returns per-layer errors
    (for the plot). ``routing``: the :func:`compare_routing` summary of a comparison whose routing
    is *not* replayed (torchtitan's router): each near-tie token (downstream ones included) may
    then move ``2 * top_k`` counts of its layer; without it (a replayed or flip-free comparison)
    the counts must be equal."""
    m = cfg.model
    jp = jf["aux"]["probes"]
    tp = tf["aux"].get("probes") or _NoProbes()
    ja, ta = jf["aux"], tf["aux"]
    layers: dict = {"attn_out": {}, "moe_out": {}, "ffn_out": {}}

    def probe(name, a, b, order, layer=None, kind=None):
        if isinstance(b, _NoProbes):  # a reference without activation probes (transformers)
            return
        st = _stats(a, b)
        checks.add(name, "max|jax-torch| / max|torch|", st["max_rel"], tol.probe_scaled, stage="forward",
                   order=order, layer=layer, max_abs=st["max_abs"], cosine=st["cosine"], scale=st["scale"])
        if kind:
            layers[kind][layer] = st["max_rel"]

    probe("embedding", jp["embedding"], tp["embedding"], (0,))
    for i in range(m.n_layers):
        probe(f"attn_out[{i}]", jp["attn_out"][i], tp["attn_out"][i], (1 + i, 0), i, "attn_out")
        if i < m.first_k_dense:
            probe(f"ffn_out[{i}]", jp["ffn_out"][i], tp["ffn_out"][i], (1 + i, 6), i, "ffn_out")
            continue
        j = i - m.first_k_dense
        probe(f"router_logits[{i}]", ja["router"]["logits"][j], ta["router"]["logits"][j], (1 + i, 1), i)
        # gate weights of tokens whose index sets agree, aligned by expert index
        ji, ti = ja["router"]["topk_idx"][j].astype(np.int64), ta["router"]["topk_idx"][j].astype(np.int64)
        oj, ot = np.argsort(ji, -1, kind="stable"), np.argsort(ti, -1, kind="stable")
        same = (np.take_along_axis(ji, oj, -1) == np.take_along_axis(ti, ot, -1)).all(-1)
        wj = np.take_along_axis(ja["router"]["topk_weights"][j], oj, -1)[same]
        wt = np.take_along_axis(ta["router"]["topk_weights"][j], ot, -1)[same]
        gw = float(np.abs(wj.astype(np.float64) - wt).max()) if wj.size else 0.0
        checks.add(f"router_weights[{i}]", "max |gate weight diff| (tokens with equal index sets)", gw,
                   tol.gate_abs, stage="forward", order=(1 + i, 3), layer=i, tokens=int(same.sum()))
        cd = int(np.abs(ja["counts"][j].astype(np.int64) - ta["counts"][j].astype(np.int64)).sum())
        near = routing["layers"][j]["near_tie"] if routing else 0
        checks.add(f"counts[{i}]", "sum |count diff| over experts" + (" (near-tie tokens may move 2k each)"
                                                                      if near else ""),
                   cd, 2 * cfg.moe.top_k * near, stage="forward", order=(1 + i, 4),
                   layer=i, counts_jax=[int(x) for x in ja["counts"][j]], near_tie_tokens=near)
        dd = abs(int(ja["dropped"][j]) - int(ta["dropped"][j]))
        checks.add(f"dropped[{i}]", "|dropped diff|", dd, 0, stage="forward", order=(1 + i, 5), layer=i,
                   dropped_jax=int(ja["dropped"][j]), dropped_torch=int(ta["dropped"][j]))
        probe(f"moe_out[{i}]", jp["moe_out"][j], tp["moe_out"][j], (1 + i, 6), i, "moe_out")
    probe("final_hidden", jp["final_hidden"], tp["final_hidden"], (m.n_layers + 1, 0))
    lj, lt = jf["logits"].astype(np.float64), tf["logits"].astype(np.float64)
    st = _stats(lj, lt)
    order = (m.n_layers + 2, 0)
    if tol.logits_abs is not None:
        checks.add("logits", "max |jax-torch|", st["max_abs"], tol.logits_abs, stage="forward", order=order,
                   max_rel=st["max_rel"], cosine=st["cosine"])
    else:
        checks.add("logits", "max|jax-torch| / max|torch|", st["max_rel"], tol.probe_scaled, stage="forward",
                   order=order, max_abs=st["max_abs"], cosine=st["cosine"])
    kl = _kl(lt, lj)
    checks.add("logits_kl", "mean_t KL(torch || jax)", kl.mean(), tol.logits_kl, stage="forward",
               order=(m.n_layers + 2, 1), max=float(kl.max()))
    return layers


def _kl(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Per-token KL(softmax(ref) || softmax(out)) in float64, [N]."""
    ref = ref.reshape(-1, ref.shape[-1])
    out = out.reshape(-1, out.shape[-1])
    lp = ref - _lse(ref)
    lq = out - _lse(out)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0)


def _lse(x: np.ndarray) -> np.ndarray:
    mx = x.max(-1, keepdims=True)
    return mx + np.log(np.exp(x - mx).sum(-1, keepdims=True))


def _rel(a: float, b: float) -> float:
    """|a - b| / max(|b|, REL_FLOOR) (see parity.tolerances on the floor)."""
    return abs(a - b) / max(abs(b), REL_FLOOR)


def compare_losses(jl: dict, tl: dict, tol: Tolerances, checks: Checks, keys=LOSS_KEYS, figures=()) -> None:
    """Each loss in ``keys``; those in ``figures`` are reported, not checked."""
    for k in list(keys) + [f for f in figures if f in jl and f in tl]:
        checks.add(f"loss:{k}", "|jax-ref| / |ref|", _rel(jl[k], tl[k]), None if k in figures else tol.loss_rel,
                   stage="loss", jax=jl[k], torch=tl[k])


def _rel_l2(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    a, b = a.astype(np.float64), b.astype(np.float64)
    diff = np.linalg.norm(a - b)
    nb = np.linalg.norm(b)
    return diff / max(nb, REL_FLOOR), float(np.abs(a - b).max()) if a.size else 0.0


def compare_named(prefix: str, ja: dict, ta: dict, tolerance: float | None, checks: Checks, stage: str,
                  **extra) -> dict:
    """Relative L2 per HF name; every name must exist on both sides with the same shape
    (``tolerance`` None: figures; ``extra`` is recorded with each check)."""
    worst = {}
    if set(ja) != set(ta):
        only_j, only_t = sorted(set(ja) - set(ta)), sorted(set(ta) - set(ja))
        checks.add(f"{prefix}:names", "parameters present on one side only", len(only_j) + len(only_t), 0,
                   stage=stage, only_jax=only_j[:10], only_torch=only_t[:10])
    for name in ta:
        if name not in ja:
            continue
        if ja[name].shape != ta[name].shape:
            checks.add(f"{prefix}:{name}", "shape mismatch", 1, 0, stage=stage, passed=False,
                       jax_shape=list(ja[name].shape), torch_shape=list(ta[name].shape))
            continue
        r, mx = _rel_l2(ja[name], ta[name])
        checks.add(f"{prefix}:{name}", "||jax-torch|| / ||torch||", r, tolerance, stage=stage, max_abs=mx,
                   norm=float(np.linalg.norm(ta[name].astype(np.float64))), **extra)
        worst[name] = r
    return worst


def _flips(cfg: Config, jt: dict, tt: dict) -> list[tuple[int, int, int]]:
    """(step, moe layer j, expert) wherever the two sides' expert counts differ."""
    out = []
    for i, (cj, ct) in enumerate(zip(jt["counts"], tt["counts"])):
        if cj.shape == ct.shape:
            out += [(i, int(j), int(ex)) for j, ex in zip(*np.nonzero(cj != ct))]
    return out


def _flipped_names(cfg: Config, names, flips) -> set[str]:
    """HF names of the experts whose counts differed and of the routers of their layers; with
    torchtitan names (``layers.N.``, no ``model.`` prefix) the layer's stacked expert tensors
    (``moe.routed_experts.*``, all experts in one) and its router."""
    m = cfg.model
    pre = set()
    if any(n.startswith("layers.") for n in names):
        for _, j, _ex in flips:
            layer = f"layers.{m.first_k_dense + j}.moe."
            pre |= {layer + "routed_experts.", layer + "router."}
        return {n for n in names if any(n.startswith(p) for p in pre)}
    arch = get_arch(m.hf_arch).names("per-expert")
    for _, j, ex in flips:
        layer = f"model.layers.{m.first_k_dense + j}."
        pre.add(layer + arch["experts/gate_proj"].split("{e}")[0] + f"{ex}.")
        pre.add(layer + arch["router"])
    return {n for n in names if any(n.startswith(p) for p in pre)}


def parting_step(cfg: Config, jt: dict, tt: dict, tol: Tolerances) -> tuple[int, list[dict]] | None:
    """The first training step at which a token's top-k set differs between the sides, with its
    flips classified (:func:`classify_flips`), from the per-step ``routing`` records
    (:func:`routing_record`); None when the routing never differs."""
    for i, (a, b) in enumerate(zip(jt["routing"], tt["routing"])):
        if a["idx"].shape == b["idx"].shape and (np.sort(a["idx"], -1) != np.sort(b["idx"], -1)).any():
            return i, classify_flips(cfg, a["idx"], b["idx"], a["gap"], b["gap"], tol)
    return None


def compare_steps(cfg: Config, jt: dict, tt: dict, bias0, n_steps: int, tol: Tolerances, checks: Checks,
                  params0: dict | None = None, forced: dict | None = None) -> None:
    """The N optimizer steps, checked in the order things happen (so that
    :func:`first_divergence` names the first wrong tensor of the first wrong update):

    1. ``step_loss[0]`` (before any update);
    2. ``update[1]:NAME`` for every parameter: the first update, ``p1 - p0``, relative L2
       (``update_rel_l2``) -- an optimizer fault (bias correction, weight-decay mask, Muon
       orientation) shows here, on the tensor it touches, long before it moves a parameter by
       much; then ``expert_bias[1]`` (the balance update after step 1);
    3. ``step_loss[1..N-1]``, and before the loss of the first step whose routing differs,
       ``step_routing[s]``: that step's flips classified like the forward's
       (:func:`classify_flips`, each side's decision gap from its own scores and bias at that
       step); a real (non-near-tie) flip fails here;
    4. ``step_routing``: routing flips during training, *by count*: the fraction of assignments
       whose expert differs (sum over steps and layers of ``|counts_jax - counts_torch| / 2`` over
       all assignments) must stay within ``step_flip_frac``;
    5. ``stepN_param:NAME``: every parameter whose expert never flipped, tightly
       (``step_param_rel_l2``); the experts whose counts differed and their layer's router are
       reported as figures (tolerance None: their difference is explained by the flips counted
       in 4); ``stepN_expert_bias`` (one extra sign update allowed per flipped step).

    **Parting at a near-tie.** When the first differing step ``s`` holds near-tie flips only, the
    two runs are two trajectories from then on: one token took another expert for a reason
    rounding alone explains (a selection or group-score gap <= ``tie_gap``), its count moves the
    expert bias by a sign step and the optimizer's normalised update moves that expert's weights by
    O(lr), which moves other tokens' routing later. Every check of a state from step ``s`` on (the
    losses from ``s``, the flip count, the parameters and bias after N) is then reported as a
    figure (tolerance None, ``after_parting`` = s) rather than held to the rounding-level
    tolerances; everything before ``s`` stays strict, and ``step_routing[s]`` itself is strict
    (0 real flips). The runners avoid the parting: :func:`parity.forcing.force_after_near_tie`
    replays the jax run with the reference's routing from ``s`` on, and ``forced`` (its info) makes
    ``step_routing[s]`` record the tie (0 real flips, strict, ``forced_from_step``, ``tie_margin``)
    while every later check stays strict. Measured: the deepseek_v3 debugmodel sigmoid + grouped +
    bias-hook run parts at step 8 on one token whose kept-vs-dropped group scores differ by 1.2e-6
    (docs/MEASUREMENTS.md).
    """
    parting = parting_step(cfg, jt, tt, tol) if jt.get("routing") and tt.get("routing") else None
    real = sum(info["real"] for info in parting[1]) if parting else 0
    part_at = parting[0] if parting and real == 0 else None  # None: no parting, or a real flip (fails below)

    def add(name, metric, value, tolerance, *, after: int, **extra):
        """A check of the state after ``after`` steps' forwards (a figure from the parting on)."""
        if part_at is not None and after >= part_at and tolerance is not None:
            extra.update(after_parting=part_at, tolerance_if_strict=float(tolerance))
            metric, tolerance = f"{metric} (after the near-tie parting at step {part_at}: figure)", None
        return checks.add(name, metric, value, tolerance, stage="steps", **extra)

    def routing_check():
        s, layers = parting
        near = [i for i in layers if i["mismatched_tokens"]]
        checks.add(f"step_routing[{s}]", "tokens with a real (non-near-tie) top-k set mismatch at the first step "
                   "whose routing differs", real, 0, stage="steps", step=s, layers=near)

    def loss_check(i, a, b):
        if parting and i == parting[0]:
            routing_check()
        if forced and i == forced["forced_from_step"]:
            checks.add(f"step_routing[{i}]", "tokens with a real (non-near-tie) top-k set mismatch at the first step "
                       "whose routing differs (near-ties only: the reference's routing is forced from here on)",
                       0, 0, stage="steps", step=i, forced_from_step=i, tie_margin=forced["tie_margin"],
                       layers=forced["layers"])
        add(f"step_loss[{i}]", "|jax-torch| / |torch|", _rel(a, b), tol.step_loss_rel, after=i, jax=a, torch=b)

    losses = [(i, a, b) for i, (a, b) in enumerate(zip(jt["losses"], tt["losses"]))]
    if losses:
        loss_check(*losses[0])
    flips = _flips(cfg, jt, tt)
    first_flips = [f for f in flips if f[0] == 0]
    if params0 is not None and jt.get("params1") is not None and tt.get("params1") is not None:
        loose1 = _flipped_names(cfg, tt["params1"], first_flips)
        dj = {n: jt["params1"][n] - params0[n] for n in jt["params1"] if n in params0}
        dt = {n: tt["params1"][n] - params0[n] for n in tt["params1"] if n in params0}
        strict1 = part_at is None or part_at > 0
        compare_named("update[1]", {n: v for n, v in dj.items() if n not in loose1},
                      {n: v for n, v in dt.items() if n not in loose1}, tol.update_rel_l2 if strict1 else None,
                      checks, "steps", **({} if strict1 else {"after_parting": part_at}))
        if jt.get("bias1") is not None and tt.get("bias1") is not None:
            d = float(np.abs(jt["bias1"].astype(np.float64) - tt["bias1"]).max())
            allow = tol.step_bias_abs + 2 * cfg.moe.bias_update_rate * bool(first_flips) + bias_ulps(tt["bias1"], 1)
            add("expert_bias[1]", "max |bias diff| after update 1", d, allow, after=0)
    for item in losses[1:]:
        loss_check(*item)
        _bias_check(cfg, jt, tt, item[0], flips, tol, add)
    _compare_final_state(cfg, jt, tt, bias0, n_steps, flips, part_at, tol, checks, add)


def bias_ulps(bias: np.ndarray, n_updates: int) -> float:
    """The fp32 rounding ``n_updates`` sign updates may leave between two sides' biases: one ulp of
    the bias's magnitude per update and side. ``bias + delta`` rounds at the bias's scale (a
    randomised bias of ~1e-2 has an ulp of 1.9e-9), and the centring mean over E experts may round
    differently (qwen3/debugmodel_moe, 64 experts: 2^-29 after one update; 8 experts: exactly 0)."""
    return 2.0 * n_updates * float(np.spacing(np.float32(np.abs(bias).max())))


def _bias_check(cfg, jt, tt, i: int, flips, tol, add) -> None:
    """``expert_bias[i]`` (i >= 2): the bias step ``i``'s forward selected with (after ``i``
    updates) on both sides, from the routing records; one extra sign update allowed per earlier
    flipped step (as ``stepN_expert_bias``)."""
    if i < 2 or not (jt.get("routing") and tt.get("routing")) or i >= min(len(jt["routing"]), len(tt["routing"])):
        return
    a, b = jt["routing"][i].get("bias"), tt["routing"][i].get("bias")
    if a is None or b is None:
        return
    d = float(np.abs(a.astype(np.float64) - b).max())
    allow = (tol.step_bias_abs + 2 * cfg.moe.bias_update_rate * len({f[0] for f in flips if f[0] < i})
             + bias_ulps(b, i))
    add(f"expert_bias[{i}]", f"max |bias diff| at step {i}'s forward (after update {i})", d, allow, after=i - 1)


def _compare_final_state(cfg, jt, tt, bias0, n_steps, flips, part_at, tol, checks, add) -> None:
    """Items 4 and 5 of :func:`compare_steps`: the routing flips counted over training, every
    parameter and the expert bias after the last step (``add`` makes a check a figure after a
    parting)."""
    m = cfg.model
    total = max(1, sum(int(c.sum()) for c in tt["counts"]))
    moved = sum(int(np.abs(cj.astype(np.int64) - ct).sum()) for cj, ct in zip(jt["counts"], tt["counts"])
                if cj.shape == ct.shape) / 2
    flip_steps = sorted({f[0] for f in flips})
    add("step_routing", "fraction of assignments whose expert differs during training", moved / total,
        tol.step_flip_frac, after=n_steps, flipped_assignments=moved, assignments=total, flip_steps=flip_steps,
        flipped=[{"step": i, "layer": m.first_k_dense + j, "expert": e} for i, j, e in flips[:50]])
    loose = _flipped_names(cfg, tt["params"], flips)
    pre = f"step{n_steps}_param"
    strict = part_at is None
    compare_named(pre, {n: v for n, v in jt["params"].items() if n not in loose},
                  {n: v for n, v in tt["params"].items() if n not in loose},
                  tol.step_param_rel_l2 if strict else None, checks, "steps",
                  **({} if strict else {"after_parting": part_at}))
    for n in sorted(loose):
        r, mx = _rel_l2(jt["params"][n], tt["params"][n])
        checks.add(f"{pre}:{n}", "||jax-torch|| / ||torch|| (expert flipped: figure, see step_routing)", r,
                   None, stage="steps", max_abs=mx, flipped=True)
    if tt["bias"] is not None or jt["bias"] is not None:
        if tt["bias"] is None or jt["bias"] is None:
            checks.add(f"step{n_steps}_expert_bias", "present on one side only", 1, 0, stage="steps", passed=False)
        else:
            d = float(np.abs(jt["bias"].astype(np.float64) - tt["bias"]).max())
            moved_by = float(np.abs(tt["bias"].astype(np.float64) - bias0).max()) if bias0 is not None else None
            allow = tol.step_bias_abs + 2 * cfg.moe.bias_update_rate * len(flip_steps) + bias_ulps(tt["bias"], n_steps)
            add(f"step{n_steps}_expert_bias", "max |bias diff|", d, allow, after=n_steps, moved_by=moved_by)


def first_divergence(checks: list[dict]) -> dict | None:
    """The earliest failing check in forward order; if the forward pass agrees, the first failing
    check after it (losses, gradients, steps) in the order they were added."""
    fwd = sorted((c for c in checks if "order" in c), key=lambda c: c["order"])
    for c in fwd:
        if not c["passed"]:
            return _div(c)
    for c in checks:
        if "order" not in c and not c["passed"]:
            return _div(c)
    return None


def _div(c: dict) -> dict:
    d = {k: c[k] for k in ("name", "stage", "metric", "value", "tolerance") if k in c}
    if c.get("layer") is not None:
        d["layer"] = c["layer"]
    d["probe"] = c["name"].split("[")[0].split(":")[0]
    return d
