"""Router semantics against hand-computed vectors (docs/LAYOUT.md "Routing semantics").

Every expected number below is worked out by hand in the comments, not by the code under test.
A single token x = e_0 (one-hot) and a router whose first row holds the desired logits make the
router logits exactly that row.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config.schema import MoEConfig
from jaxmoe.model.router import route


def _route(logits_row, cfg, bias=None, forced=None):
    e = len(logits_row)
    x = jnp.zeros((1, 4)).at[0, 0].set(1.0)
    w = jnp.zeros((4, e)).at[0].set(jnp.asarray(logits_row, jnp.float32))
    b = None if bias is None else jnp.asarray(bias, jnp.float32)
    f = None if forced is None else jnp.asarray([forced], jnp.int32)
    r = route(x, w, b, cfg, f)
    return np.asarray(r.topk_idx[0]), np.asarray(r.topk_weights[0]), r


# softmax of log([1, 2, 3, 4]) = [0.1, 0.2, 0.3, 0.4]
SOFT_LOGITS = [math.log(v) for v in (1.0, 2.0, 3.0, 4.0)]


def test_softmax_renormalised():
    cfg = MoEConfig(n_experts=4, top_k=2, score_func="softmax", norm_topk_prob=True)
    idx, w, r = _route(SOFT_LOGITS, cfg)
    np.testing.assert_array_equal(idx, [3, 2])
    np.testing.assert_allclose(w, [4 / 7, 3 / 7], rtol=1e-6)  # 0.4/0.7, 0.3/0.7
    np.testing.assert_allclose(r.scores[0], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    np.testing.assert_allclose(r.logits[0], SOFT_LOGITS, rtol=1e-6)


def test_softmax_not_renormalised_with_route_scale():
    cfg = MoEConfig(n_experts=4, top_k=2, norm_topk_prob=False, route_scale=2.0)
    idx, w, _ = _route(SOFT_LOGITS, cfg)
    np.testing.assert_array_equal(idx, [3, 2])
    np.testing.assert_allclose(w, [0.8, 0.6], rtol=1e-6)  # 2 * [0.4, 0.3]


def _logit(p):
    return math.log(p / (1 - p))


# sigmoid scores [0.5, 0.75, 0.25, 0.1]
SIG_LOGITS = [_logit(p) for p in (0.5, 0.75, 0.25, 0.1)]


def test_sigmoid_without_bias():
    cfg = MoEConfig(n_experts=4, top_k=2, score_func="sigmoid", route_scale=2.5)
    idx, w, _ = _route(SIG_LOGITS, cfg)
    np.testing.assert_array_equal(idx, [1, 0])
    np.testing.assert_allclose(w, [1.5, 1.0], rtol=1e-6)  # 2.5 * [0.75, 0.5] / 1.25


def test_sigmoid_bias_changes_selection_not_weights():
    cfg = MoEConfig(n_experts=4, top_k=2, score_func="sigmoid", route_scale=2.5, use_expert_bias=True)
    # selection = s + bias = [0.5, 0.75, 0.85, 0.1] -> experts 2, 1; weights from s: [0.25, 0.75]
    idx, w, r = _route(SIG_LOGITS, cfg, bias=[0.0, 0.0, 0.6, 0.0])
    np.testing.assert_array_equal(idx, [2, 1])
    np.testing.assert_allclose(w, [0.625, 1.875], rtol=1e-6)  # 2.5 * [0.25, 0.75] / 1.0
    np.testing.assert_allclose(r.scores[0], [0.5, 0.75, 0.25, 0.1], rtol=1e-6)
    # use_expert_bias off: the bias is ignored
    cfg_off = MoEConfig(n_experts=4, top_k=2, score_func="sigmoid", route_scale=2.5)
    idx, _, _ = _route(SIG_LOGITS, cfg_off, bias=[0.0, 0.0, 0.6, 0.0])
    np.testing.assert_array_equal(idx, [1, 0])


def test_softmax_bias_changes_selection_not_weights():
    """torchtitan's default recipe: an expert bias on softmax scores selects, the unbiased
    probabilities weight."""
    cfg = MoEConfig(n_experts=4, top_k=2, score_func="softmax", norm_topk_prob=True, use_expert_bias=True)
    # p = [0.1, 0.2, 0.3, 0.4]; selection = p + bias = [0.1, 0.45, 0.3, 0.4] -> experts 1, 3;
    # weights from p: [0.2, 0.4] / 0.6
    idx, w, r = _route(SOFT_LOGITS, cfg, bias=[0.0, 0.25, 0.0, 0.0])
    np.testing.assert_array_equal(idx, [1, 3])
    np.testing.assert_allclose(w, [1 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(r.scores[0], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    # un-normalised with a route scale: 1.5 * [0.2, 0.4]
    cfg_raw = MoEConfig(n_experts=4, top_k=2, score_func="softmax", norm_topk_prob=False, route_scale=1.5,
                        use_expert_bias=True)
    idx, w, _ = _route(SOFT_LOGITS, cfg_raw, bias=[0.0, 0.25, 0.0, 0.0])
    np.testing.assert_array_equal(idx, [1, 3])
    np.testing.assert_allclose(w, [0.3, 0.6], rtol=1e-6)
    # a negative bias pushes the best expert out: selection [0.1, 0.2, 0.3, 0.15] -> 2, 1
    idx, w, _ = _route(SOFT_LOGITS, cfg, bias=[0.0, 0.0, 0.0, -0.25])
    np.testing.assert_array_equal(idx, [2, 1])
    np.testing.assert_allclose(w, [0.6, 0.4], rtol=1e-6)  # [0.3, 0.2] / 0.5
    # off: ignored
    idx, _, _ = _route(SOFT_LOGITS, MoEConfig(n_experts=4, top_k=2), bias=[0.0, 0.25, 0.0, 0.0])
    np.testing.assert_array_equal(idx, [3, 2])


def test_sigmoid_no_norm():
    cfg = MoEConfig(n_experts=4, top_k=2, score_func="sigmoid", norm_topk_prob=False)
    idx, w, _ = _route(SIG_LOGITS, cfg)
    np.testing.assert_allclose(w, [0.75, 0.5], rtol=1e-6)


# scores [0.9, 0.1 | 0.6, 0.5 | 0.8, 0.05 | 0.3, 0.3]; group sums of top-2: 1.0, 1.1, 0.85, 0.6
GROUP_SCORES = (0.9, 0.1, 0.6, 0.5, 0.8, 0.05, 0.3, 0.3)


def test_group_limited_selection():
    logits = [_logit(p) for p in GROUP_SCORES]
    cfg = MoEConfig(n_experts=8, top_k=2, score_func="sigmoid", n_groups=4, topk_groups=2)
    idx, w, _ = _route(logits, cfg)
    # groups 1 and 0 kept -> candidates {0: 0.9, 1: 0.1, 2: 0.6, 3: 0.5} -> experts 0, 2 (not 4)
    np.testing.assert_array_equal(idx, [0, 2])
    np.testing.assert_allclose(w, [0.6, 0.4], rtol=1e-6)  # [0.9, 0.6] / 1.5
    cfg1 = MoEConfig(n_experts=8, top_k=2, score_func="sigmoid")
    idx, _, _ = _route(logits, cfg1)
    np.testing.assert_array_equal(idx, [0, 4])  # without the group limit expert 4 (0.8) wins


def test_group_selection_uses_biased_scores():
    logits = [_logit(p) for p in GROUP_SCORES]
    cfg = MoEConfig(n_experts=8, top_k=2, score_func="sigmoid", n_groups=4, topk_groups=2,
                    use_expert_bias=True)
    # +0.5 on expert 6: biased group sums 1.0, 1.1, 0.85, 1.1 (group 3 = 0.8 + 0.3) -> groups 1
    # and 3 kept. Candidates (biased): e2 0.6, e3 0.5, e6 0.8, e7 0.3 -> experts 6, 2; weights
    # from the unbiased s: [0.3, 0.6] / 0.9
    bias = [0, 0, 0, 0, 0, 0, 0.5, 0]
    idx, w, _ = _route(logits, cfg, bias=bias)
    np.testing.assert_array_equal(idx, [6, 2])
    np.testing.assert_allclose(w, [1 / 3, 2 / 3], rtol=1e-5)


def test_lax_top_k_ties_lower_index_first():
    vals, idx = jax.lax.top_k(jnp.asarray([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0] * 5]), 3)
    np.testing.assert_array_equal(idx, [[1, 2, 4], [0, 1, 2]])


def test_exact_ties_go_to_lower_index():
    cfg = MoEConfig(n_experts=4, top_k=2)
    idx, w, _ = _route([1.0, 2.0, 2.0, 0.0], cfg)
    np.testing.assert_array_equal(idx, [1, 2])
    np.testing.assert_allclose(w, [0.5, 0.5], rtol=1e-6)
    idx, _, _ = _route([0.0, 0.0, 0.0, 0.0], cfg)
    np.testing.assert_array_equal(idx, [0, 1])
    # groups tie too: all scores equal -> groups 0, 1 kept, experts 0, 1
    cfg_g = MoEConfig(n_experts=8, top_k=2, score_func="sigmoid", n_groups=4, topk_groups=2)
    idx, _, _ = _route([0.0] * 8, cfg_g)
    np.testing.assert_array_equal(idx, [0, 1])
    # tie between groups: groups 2 and 3 tie for second place -> group 2 kept; e5 (group 2) wins
    # over e7 (group 3) even though they have equal scores and only groups {0, 2} survive
    logits = [_logit(p) for p in (0.9, 0.8, 0.2, 0.2, 0.5, 0.6, 0.5, 0.6)]
    idx, _, _ = _route(logits, cfg_g)
    # group sums 1.7, 0.4, 1.1, 1.1 -> keep 0 and 2 -> candidates 0.9, 0.8, 0.5, 0.6 -> [0, 1]
    np.testing.assert_array_equal(idx, [0, 1])
    cfg_g3 = MoEConfig(n_experts=8, top_k=3, score_func="sigmoid", n_groups=4, topk_groups=2)
    idx, _, _ = _route(logits, cfg_g3)
    np.testing.assert_array_equal(idx, [0, 1, 5])  # e5 (group 2), not e7 (group 3)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_forced_routing(score_func):
    cfg = MoEConfig(n_experts=4, top_k=2, score_func=score_func)
    logits = SOFT_LOGITS if score_func == "softmax" else SIG_LOGITS
    idx, w, _ = _route(logits, cfg, forced=[0, 3])
    np.testing.assert_array_equal(idx, [0, 3])
    if score_func == "softmax":
        np.testing.assert_allclose(w, [0.2, 0.8], rtol=1e-6)  # [0.1, 0.4] / 0.5
    else:
        np.testing.assert_allclose(w, [0.5 / 0.6, 0.1 / 0.6], rtol=1e-6)  # [0.5, 0.1] / 0.6


def test_router_is_fp32_for_bf16_inputs():
    cfg = MoEConfig(n_experts=4, top_k=2)
    x = jnp.ones((3, 4), jnp.bfloat16)
    r = route(x, jnp.ones((4, 4)), None, cfg)
    assert r.logits.dtype == jnp.float32 and r.topk_weights.dtype == jnp.float32
    assert r.topk_idx.dtype == jnp.int32
