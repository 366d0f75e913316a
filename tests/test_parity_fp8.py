"""``python -m parity run --fp8 RECIPE`` (issue 40 item 3): jaxmoe against torch_ref with FP8 on both
sides, every gradient gated by the recipe's measured profile (parity/tolerances.py), a recipe
mistake on one side caught, and bad combinations refused in one line."""

import pytest
import torch

from jaxmoe.config import load_config
from parity.runner import RunOptions, run_suite
from parity.tolerances import tolerances_for


def _grad_names(cfg):
    from torch_ref.transformer import TorchTransformer

    return {n for n, _ in TorchTransformer(cfg, seed=0).named_parameters()}


def test_fp8_fast_profile_passes_with_every_gradient_gated():
    rep = run_suite(RunOptions(preset="tiny", overrides=["compute.fp8=rowwise"], profile="fast", steps=2))
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]][:5]
    assert rep["tolerances"]["name"] == "float32-fp8-rowwise-adamw"
    grads = [c for c in rep["checks"] if c["name"].startswith("grad:")]
    assert {c["name"].split(":", 1)[1] for c in grads} == _grad_names(load_config("tiny"))
    assert all(c["tolerance"] is not None for c in grads)  # gated, not figures


def test_a_recipe_mistake_on_the_torch_side_is_caught(monkeypatch):
    """torch_ref rounding tensorwise scales down to a power of two (torchao's
    ``round_scales_to_power_of_2=True``, not the recipe's exact 448 / amax): one grid step off for a
    part of every tensor. The run must fail."""
    from torch_ref import fp8 as tfp8

    real = tfp8.quantise

    def pow2_tensorwise(x, recipe, contract, weight=False, grad=False):
        if recipe != "tensorwise" or grad:
            return real(x, recipe, contract, weight, grad=grad)
        x = x.float()
        s = torch.exp2(torch.floor(torch.log2(tfp8.E4M3_MAX / x.abs().max().clamp(min=tfp8.AMAX_EPS))))
        return (x * s).clamp(-tfp8.E4M3_MAX, tfp8.E4M3_MAX).to(torch.float8_e4m3fn).float() / s

    monkeypatch.setattr(tfp8, "quantise", pow2_tensorwise)
    rep = run_suite(RunOptions(preset="tiny", overrides=["compute.fp8=tensorwise"], profile="fast", steps=0))
    assert not rep["passed"]
    assert rep["first_divergence"]["stage"] in ("forward", "loss"), rep["first_divergence"]


@pytest.mark.parametrize("argv, match", [
    (["--fp8", "rowwise", "--reference", "hf", "--steps", "0"], "mirrored by torch_ref only"),
    (["--fp8", "rowwise", "--dtype", "bfloat16", "--steps", "0"], "FP8 parity runs on fp32 compute"),
    (["--set", "compute.fp8=blockwise", "--reference", "torchtitan", "--titan", "deepseek_v3/debugmodel",
      "--steps", "0"], "FP8 parity runs against torch_ref"),
])
def test_bad_fp8_combinations_are_one_line_errors(argv, match, capsys, tmp_path):
    from parity.__main__ import main

    assert main(["run", "--out", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error:") and match in err and "\n" not in err, err
    assert not (tmp_path / "r").exists()


def test_every_recipe_and_optimizer_has_a_profile():
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        for opt in ("adamw", "muon"):
            tol = tolerances_for("float32", opt, fp8=recipe)
            assert tol.name == f"float32-fp8-{recipe}-{opt}" and tol.grad_rel_l2 is not None
