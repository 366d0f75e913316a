"""Every tolerance of parity/tolerances.py means something: for each profile and each field, an
error at the *measured* value (parity.tolerances.MEASURED) passes the real check function, and an
error ten times the measured value fails it. So no tolerance sits more than 10x above what the two
implementations actually do, and a fault one order of magnitude above the noise is caught.

All in-process on synthetic arrays (no model): each case builds a jax-side and a torch-side input
that differ by a chosen amount and runs it through the same ``parity.checks`` function a parity
run uses, then reads the named check's verdict.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from jaxmoe.config import load_config
from parity.checks import Checks, compare_forward, compare_losses, compare_named, compare_routing, compare_steps
from parity.tolerances import MEASURED, PROFILES, REL_FLOOR, Tolerances

CFG = load_config("tiny")  # 2 MoE layers, 8 experts, top-2, softmax routing
T, D, V, E, K = 16, 8, 32, 8, 2


def _fake_forward(rng) -> dict:
    """A jaxmoe-like forward result of CFG's shape (random values; only the structure matters)."""
    lm, n = CFG.model.n_moe_layers, CFG.model.n_layers
    scores = rng.dirichlet(np.ones(E), size=(lm, T)).astype(np.float32)
    idx = np.argsort(-scores, -1)[..., :K]
    w = np.take_along_axis(scores, idx, -1)
    w = w / w.sum(-1, keepdims=True)
    counts = np.stack([np.bincount(idx[j].ravel(), minlength=E) for j in range(lm)])
    probes = {"embedding": rng.normal(size=(T, D)), "attn_out": [rng.normal(size=(T, D)) for _ in range(n)],
              "moe_out": [rng.normal(size=(T, D)) for _ in range(lm)], "final_hidden": rng.normal(size=(T, D))}
    aux = {"probes": probes, "counts": counts, "dropped": np.zeros(lm, np.int64),
           "router": {"logits": np.log(scores), "scores": scores, "topk_idx": idx, "topk_weights": w}}
    return {"logits": rng.normal(size=(T, V)) * 1.3, "aux": aux}


def _forward_check(name: str, tol: Tolerances, edit) -> dict:
    rng = np.random.default_rng(0)
    jf = _fake_forward(rng)
    tf = copy.deepcopy(jf)
    edit(jf)
    checks = Checks()
    compare_forward(CFG, jf, tf, tol, checks)
    return next(c for c in checks.items if c["name"] == name)


def _probe(v):
    def edit(jf):
        a = jf["aux"]["probes"]["moe_out"][1]
        a[3, 2] += v * np.abs(a).max()  # scaled error v (jax side; the reference is untouched)
    return "moe_out[1]", edit


def _gate(v):
    def edit(jf):
        jf["aux"]["router"]["topk_weights"][0][5, 1] += v
    return "router_weights[0]", edit


def _logits_abs(v):
    def edit(jf):
        jf["logits"][4, 7] += v
    return "logits", edit


def _kl_shift(v):
    """A logit perturbation whose mean KL is ~v (KL ~ 0.5 * Var_p(d) * eps^2 for small eps)."""
    def edit(jf):
        lg = jf["logits"]
        d = np.random.default_rng(1).normal(size=lg.shape)
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        var = ((p * d**2).sum(-1) - (p * d).sum(-1) ** 2).mean()
        lg += d * np.sqrt(2 * v / var)
    return "logits_kl", edit


def _tie(v):
    """A routing flip at selection-score gap v: forgiven (near-tie) iff v <= tie_gap."""
    def run(tol):
        scores = np.array([[0.4, 0.3, 0.3 - v, 0.0, 0, 0, 0, 0]], np.float64)
        aux = lambda idx: {"router": {"topk_idx": np.array([[idx]]), "scores": scores[None]}}  # noqa: E731
        cfg = load_config("tiny", overrides=["model.n_layers=1"])
        checks = Checks()
        compare_routing(cfg, aux([0, 1]), aux([0, 2]), None, tol, checks)
        return checks.items[0]
    return run


def _loss(v):
    def run(tol):
        checks = Checks()
        ref = {k: 2.5 for k in ("ce", "z_loss", "lb", "seq_aux", "router_z", "loss")}
        compare_losses({**ref, "ce": 2.5 * (1 + v)}, ref, tol, checks)
        return next(c for c in checks.items if c["name"] == "loss:ce")
    return run


def _grad(v):
    def run(tol):
        rng = np.random.default_rng(2)
        b = rng.normal(size=(16, 8))
        d = rng.normal(size=b.shape)
        a = b + d / np.linalg.norm(d) * v * np.linalg.norm(b)
        checks = Checks()
        compare_named("grad", {"w": a}, {"w": b}, tol.grad_rel_l2, checks, "backward")
        return checks.items[0]
    return run


def _steps(field: str, v):
    """compare_steps on a synthetic 2-step trajectory whose one quantity differs by v."""
    def run(tol):
        rng = np.random.default_rng(3)
        p0 = {"w": rng.normal(size=(16, 8))}
        up = rng.normal(size=(16, 8)) * 1e-3
        counts = [np.full((2, E), 1000, np.int64) for _ in range(2)]  # 32000 assignments over 2 steps
        tt = {"losses": [3.0, 2.9], "params1": {"w": p0["w"] + up}, "params": {"w": p0["w"] + 2 * up},
              "bias1": np.zeros((2, E)), "bias": np.zeros((2, E)), "counts": counts}
        jt = copy.deepcopy(tt)
        d = rng.normal(size=(16, 8))
        d /= np.linalg.norm(d)
        name = {"step_loss_rel": "step_loss[1]", "update_rel_l2": "update[1]:w",
                "step_param_rel_l2": "step2_param:w", "step_bias_abs": "step2_expert_bias",
                "step_flip_frac": "step_routing"}[field]
        if field == "step_loss_rel":
            jt["losses"][1] = 2.9 * (1 + v)
        elif field == "update_rel_l2":
            jt["params1"]["w"] = jt["params1"]["w"] + d * v * np.linalg.norm(up)
        elif field == "step_param_rel_l2":
            jt["params"]["w"] = jt["params"]["w"] + d * v * np.linalg.norm(tt["params"]["w"])
        elif field == "step_bias_abs":
            jt["bias"] = jt["bias"] + np.eye(2, E) * v
        else:  # move n assignments of layer 0, step 1, from expert 0 to expert 1
            n = int(round(v * 32000))
            jt["counts"][1] = jt["counts"][1].copy()
            jt["counts"][1][0, 0] -= n
            jt["counts"][1][0, 1] += n
        checks = Checks()
        compare_steps(CFG, jt, tt, np.zeros((2, E)), 2, tol, checks, params0=p0)
        return next(c for c in checks.items if c["name"] == name)
    return run


def _forward(make):
    def run(v):
        def check(tol):
            name, edit = make(v)
            return _forward_check(name, tol, edit)
        return check
    return run


CASES = {
    "tie_gap": _tie,
    "gate_abs": _forward(_gate),
    "probe_scaled": _forward(_probe),
    "logits_abs": _forward(_logits_abs),
    "logits_kl": _forward(_kl_shift),
    "loss_rel": _loss,
    "grad_rel_l2": _grad,
    **{f: (lambda f: lambda v: _steps(f, v))(f) for f in
       ("step_loss_rel", "update_rel_l2", "step_param_rel_l2", "step_bias_abs", "step_flip_frac")},
}
FIELDS = [f for f in Tolerances.__dataclass_fields__ if f != "name"]


def test_every_field_has_a_case_and_every_profile_a_measurement():
    assert set(CASES) == set(FIELDS)
    for tol in PROFILES.values():
        assert set(MEASURED[tol.name]) == set(FIELDS), tol.name


PARAMS = [(tol.name, f) for tol in PROFILES.values() for f in FIELDS]


@pytest.mark.parametrize("profile,field", PARAMS)
def test_tolerance_passes_the_measured_error_and_fails_ten_times_it(profile, field):
    tol = next(t for t in PROFILES.values() if t.name == profile)
    limit = getattr(tol, field)
    measured, source = MEASURED[profile][field]
    if limit is None and field == "logits_abs":  # bf16: the logits are compared scaled instead
        item = CASES[field](1e3)(tol)
        assert item["tolerance"] == tol.probe_scaled and not item["passed"]
        return
    if limit is None:  # reported as a figure in this profile: the check never fails
        assert CASES[field](1e3)(tol)["tolerance"] is None
        return
    assert limit < 0.1 or "cannot be tighter" in source, f"{profile}.{field}={limit} >= 0.1 needs a reason"
    ok = CASES[field](measured)(tol)
    assert ok["passed"], (profile, field, ok["value"], limit)
    # a fault ten times the measured error; a measured 0 means exact agreement, where twice the
    # tolerance stands for the smallest fault (the tolerance itself is then one rounding unit)
    fault = 10 * measured if measured > 0 else 2 * limit
    bad = CASES[field](fault)(tol)
    assert not bad["passed"], f"{profile}.{field}: tolerance {limit} lets a fault of {fault:.3g} pass"


def test_rel_floor_bounds_near_zero_references():
    checks = Checks()
    # an exactly-zero reference (an expert that got no token): compared by abs error / REL_FLOOR
    compare_named("grad", {"a": np.full(4, 1e-13), "b": np.full(4, 1e-9)}, {"a": np.zeros(4), "b": np.zeros(4)},
                  1e-5, checks, "backward")
    a, b = checks.items
    assert a["passed"] and a["value"] == pytest.approx(2e-13 / REL_FLOOR)
    assert not b["passed"]
