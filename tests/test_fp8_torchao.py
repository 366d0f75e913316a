"""compute.fp8 against torchao's own FP8 training (issue 40 item 3): one dense layer through
torchao 0.18's ``Float8Linear`` (``convert_to_float8_training``, ``emulate=True``: the FP8 GEMM
emulated in fp32, which runs on CPU) under its "tensorwise" and "rowwise" recipes, against
jaxmoe's ``fp8_matmul`` and torch_ref's ``fp8.linear``: the output, the input gradient and the
weight gradient. (The check is how jaxmoe learnt that torchao's tensorwise recipe quantises
grad_output to e5m2: with e4m3 gradients both backward GEMMs were 6-7 % off.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is in the [ref] extra")

from jaxmoe.model import fp8  # noqa: E402
from torch_ref import fp8 as tfp8  # noqa: E402

M, K, N = 64, 96, 48
# measured (relative Frobenius, this file's shapes and seed): tensorwise 2.2e-7 (y), 1.6e-7 (dx),
# 1.7e-7 (dw) -- torch's fp32 division of 448 / amax differs from the correctly rounded one in the
# last bit (torch_ref/fp8.py), which moves every dequantised value by an ulp; rowwise 1.4e-9 /
# 3.6e-9 / 4.3e-9 (power-of-two scales: exact). An element on the other side of a rounding
# boundary would move by one FP8 step, ~1e-2 on these norms.
TOL = {"tensorwise": 2e-6, "rowwise": 1e-7}


def _data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((M, K)) * np.exp(rng.standard_normal((M, 1)))).astype(np.float32)
    w = (0.1 * rng.standard_normal((N, K))).astype(np.float32)  # nn.Linear's [out, in]
    g = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, g


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def _torchao(recipe, x, w, g):
    cfg = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))
    model[0].weight.data = torch.from_numpy(w.copy())
    torchao_float8.convert_to_float8_training(model, config=cfg)
    assert type(model[0]).__name__ == "Float8Linear"
    xt = torch.from_numpy(x.copy()).requires_grad_()
    y = model(xt)
    y.backward(torch.from_numpy(g))
    return y.detach().numpy(), xt.grad.numpy(), model[0].weight.grad.numpy()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_jaxmoe_and_torch_ref_match_torchaos_float8_linear(recipe):
    x, w, g = _data()
    ya, dxa, dwa = _torchao(recipe, x, w, g)
    with jax.default_matmul_precision("highest"):
        yj, vjp = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b.T, recipe), jnp.asarray(x), jnp.asarray(w))
        dxj, dwj = vjp(jnp.asarray(g))
    xt, wt = torch.from_numpy(x.copy()).requires_grad_(), torch.from_numpy(w.copy()).requires_grad_()
    yt = tfp8.linear(xt, wt, recipe)
    yt.backward(torch.from_numpy(g))
    for side, (y, dx, dw) in {"jaxmoe": (yj, dxj, dwj), "torch_ref": (yt.detach(), xt.grad, wt.grad)}.items():
        errs = {"y": _rel(y, ya), "dx": _rel(dx, dxa), "dw": _rel(dw, dwa)}
        assert max(errs.values()) < TOL[recipe], (side, recipe, errs)
    # and FP8 is really on in torchao: its output is not the fp32 product
    assert _rel(x @ w.T, ya) > 1e-3
