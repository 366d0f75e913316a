"""bench/experts.py's no-routing references: ``ideal_loop``'s hand-written backward is right (every
gradient against autodiff of the batched form), and a tiny run reports the ceiling fields."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import experts as bench_experts


def test_ideal_loop_gradients_match_autodiff_of_batched_form():
    e, r, d, i = 4, 8, 16, 12
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (e * r, d))
    ws = [jax.random.normal(ks[1], (e, d, i)) * 0.3, jax.random.normal(ks[2], (e, d, i)) * 0.3,
          jax.random.normal(ks[3], (e, i, d)) * 0.3]
    probe = jax.random.normal(ks[4], (e * r, d))  # a loss whose gradient is not y itself

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2, 3))(x, *ws)

    got, want = grads(bench_experts.ideal_loop_ffn(e)), grads(bench_experts.ideal_batched_ffn(e))
    for name, g, w in zip(("x", "gate_proj", "up_proj", "down_proj"), got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)
    y = bench_experts.ideal_loop_ffn(e)(x, *ws)
    np.testing.assert_allclose(y, bench_experts.ideal_batched_ffn(e)(x, *ws), rtol=2e-5, atol=2e-6)


def test_tiny_run_reports_ideal_ceiling_and_ratio_to_ideal(capsys):
    out = bench_experts.main(["--paths", "blocked", "--tokens", "64", "--rounds", "1", "--repeats", "1"])
    assert out["ideal_ratio_to_matmul"] == max(out["ideal_loop"]["ratio_to_matmul"],
                                               out["ideal_batched"]["ratio_to_matmul"]) > 0
    r = out["paths"]["blocked"]
    assert r["ratio_to_matmul"] > 0 and r["ratio_to_ideal"] > 0
    assert "ideal_batched" in capsys.readouterr().out


def test_tokens_the_ideal_cannot_split_are_a_clear_error(capsys):
    with pytest.raises(SystemExit) as ex:
        bench_experts.main(["--paths", "blocked", "--tokens", "63", "--rounds", "1"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens 63" in err and "--no-ideal" in err and "32 experts" in err


def test_expert_shapes_tiny_run(capsys):
    import expert_shapes

    out = expert_shapes.main(["--tokens", "64", "--rounds", "1", "--repeats", "1"])
    for kind in ("blocked", "ideal_batched"):
        r = out["kinds"][kind]
        assert r["fine_over_coarse"] > 0 and r["coarse_gflops"] > 0 and r["fine_gflops"] > 0
    assert "fine/coarse" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ex:
        expert_shapes.main(["--tokens", "60"])
    assert ex.value.code == 2 and "--tokens 60" in capsys.readouterr().err
