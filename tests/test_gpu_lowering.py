"""The GPU expert path is a grouped GEMM, not a dense one: the bf16 train step of a small MoE,
lowered for CUDA on this CPU-only machine (abstract mesh, ``lowering_platforms=("cuda",)``;
:func:`jaxmoe.plan.lower.lower_abstract`), checked on its StableHLO.

What "dense" means here (issue 27 item 1; docs/MEASUREMENTS.md "GPU"): ``jax.lax.ragged_dot``
reaches XLA as a ``chlo.ragged_dot`` op, and XLA (CPU and GPU alike, jax 0.10-0.11) expands it
into a masked dense contraction with a ``[groups, rows, K]`` operand -- G copies of all the
assignment rows, E times the memory and FLOPs (the 32 GiB allocation of fine/ragged on the H200).
The patterns looked for:

* ``chlo.ragged_dot`` in the StableHLO (the op that is expanded so);
* a ``[G, R, K]`` tensor with ``G`` = experts, ``R`` >= the step's assignment rows (tokens x
  top_k) and ``K`` = d_model or the expert FFN width: ``tensor<GxRxKx{bf16,f32}>`` in StableHLO,
  ``{bf16,f32}[G,R,K]`` in compiled HLO.

The ``blocked`` path holds neither; the ``ragged`` path with ``moe.ragged_kernel=xla`` holds
``chlo.ragged_dot``, and its XLA-compiled module (XLA:CPU here, the same rewrite as XLA:GPU) holds
the ``[G, R, K]`` operands -- so each assertion is shown able to fail.
"""

from __future__ import annotations

import re

import jax
import pytest

from jaxmoe.config import load_config
from jaxmoe.plan.lower import lower_abstract

G, D, F, B, S, K_TOP = 4, 48, 80, 2, 24, 2  # experts, d_model, expert FFN, batch, seq, top-k
ROWS = B * S * K_TOP  # 96 assignment rows, distinct from every weight dim

_BASE = {"compute.dtype": "bfloat16", "model.d_model": D, "moe.expert_ffn_dim": F, "moe.n_experts": G,
         "moe.top_k": K_TOP, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 16,
         "train.batch_size": B, "train.seq_len": S, "model.max_seq_len": S, "model.n_layers": 2,
         "model.first_k_dense": 0, "compute.attention_kernel": "dot_product", "optim.optimizer": "adamw"}


def _cfg(**path):
    return load_config("tiny", overrides=[f"{k}={v}" for k, v in {**_BASE, **path}.items()])


def dense_operands(text: str) -> set[str]:
    """``[G, R, K]`` tensors (R >= ROWS, K in {D, F}) in StableHLO or HLO text."""
    pats = (rf"tensor<{G}x(\d+)x(\d+)x(?:bf16|f32)>", rf"\b(?:bf16|f32)\[{G},(\d+),(\d+)\]")
    return {m.group(0) for p in pats for m in re.finditer(p, text)
            if int(m.group(1)) >= ROWS and int(m.group(2)) in (D, F)}


def test_pattern_matches_both_notations():
    assert dense_operands("x tensor<4x96x48xbf16> y f32[4,128,80] z") == {"tensor<4x96x48xbf16>", "f32[4,128,80]"}
    # expert weights [G, D, F] / [G, F, D], rows of one run, other leading dims: not dense operands
    assert not dense_operands("tensor<4x48x80xbf16> tensor<4x80x48xf32> bf16[4,64,48] f32[8,96,48]")


@pytest.fixture(scope="module")
def cuda_text():
    out = {}
    for name, path in {"blocked": {"moe.compute_path": "blocked"}, "auto": {"moe.compute_path": "auto"},
                       "ragged_xla": {"moe.compute_path": "ragged", "moe.ragged_kernel": "xla"}}.items():
        lowered, _, _ = lower_abstract(_cfg(**path), "cuda")
        out[name] = lowered.as_text()
    return out


def test_blocked_lowered_for_cuda_is_not_dense(cuda_text):
    text = cuda_text["blocked"]
    assert "stablehlo.dot_general" in text and "tensor<4x48x80xf32>" in text  # the step, its expert weights
    assert re.search(r"stablehlo.dot_general[^\n]*xbf16>", text)  # bf16 matmuls
    assert "ragged_dot" not in text
    assert dense_operands(text) == set()


def test_default_path_lowered_for_cuda_is_not_dense(cuda_text):
    """moe.compute_path=auto (the default), resolved for the CUDA target: no ragged_dot, no dense
    [G, rows, K] operand (issue 27 item 1)."""
    text = cuda_text["auto"]
    assert "ragged_dot" not in text and dense_operands(text) == set()


def test_ragged_xla_lowered_for_cuda_is_the_dense_counter_example(cuda_text):
    text = cuda_text["ragged_xla"]
    # forward gate/up/down and their input and weight gradients, per MoE layer (scanned: once)
    assert text.count('"chlo.ragged_dot"') >= 3, text.count("chlo.ragged_dot")


def test_ragged_xla_compiled_holds_the_dense_operand():
    """XLA's expansion of ``chlo.ragged_dot``, seen where it can be compiled here (XLA:CPU): the
    ``[G, R, K]`` operands appear in the compiled module of the same step."""
    from jaxmoe.plan.lower import compile_on_local_devices

    hlo = compile_on_local_devices(_cfg(**{"moe.compute_path": "ragged", "moe.ragged_kernel": "xla"})).as_text()
    found = dense_operands(hlo)
    assert found, "no [G, rows, K] operand in the compiled ragged/xla step"
    # both widths: the gate/up input [G, R, D] and the down input [G, R, F], in bf16
    assert {t.split("[")[0] + str(k) for t in found for k in (D, F) if t.endswith(f",{k}]")} >= {f"bf16{D}", f"bf16{F}"}
    assert jax.default_backend() == "cpu"


# -- MLA attention (d_qk != d_v) by cuDNN, lowered for CUDA ----------------------------------
# cuDNN's version and the GPU are what jax's fused attention checks (jax._src.cudnn); on this CPU
# host they are pretended: an H100 (compute capability 9.0) with cuDNN 9.10, or with 9.8.
B_A, S_A, H_A, DQK, DV = 2, 128, 4, 192, 128


@pytest.fixture
def pretend_cudnn(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from jaxmoe.config import autoconf
    from jaxmoe.model import attention

    monkeypatch.setattr(attention, "_use_cudnn", lambda q, v: True)  # a GPU backend, bf16
    monkeypatch.setattr(fa, "check_compute_capability", lambda c: True)  # Hopper
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: False)
    monkeypatch.setattr(autoconf, "_said", set())
    return fa


def _fmha_operand_types(text: str) -> list[list[str]]:
    """The operand types of each ``__cudnn$fmha*`` custom call in StableHLO text."""
    out = []
    for line in text.splitlines():
        if "custom_call @__cudnn$fmha" in line:
            types = re.search(r":\s*\((.*)\)\s*->", line).group(1)
            out.append(re.findall(r"tensor<[^>]*>", types))
    return out


@pytest.mark.parametrize("cudnn, unpadded", [(91000, True), (90800, False)])
def test_mla_attention_lowered_for_cuda(pretend_cudnn, monkeypatch, capsys, cudnn, unpadded):
    """MLA's attention (d_qk 192, d_v 128), forward and backward, lowered for CUDA: with cuDNN
    9.10 the fused attention takes v as it is (a v head dim of 128, no pad); with 9.8 it falls
    back to padding v to 192. One line says which."""
    import jax.numpy as jnp

    from jaxmoe.model.attention import attend

    monkeypatch.setattr(pretend_cudnn, "check_cudnn_version", lambda: cudnn)
    q = jax.ShapeDtypeStruct((B_A, S_A, H_A, DQK), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B_A, S_A, H_A, DV), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, 0.07, "dot_product").astype(jnp.float32))

    text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, q, v).lower(lowering_platforms=("cuda",)).as_text()
    calls = _fmha_operand_types(text)
    assert len(calls) >= 2, calls  # forward and backward
    v_unpadded, v_padded = f"tensor<{B_A}x{S_A}x{H_A}x{DV}xbf16>", f"tensor<{B_A}x{S_A}x{H_A}x{DQK}xbf16>"
    err = capsys.readouterr().err
    if unpadded:
        assert all(c[2] == v_unpadded for c in calls), calls
        assert "stablehlo.pad" not in text
        assert "attention: MLA (d_qk=192, d_v=128) by cuDNN fused attention, unpadded" in err
    else:
        assert all(c[2] == v_padded for c in calls), calls
        assert "stablehlo.pad" in text
        assert "padded to 192" in err and "cuDNN >= 9.10" in err
