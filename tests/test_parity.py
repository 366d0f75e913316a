"""The parity suite itself: it passes on agreeing implementations, covers every parameter, can
replay routing, classifies routing flips, and fails (at the right probe) when torch_ref is broken.

The fast profile keeps this file small (4 x 32 tokens, 2 optimizer steps, forward-only fault
runs); the full matrix (`python -m parity run --all`) stays out of CI.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.config import load_config
from parity.runner import Checks, RunOptions, compare_routing, first_divergence, run_suite, selection_gap
from parity.tolerances import FLOAT32_ADAMW

# jax-side results (weights, compiled forward, gradients) shared by the end-to-end tests of one
# configuration: the jax side does not change between them, only the torch side (faults) does.
JAX_CACHE: dict = {}

# --------------------------------------------------------------------------------------------
# cheap unit tests of the comparison logic (no model)
# --------------------------------------------------------------------------------------------


def test_selection_gap_hand_computed():
    e = load_config("tiny").moe  # softmax, top-2 of 8, no groups
    scores = np.array([[0.30, 0.25, 0.249, 0.2, 0.001, 0.0, 0.0, 0.0]], np.float32)
    # boundary: 2nd (0.25) vs 3rd (0.249)
    np.testing.assert_allclose(selection_gap(scores, None, e), [0.001], rtol=1e-5)
    # softmax with an expert bias (torchtitan's recipe): the gap is on scores + bias,
    # [0.30, 0.25, 0.299, ...] -> 2nd (0.299) vs 3rd (0.25)
    eb = load_config("tiny", overrides=["moe.use_expert_bias=true"]).moe
    sb = np.array([0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(selection_gap(scores, sb, eb), [0.049], rtol=1e-5)

    g = load_config("tiny-mla").moe  # sigmoid + bias, 4 groups of 2, keep 2, top-2
    s = np.array([[0.9, 0.1, 0.5, 0.45, 0.2, 0.2, 0.6, 0.05]])
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3])
    # selection scores: [0.9, 0.1 | 0.5, 0.45 | 0.2, 0.2 | 0.6, 0.35]; group scores 1.0, 0.95, 0.4, 0.95
    # kept groups 0 and (tie 0.95: lower index) 1; group gap = 0.95 - 0.95 = 0
    np.testing.assert_allclose(selection_gap(s, bias, g), [0.0], atol=1e-12)
    bias2 = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # selection: groups 1.0, 0.95, 0.4, 0.65 -> keep 0, 1; group gap 0.95 - 0.65 = 0.3;
    # experts of kept groups sorted: 0.9, 0.5, 0.45, 0.1 -> expert gap 0.5 - 0.45 = 0.05
    np.testing.assert_allclose(selection_gap(s, bias2, g), [0.05], rtol=1e-9)


def test_routing_classification_near_tie_vs_real():
    cfg = load_config("tiny", overrides=["model.n_layers=1"])
    scores = np.array([[0.4, 0.3, 0.3 - 1e-7, 0.0, 0, 0, 0, 0.0],  # near-tie at the boundary
                       [0.5, 0.3, 0.1, 0.1, 0, 0, 0, 0.0]], np.float32)  # clear gap 0.2
    jax_idx = np.array([[[0, 1], [0, 1]]])
    torch_idx = np.array([[[0, 2], [0, 2]]])  # token 0: near-tie flip; token 1: real mismatch
    aux = lambda idx: {"router": {"topk_idx": idx, "scores": scores[None]}}  # noqa: E731
    checks = Checks()
    summary = compare_routing(cfg, aux(jax_idx), aux(torch_idx), None, FLOAT32_ADAMW, checks)
    assert (summary["near_tie"], summary["real"]) == (1, 1)
    assert checks.items[0]["name"] == "routing[0]" and not checks.items[0]["passed"]


def test_routing_mismatch_downstream_of_a_near_tie_is_not_real():
    """Two MoE layers, 2 sequences of 2 tokens. Layer 0: token 0 (sequence 0, position 0) flips
    on a near-tie. Layer 1: tokens 1 (same sequence, later position) and 2 (sequence 1) disagree
    with clear gaps: token 1 is downstream of the flip (counted with the near-ties), token 2 is a
    real mismatch."""
    cfg = load_config("tiny", overrides=["model.n_layers=2", "model.first_k_dense=0", "train.seq_len=2"])
    near = [0.4, 0.3, 0.3 - 1e-7, 0.0, 0, 0, 0, 0.0]
    clear = [0.5, 0.3, 0.1, 0.1, 0, 0, 0, 0.0]
    scores = np.array([[near, clear, clear, clear], [clear, clear, clear, clear]], np.float32)
    same = [[0, 1], [0, 1], [0, 1], [0, 1]]
    jax_idx = np.array([same, same])
    torch_idx = np.array([[[0, 2], [0, 1], [0, 1], [0, 1]], [[0, 1], [0, 2], [0, 2], [0, 1]]])
    aux = lambda idx: {"router": {"topk_idx": idx, "scores": scores}}  # noqa: E731
    checks = Checks()
    summary = compare_routing(cfg, aux(jax_idx), aux(torch_idx), None, FLOAT32_ADAMW, checks)
    assert (summary["near_tie"], summary["real"]) == (2, 1)
    assert summary["layers"][1]["downstream"] == 1 and summary["layers"][1]["real"] == 1
    assert checks.items[0]["passed"] and not checks.items[1]["passed"]


def test_first_divergence_is_earliest_in_forward_order():
    c = Checks()
    c.add("loss:ce", "rel", 1.0, 0.1, stage="loss")
    c.add("moe_out[1]", "x", 1.0, 0.1, stage="forward", order=(2, 6), layer=1)
    c.add("attn_out[1]", "x", 1.0, 0.1, stage="forward", order=(2, 0), layer=1)
    c.add("attn_out[0]", "x", 0.0, 0.1, stage="forward", order=(1, 0), layer=0)
    fd = first_divergence(c.items)
    assert fd["name"] == "attn_out[1]" and fd["layer"] == 1
    assert first_divergence([i for i in c.items if i["stage"] != "forward"])["name"] == "loss:ce"


def test_cli_bad_input_is_one_line_error(capsys):
    from parity.__main__ import main

    assert main(["run", "--preset", "no-such-preset", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error:") and "no-such-preset" in err and "\n" not in err


@pytest.mark.parametrize("flags, named", [
    (["--preset", "tiny-mla"], "--preset"), (["--reference", "hf"], "--reference"),
    (["--reference", "torchtitan", "--titan", "deepseek_v3/debugmodel"], "--reference, --titan"),
    (["--titan-set", "moe.router.score_func=sigmoid"], "--titan-set"), (["--packed"], "--packed")])
def test_run_all_refuses_the_flags_it_would_ignore(flags, named, capsys, tmp_path):
    from parity.__main__ import main

    assert main(["run", "--all", "--out", str(tmp_path / "all"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error: run --all") and f"drop {named} " in err and "\n" not in err, err
    assert not (tmp_path / "all").exists()


# --------------------------------------------------------------------------------------------
# end to end (fast profile)
# --------------------------------------------------------------------------------------------


def test_tiny_mla_fast_profile_passes_and_covers_every_parameter(tmp_path):
    import torch

    from parity.report import write_report
    from torch_ref.transformer import TorchTransformer

    opts = RunOptions(preset="tiny-mla", profile="fast", steps=2)
    rep = run_suite(opts)
    failed = [c for c in rep["checks"] if not c["passed"]]
    assert rep["passed"], failed[:5]
    assert rep["first_divergence"] is None
    names = {n for n, _ in TorchTransformer(load_config("tiny-mla"), seed=0).named_parameters()}
    grads = {c["name"].split(":", 1)[1] for c in rep["checks"] if c["name"].startswith("grad:")}
    assert grads == names
    stepped = {c["name"].split(":", 1)[1] for c in rep["checks"] if c["name"].startswith("step2_param:")}
    assert stepped == names
    assert any(c["name"] == "step2_expert_bias" for c in rep["checks"])
    # the bias really moved during the steps, so the bias check compares something
    bias_check = next(c for c in rep["checks"] if c["name"] == "step2_expert_bias")
    assert bias_check["moved_by"] > 0
    assert len(rep["loss_curves"]["jax"]) == 2
    out = write_report(rep, tmp_path / "r")
    data = json.loads((out / "report.json").read_text())
    assert data["passed"] is True and {"name", "metric", "value", "tolerance", "passed"} <= set(data["checks"][0])
    assert "| check |" in (out / "report.md").read_text()
    assert (out / "loss_curves.png").exists() and (out / "layer_errors.png").exists()
    assert torch.get_default_dtype() == torch.float32


def test_softmax_expert_bias_parity_every_gradient_and_the_bias_per_step():
    """torchtitan's default recipe on the torch_ref side: an expert bias on softmax scores
    (randomised, so it changes selection), every gradient, and the bias after every step."""
    from torch_ref.transformer import TorchTransformer

    over = ["moe.use_expert_bias=true", "moe.bias_update_rate=0.01"]
    rep = run_suite(RunOptions(preset="tiny", overrides=over, profile="fast", steps=3))
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]][:5]
    cfg = load_config("tiny", overrides=over)
    assert cfg.moe.score_func == "softmax" and cfg.moe.use_expert_bias
    names = {n for n, _ in TorchTransformer(cfg, seed=0).named_parameters()}
    grads = {c["name"].split(":", 1)[1] for c in rep["checks"] if c["name"].startswith("grad:")}
    assert grads == names
    by = {c["name"]: c for c in rep["checks"]}
    assert by["step3_expert_bias"]["moved_by"] > 0
    assert {"expert_bias[1]", "expert_bias[2]"} <= set(by)  # the bias after every step


def test_forced_routing_replays_the_other_side():
    rep = run_suite(RunOptions(preset="tiny", profile="fast", force_routing="torch", steps=0), jax_cache=JAX_CACHE)
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]][:5]
    assert rep["comparison_routing"].startswith("jax replays torch")


# The CI subset of the self-test: the forward faults, the backward fault and the optimizer and
# balance faults on tiny-mla (they share one jax training of one step and the cached forward).
# The mesh fault (a subprocess) and the Muon fault: test_mesh_and_muon_faults_caught (below).
CI_FAULTS = ("baseline (tiny-mla)", "baseline (tiny)", "baseline (tiny, no renorm)", "rmsnorm-eps", "rope-layout",
             "softmax-after-topk", "expert-weight", "missing-route-scale", "blocked-vjp-backward",
             "adamw-no-bias-correction", "decay-on-norms", "bias-not-centred")


def test_fault_injection_self_test():
    from parity.faults import default_faults, selftest

    faults = [f for f in default_faults() if f.name in CI_FAULTS]
    assert len(faults) == len(CI_FAULTS)
    ok, rows = selftest(profile="fast", faults=faults, log=None, jax_cache=JAX_CACHE)
    bad = [r for r in rows if not r["ok"]]
    assert ok, bad
    caught = [r for r in rows if r["caught"] is not None]
    assert len(caught) == 9 and all(r["caught"] and r["margin"] > 1 for r in caught)
    assert all(r["margin"] < 1 for r in rows if r["caught"] is None)  # baselines: every check within tolerance
    by = {r["fault"]: r for r in rows}
    assert by["blocked-vjp-backward"]["first_divergence"].startswith("grad:")  # the forward is unchanged
    assert by["bias-not-centred"]["first_divergence"] == "expert_bias[1]"


@pytest.mark.slow
def test_mesh_and_muon_faults_caught():
    """The self-test's faults outside CI_FAULTS (and outside test_titan's torchtitan faults): a
    mesh dispatch fault in a subprocess and a transposed Muon update, with their baselines."""
    from parity.faults import default_faults, selftest

    faults = [f for f in default_faults()
              if f.name not in CI_FAULTS and not f.name.startswith(("titan", "baseline (torchtitan"))]
    assert {f.name for f in faults} == {"baseline (tiny-mla, muon)", "muon-transposed", "baseline (tiny-mla, mesh)",
                                        "dispatch-slot-swap"}
    ok, rows = selftest(profile="fast", faults=faults, log=None, jax_cache=JAX_CACHE)
    assert ok, [r for r in rows if not r["ok"]]
    assert all(r["caught"] and r["margin"] > 1 for r in rows if r["caught"] is not None)
    assert all(r["margin"] < 1 for r in rows if r["caught"] is None)


@pytest.mark.heavy  # every fault again, end to end through the CLI: the three tests above cover each fault
def test_full_self_test_with_mesh_and_muon_faults(tmp_path):
    """``python -m parity selftest``: every fault (mesh dispatch in a subprocess, Muon) caught and
    localised, selftest.json in its schema."""
    from parity.__main__ import main

    assert main(["selftest", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "selftest.json").read_text())
    assert data["passed"] is True
    for r in data["faults"]:
        assert {"fault", "how", "caught", "first_divergence", "expected", "ok"} <= set(r)
    names = {r["fault"] for r in data["faults"]}
    assert {"dispatch-slot-swap", "muon-transposed", "baseline (tiny-mla, mesh)"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-mla", "tiny", "mixtral-tiny"])
def test_transformers_reference_every_gradient(preset):
    """``--reference hf``: transformers' own model on the same weights; every gradient by HF name
    within 1e-5 relative L2 of its autograd."""
    pytest.importorskip("transformers")
    rep = run_suite(RunOptions(preset=preset, profile="fast", steps=0, reference="hf"))
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]][:5]
    grads = [c for c in rep["checks"] if c["name"].startswith("grad:")]
    assert grads and max(c["value"] for c in grads) <= 1e-5


@pytest.mark.parametrize("name", ["rope-layout"])
def test_a_fault_fails_the_gradient_checks(name):
    """With gradients too: the injected fault fails the gradient checks, not just the forward."""
    from parity.faults import default_faults

    fault = next(f for f in default_faults() if f.name == name)
    rep = run_suite(RunOptions(preset=fault.preset, overrides=fault.overrides, profile="fast", steps=0),
                    fault=fault, jax_cache=JAX_CACHE)
    assert not rep["passed"]
    assert rep["first_divergence"]["name"] == "attn_out[0]"
    assert any(not c["passed"] for c in rep["checks"] if c["name"].startswith("grad:"))


def test_fault_expectations_match_literal_brackets_and_star():
    from parity.faults import name_matches

    assert name_matches("moe_out[1]", ("moe_out[1]",)) and not name_matches("moe_out1", ("moe_out[1]",))
    pat = ("grad:model.layers.1.mlp.experts.*.down_proj.weight",)
    assert name_matches("grad:model.layers.1.mlp.experts.3.down_proj.weight", pat)
    assert not name_matches("grad:model.layers.2.mlp.experts.3.down_proj.weight", pat)
    assert not name_matches(None, ("(passes)",))


def _steps_fixture(flip_gap: float):
    """Three training steps of a 1-MoE-layer tiny config, identical on both sides except that at
    step 1 token 0 takes expert 2 instead of 1 on the torch side, at a decision gap ``flip_gap``;
    after it the losses and parameters part by 1e-3 (what a different expert choice does)."""
    cfg = load_config("tiny", overrides=["model.n_layers=1", "model.first_k_dense=0", "train.seq_len=2"])
    k, n_tok = cfg.moe.top_k, 4
    same = np.tile(np.arange(k), (1, n_tok, 1))
    flipped = same.copy()
    flipped[0, 0, k - 1] = k
    gap = np.full((1, n_tok), 0.2)
    gap_flip = gap.copy()
    gap_flip[0, 0] = flip_gap
    counts = lambda idx: np.stack([np.bincount(x.ravel(), minlength=cfg.moe.n_experts) for x in idx])  # noqa: E731
    p = {"w": np.ones(8, np.float32)}
    jt = {"losses": [2.0, 1.9, 1.8], "params": p, "bias": None, "params1": p, "bias1": None,
          "counts": [counts(same)] * 3, "routing": [{"idx": same, "gap": gap}] * 3}
    tt = {"losses": [2.0, 1.9 * (1 + 1e-3), 1.8 * (1 + 1e-3)], "params": {"w": p["w"] * (1 + 1e-3)}, "bias": None,
          "params1": p, "bias1": None, "counts": [counts(same), counts(flipped), counts(same)],
          "routing": [{"idx": same, "gap": gap}, {"idx": flipped, "gap": gap_flip}, {"idx": same, "gap": gap}]}
    return cfg, jt, tt


def test_training_parts_at_a_near_tie_later_states_are_figures():
    """A first training flip on a near-tie (gap 1e-7 <= tie_gap): everything before it strict,
    step_routing[1] passes with 0 real flips, every check of a later state is a figure."""
    from parity.checks import compare_steps

    cfg, jt, tt = _steps_fixture(1e-7)
    checks = Checks()
    compare_steps(cfg, jt, tt, None, 3, FLOAT32_ADAMW, checks, params0={"w": np.zeros(8, np.float32)})
    by = {c["name"]: c for c in checks.items}
    assert all(c["passed"] for c in checks.items), [c for c in checks.items if not c["passed"]]
    assert by["step_routing[1]"]["value"] == 0 and by["step_routing[1]"]["tolerance"] == 0
    assert by["step_loss[0]"]["tolerance"] is not None and "after_parting" not in by["step_loss[0]"]
    for name in ("step_loss[1]", "step_loss[2]", "step_routing", "step3_param:w"):
        assert by[name]["tolerance"] is None and by[name]["after_parting"] == 1, name
    assert [c["name"] for c in checks.items].index("step_routing[1]") < [c["name"] for c in checks.items].index(
        "step_loss[1]")


def test_training_flip_with_a_clear_gap_fails_where_it_happens():
    """The same flip at a clear gap (0.2): a real flip, the first divergence is step_routing[1]
    and the later states stay held to their tolerances."""
    from parity.checks import compare_steps

    cfg, jt, tt = _steps_fixture(0.2)
    checks = Checks()
    compare_steps(cfg, jt, tt, None, 3, FLOAT32_ADAMW, checks, params0={"w": np.zeros(8, np.float32)})
    by = {c["name"]: c for c in checks.items}
    assert by["step_routing[1]"]["value"] == 1 and not by["step_routing[1]"]["passed"]
    assert first_divergence(checks.items)["name"] == "step_routing[1]"
    assert by["step3_param:w"]["tolerance"] is not None and not by["step3_param:w"]["passed"]


def _tie_run(n_steps: int, tie_step: int, fault_step: int | None):
    """``n_steps`` training steps of a 1-MoE-layer config: the torch side flips token 0 to another
    expert at ``tie_step`` on a near-tie (gap 1e-7); the jax side's forced replay (``rerun``)
    follows torch exactly, except that from ``fault_step`` on its losses are 1e-3 off (a bug that
    starts late) and so are its final parameters."""
    cfg = load_config("tiny", overrides=["model.n_layers=1", "model.first_k_dense=0", "train.seq_len=2"])
    k, n_tok = cfg.moe.top_k, 4
    same = np.tile(np.arange(k), (1, n_tok, 1))
    flipped = same.copy()
    flipped[0, 0, k - 1] = k
    gap = np.full((1, n_tok), 0.2)
    gap_tie = gap.copy()
    gap_tie[0, 0] = 1e-7
    counts = lambda idx: np.stack([np.bincount(x.ravel(), minlength=cfg.moe.n_experts) for x in idx])  # noqa: E731
    p = {"w": np.ones(8, np.float32)}
    losses = [2.0 - 0.01 * i for i in range(n_steps)]
    t_idx = [same if i < tie_step else flipped for i in range(n_steps)]
    t_gap = [gap_tie if i == tie_step else gap for i in range(n_steps)]
    tt = {"losses": losses, "params": {"w": p["w"] * 1.01}, "bias": None, "params1": p, "bias1": None,
          "counts": [counts(x) for x in t_idx], "routing": [{"idx": x, "gap": g} for x, g in zip(t_idx, t_gap)]}
    # natural jax run: never flips, so it parts from torch at tie_step
    jt = {"losses": [x * (1 + 1e-3 * (i >= tie_step)) for i, x in enumerate(losses)], "params": {"w": p["w"]},
          "bias": None, "params1": p, "bias1": None, "counts": [counts(same)] * n_steps,
          "routing": [{"idx": same, "gap": gap}] * n_steps}
    calls = []

    def rerun(forced):
        calls.append(forced)
        bad = fault_step is not None
        off = [1 + 1e-3 * (bad and i >= fault_step) for i in range(n_steps)]
        return {"losses": [x * o for x, o in zip(losses, off)], "params": {"w": tt["params"]["w"] * (1 + 1e-3 * bad)},
                "bias": None, "params1": p, "bias1": None, "counts": [counts(x) for x in t_idx],
                "routing": [{"idx": f if f is not None else same, "gap": gap} for f in forced]}

    return cfg, jt, tt, rerun, calls


def test_near_tie_forces_the_reference_routing_and_every_later_check_stays_strict():
    from parity.checks import compare_steps
    from parity.forcing import force_after_near_tie, strict_fraction

    cfg, jt, tt, rerun, calls = _tie_run(20, 2, None)
    jt2, info = force_after_near_tie(cfg, jt, tt, FLOAT32_ADAMW, rerun)
    assert info["forced_from_step"] == 2 and info["tie_margin"] == pytest.approx(1e-7)
    forced = calls[0]
    assert all(f is None for f in forced[:2])
    assert all(f is tt["routing"][i]["idx"] for i, f in enumerate(forced) if i >= 2)
    checks = Checks()
    compare_steps(cfg, jt2, tt, None, 20, FLOAT32_ADAMW, checks, params0={"w": np.zeros(8, np.float32)}, forced=info)
    by = {c["name"]: c for c in checks.items}
    assert all(c["passed"] for c in checks.items), [c for c in checks.items if not c["passed"]]
    assert by["step_routing[2]"]["forced_from_step"] == 2 and by["step_routing[2]"]["tolerance"] == 0
    assert strict_fraction(checks.items) == 1.0
    assert all(by[f"step_loss[{i}]"]["tolerance"] is not None for i in range(20))


def test_a_fault_after_a_forced_near_tie_fails_at_its_step():
    """A bug that starts at step 15 of 20, after a near-tie forced at step 2: the suite fails, at
    step_loss[15] (without forcing it would be a figure after the parting)."""
    from parity.checks import compare_steps
    from parity.forcing import force_after_near_tie

    cfg, jt, tt, rerun, _ = _tie_run(20, 2, 15)
    jt2, info = force_after_near_tie(cfg, jt, tt, FLOAT32_ADAMW, rerun)
    checks = Checks()
    compare_steps(cfg, jt2, tt, None, 20, FLOAT32_ADAMW, checks, params0={"w": np.zeros(8, np.float32)}, forced=info)
    failed = [c["name"] for c in checks.items if not c["passed"]]
    assert failed and failed[0] == "step_loss[15]" and "step20_param:w" in failed
    assert first_divergence(checks.items)["name"] == "step_loss[15]"
    # the same run unforced: the fault hides behind the parting (figures from step 2 on)
    plain = Checks()
    compare_steps(cfg, jt, tt, None, 20, FLOAT32_ADAMW, plain, params0={"w": np.zeros(8, np.float32)})
    assert all(c["passed"] for c in plain.items)


def test_a_real_flip_is_not_forced():
    from parity.forcing import force_after_near_tie

    cfg, jt, tt, rerun, calls = _tie_run(5, 1, None)
    tt["routing"][1]["gap"] = np.full_like(tt["routing"][1]["gap"], 0.2)  # a clear gap: a real flip
    jt2, info = force_after_near_tie(cfg, jt, tt, FLOAT32_ADAMW, rerun)
    assert info is None and jt2 is jt and not calls
