"""jaxmoe.train.optim against torch: Muon vs torch.optim.Muon, AdamW vs torch.optim.AdamW, clipping vs
torch.nn.utils.clip_grad_norm_, schedules at hand-computed steps, labels and decay masks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.optim._muon as torch_muon

from jaxmoe.config.schema import OptimConfig
from jaxmoe.train.optim import (
    build_optimizer,
    clip_by_global_norm,
    decay_mask,
    lr_schedule,
    muon,
    param_labels,
)
from jaxmoe.trees import key_path_str

STEPS = 10


def layout_params(rng, *, dense=True, shared=True):
    """A small pytree shaped like docs/LAYOUT.md (Lm=2 MoE layers, Ld=1 dense layer)."""
    D, H, hd, KV, E, I, V, F, Lm, Ld = 8, 2, 4, 1, 3, 6, 16, 12, 2, 1

    def r(*s):
        return (0.1 * rng.standard_normal(s)).astype(np.float32)

    def block(L):
        return {
            "attn_norm": 1 + r(L, D),
            "ffn_norm": 1 + r(L, D),
            "attn": {
                "q_proj": r(L, D, H * hd),
                "k_proj": r(L, D, KV * hd),
                "v_proj": r(L, D, KV * hd),
                "o_proj": r(L, H * hd, D),
                "q_norm": 1 + r(L, hd),
                "k_norm": 1 + r(L, hd),
            },
        }

    p = {"embed": r(V, D), "final_norm": 1 + r(D), "lm_head": r(D, V), "moe": block(Lm)}
    p["moe"]["router"] = r(Lm, D, E)
    p["moe"]["experts"] = {"gate_proj": r(Lm, E, D, I), "up_proj": r(Lm, E, D, I),
                           "down_proj": r(Lm, E, I, D)}
    if shared:
        p["moe"]["shared"] = {"gate_proj": r(Lm, D, I), "up_proj": r(Lm, D, I),
                              "down_proj": r(Lm, I, D)}
    if dense:
        p["dense"] = block(Ld)
        p["dense"]["mlp"] = {"gate_proj": r(Ld, D, F), "up_proj": r(Ld, D, F),
                             "down_proj": r(Ld, F, D)}
    return p


def layout_groups(params):
    """The declared optimizer groups of ``layout_params``' leaves: from the model declarations
    of a config with the same leaves (dense layer, shared experts, QK-norm)."""
    from jaxmoe.config import load_config
    from jaxmoe.model.transformer import declared_groups

    cfg = load_config("tiny", overrides=["model.n_layers=3", "model.first_k_dense=1",
                                         "moe.n_shared_experts=1"])
    groups = declared_groups(cfg)

    def prune(g, p):
        return {k: prune(g[k], v) if isinstance(v, dict) else g[k] for k, v in p.items()}

    return prune(groups, params)


def flat(tree):
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[key_path_str(path)] = leaf
    return out


# ------------------------------------------------------------------------------------------
# Labels and masks
# ------------------------------------------------------------------------------------------


def test_param_labels_on_layout():
    labels = flat(param_labels(layout_groups(layout_params(np.random.default_rng(0)))))
    adamw = {k for k, v in labels.items() if v == "adamw"}
    assert adamw == {
        "embed", "lm_head", "final_norm",
        "moe/attn_norm", "moe/ffn_norm", "moe/attn/q_norm", "moe/attn/k_norm",
        "dense/attn_norm", "dense/ffn_norm", "dense/attn/q_norm", "dense/attn/k_norm",
    }
    muon_ = {k for k, v in labels.items() if v == "muon"}
    assert muon_ == {
        "moe/attn/q_proj", "moe/attn/k_proj", "moe/attn/v_proj", "moe/attn/o_proj",
        "moe/router", "moe/experts/gate_proj", "moe/experts/up_proj", "moe/experts/down_proj",
        "moe/shared/gate_proj", "moe/shared/up_proj", "moe/shared/down_proj",
        "dense/attn/q_proj", "dense/attn/k_proj", "dense/attn/v_proj", "dense/attn/o_proj",
        "dense/mlp/gate_proj", "dense/mlp/up_proj", "dense/mlp/down_proj",
    }


def test_param_labels_mla_and_unstacked():
    from jaxmoe.config import load_config
    from jaxmoe.model.transformer import declared_groups

    labels = flat(param_labels(declared_groups(load_config("tiny-mla"))))
    assert {k: labels[k] for k in ("moe/attn/q_a_norm", "moe/attn/kv_a_norm", "moe/attn/kv_a_proj",
                                   "dense/attn/q_b_proj", "final_norm")} == {
        "moe/attn/q_a_norm": "adamw", "moe/attn/kv_a_norm": "adamw", "moe/attn/kv_a_proj": "muon",
        "dense/attn/q_b_proj": "muon", "final_norm": "adamw"}
    # a group tree of any shape: labels follow the declared group alone
    assert param_labels({"w": "matrix", "bias": "vector"}) == {"w": "muon", "bias": "adamw"}


@pytest.mark.parametrize("norms,embeds", [(False, False), (True, False), (False, True)])
def test_decay_mask(norms, embeds):
    tcfg = OptimConfig(decay_norms=norms, decay_embeddings=embeds)
    groups = layout_groups(layout_params(np.random.default_rng(0)))
    mask = flat(decay_mask(groups, tcfg))
    labels = flat(param_labels(groups))
    for k, m in mask.items():
        if k == "embed":
            assert m is embeds, k
        elif k == "lm_head" or labels[k] == "muon":
            assert m is True, k
        else:  # norms
            assert m is norms, k


# ------------------------------------------------------------------------------------------
# Schedules
# ------------------------------------------------------------------------------------------


def sched(kind, **kw):
    base = dict(warmup_steps=2, min_lr_ratio=0.1, schedule=kind)
    steps = kw.pop("steps", 11)
    base.update(kw)
    f = lr_schedule(OptimConfig(**base), steps, 1.0)
    return [float(f(s)) for s in range(steps + 2)]


def test_schedule_cosine():
    v = sched("cosine")
    # warmup 0.5, 1.0; decay from step 2 (p=0) to step 10 (p=1) over 8 steps; clamped after
    exp = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 11)]
    exp += [0.1, 0.1]
    np.testing.assert_allclose(v, exp, rtol=1e-6)
    assert v[6] == pytest.approx(0.55) and v[10] == pytest.approx(0.1)


def test_schedule_linear_constant():
    np.testing.assert_allclose(sched("linear")[:7], [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55],
                               rtol=1e-6)
    assert sched("linear")[10] == pytest.approx(0.1)
    np.testing.assert_allclose(sched("constant"), [0.5] + [1.0] * 12)


def test_schedule_wsd():
    # steps=20, warmup 2, wsd_decay_frac 0.25 -> floor(5) decay steps; s0 = 20-1-5 = 14
    v = sched("wsd", steps=20, wsd_decay_frac=0.25)
    np.testing.assert_allclose(v[:15], [0.5] + [1.0] * 14, rtol=1e-6)
    np.testing.assert_allclose(v[15:20], [0.82, 0.64, 0.46, 0.28, 0.1], rtol=1e-5)
    assert v[21] == pytest.approx(0.1)


def test_schedule_no_warmup_traced():
    f = lr_schedule(OptimConfig(warmup_steps=0, schedule="linear", min_lr_ratio=0.0), 5, 2.0)
    vals = jax.jit(jax.vmap(f))(jnp.arange(5))
    np.testing.assert_allclose(vals, [2.0, 1.5, 1.0, 0.5, 0.0], atol=1e-7)


# ------------------------------------------------------------------------------------------
# Muon vs torch.optim.Muon
# ------------------------------------------------------------------------------------------

# jaxmoe shapes [..., in, out]: square, tall (in > out), wide (in < out), stacked experts, and a
# larger wide one where XLA's and torch's bf16 matmuls round some entries differently.
SHAPES = [(16, 16), (32, 8), (8, 32), (3, 24, 12), (48, 96)]


def _fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton–Schulz in float32 instead of bfloat16 (written for this test)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _run_muon(shape, seed, torch_kw, jax_kw, steps=STEPS):
    """STEPS updates of the same params/grads; returns (jaxmoe params, torch params transposed)."""
    rng = np.random.default_rng(seed)
    w = (0.1 * rng.standard_normal(shape)).astype(np.float32)  # init-sized weights
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(steps)]
    mats = w.reshape(-1, *shape[-2:])
    tparams = [torch.nn.Parameter(torch.tensor(m.T.copy())) for m in mats]  # torch [out, in]
    topt = torch.optim.Muon(tparams, **torch_kw)
    tx = muon(**jax_kw)
    p = jnp.asarray(w)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for g in grads:
        for tp, gm in zip(tparams, g.reshape(-1, *shape[-2:])):
            tp.grad = torch.tensor(gm.T.copy())
        topt.step()
        u, state = update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, u)
    ref = np.stack([tp.detach().numpy().T for tp in tparams]).reshape(shape)
    return np.asarray(p), ref


@pytest.mark.parametrize("shape,adjust", [(s, a) for s in SHAPES
                                           for a in ("original", "match_rms_adamw")][::2][:4]
                         + [(SHAPES[-1], "original"), (SHAPES[2], "match_rms_adamw")])
def test_muon_bf16_matches_torch(shape, adjust):
    lr, wd = 0.02, 0.1
    kw = dict(momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
              ns_steps=5, eps=1e-7, weight_decay=wd)
    ours, ref = _run_muon(shape, 1, dict(lr=lr, adjust_lr_fn=adjust, **kw),
                          dict(learning_rate=lr, adjust_lr=adjust, ns_dtype="bfloat16", **kw))
    # Why this tolerance: the momentum buffers depend only on the gradients, so the two runs
    # differ only through the Newton–Schulz outputs O, which are bf16 values in [-1, 1]. Where
    # XLA and torch's CPU gemm accumulate a bf16 matmul in a different order (XLA's order even
    # differs between jit and eager), an entry of O can round to the neighbouring bf16 value: at
    # most one ulp, 2^-8 for |O| <= 1. Each step moves a param by adjusted_lr * O, so after STEPS
    # steps the params differ by at most STEPS * adjusted_lr * 2^-8 (decay factors < 1 only shrink
    # it). Most entries agree exactly.
    n_in, n_out = shape[-2], shape[-1]
    ratio = math.sqrt(max(1, n_out / n_in)) if adjust == "original" else 0.2 * math.sqrt(max(shape[-2:]))
    atol = STEPS * lr * ratio * 2.0**-8
    np.testing.assert_allclose(ours, ref, rtol=0, atol=atol)


@pytest.mark.parametrize("shape,adjust,nesterov,wd", [
    (SHAPES[0], "original", True, 0.1),
    (SHAPES[1], "match_rms_adamw", False, 0.0),
    (SHAPES[2], "original", True, 0.1),
    (SHAPES[3], "none", True, 0.3),
    (SHAPES[4], "match_rms_adamw", True, 0.1),
    (SHAPES[2], "match_rms_adamw", False, 0.1),
])
def test_muon_fp32_matches_torch_algorithm_in_fp32(shape, adjust, nesterov, wd, monkeypatch):
    # torch's own Muon step, with only its Newton–Schulz swapped for an fp32 one.
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_newton_schulz)
    lr = 0.05
    kw = dict(momentum=0.9, nesterov=nesterov, ns_coefficients=(3.4445, -4.775, 2.0315),
              ns_steps=5, eps=1e-7, weight_decay=wd)
    torch_adjust = None if adjust == "none" else adjust
    if torch_adjust is None:  # torch has no "none": emulate a ratio of 1 with its shape rule
        monkeypatch.setattr(torch_muon, "_adjust_lr", lambda lr_, fn, shape_: lr_)
    ours, ref = _run_muon(shape, 2, dict(lr=lr, adjust_lr_fn=torch_adjust, **kw),
                          dict(learning_rate=lr, adjust_lr=adjust, ns_dtype="float32", **kw))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


def test_muon_orthogonalises_each_expert_separately():
    # Stacked [E, in, out]: scaling one expert's gradient must not change the others' updates.
    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 8, 8)).astype(np.float32)
    tx = muon(learning_rate=1.0, weight_decay=0.0, ns_dtype="float32", momentum=0.0)
    p = jnp.zeros((3, 8, 8))
    u1, _ = tx.update(jnp.asarray(g), tx.init(p), p)
    g2 = g.copy()
    g2[0] *= 100.0
    u2, _ = tx.update(jnp.asarray(g2), tx.init(p), p)
    np.testing.assert_allclose(u1, u2, atol=1e-5)


# ------------------------------------------------------------------------------------------
# AdamW + clipping vs torch, and the assembled optimizers
# ------------------------------------------------------------------------------------------


def _torch_groups(params_np, mask, tcfg):
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in flat(params_np).items()}
    groups = [
        {"params": [tp[k] for k in tp if mask[k]], "weight_decay": tcfg.weight_decay},
        {"params": [tp[k] for k in tp if not mask[k]], "weight_decay": 0.0},
    ]
    return tp, groups


@pytest.mark.parametrize("clip", [0.0, 5.0])
def test_adamw_matches_torch(clip):
    tcfg = OptimConfig(optimizer="adamw", lr=0.01, warmup_steps=3, schedule="cosine",
                       beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=clip)
    rng = np.random.default_rng(4)
    params_np = layout_params(rng)
    grads_np = [jax.tree_util.tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32),
                                       params_np) for _ in range(STEPS)]
    mask = flat(decay_mask(layout_groups(params_np), tcfg))
    assert not all(mask.values()) and any(mask.values())
    tp, groups = _torch_groups(params_np, mask, tcfg)
    topt = torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps)
    sched_fn = lr_schedule(tcfg, STEPS, tcfg.lr)

    tx = build_optimizer(tcfg, STEPS, params_np, layout_groups(params_np))
    params = jax.tree_util.tree_map(jnp.asarray, params_np)
    state = tx.init(params)
    update = jax.jit(tx.update)
    clipped = 0
    for step, g in enumerate(grads_np):
        for k, v in flat(g).items():
            tp[k].grad = torch.tensor(v)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), clip)
            clipped += int(norm > clip)
        for group in topt.param_groups:
            group["lr"] = float(sched_fn(step))
        topt.step()
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
    if clip:
        assert clipped == STEPS  # the clip was active
    ours = flat(params)
    for k, v in tp.items():
        np.testing.assert_allclose(np.asarray(ours[k]), v.detach().numpy(), rtol=0, atol=1e-6,
                                   err_msg=k)


def test_clip_matches_torch_rule():
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # global norm 13
    out, _ = clip_by_global_norm(1.0).update(g, optax.EmptyState())
    t = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]
    for x in t:
        x.grad = x.clone()
    torch.nn.utils.clip_grad_norm_(t, 1.0)
    np.testing.assert_allclose(out["a"], t[0].grad.numpy(), rtol=1e-7)
    np.testing.assert_allclose(out["b"], t[1].grad.numpy(), rtol=1e-7)
    small, _ = clip_by_global_norm(100.0).update(g, optax.EmptyState())
    np.testing.assert_array_equal(small["a"], g["a"])


def test_build_optimizer_muon_routes_leaves():
    """With optimizer=muon, "muon" leaves get exactly the standalone Muon update and the rest
    exactly the standalone AdamW update (clipping off)."""
    tcfg = OptimConfig(optimizer="muon", grad_clip=0.0, lr=0.01, muon_lr=0.03, warmup_steps=0,
                       schedule="constant", muon_ns_dtype="float32")
    rng = np.random.default_rng(5)
    params = jax.tree_util.tree_map(jnp.asarray, layout_params(rng))
    grads = [jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
                                    params) for _ in range(3)]
    groups = layout_groups(params)
    tx = build_optimizer(tcfg, 60, params, groups)
    ref_m = muon(0.03, momentum=tcfg.muon_momentum, nesterov=tcfg.muon_nesterov,
                 weight_decay=tcfg.muon_weight_decay, ns_dtype="float32")
    ref_a = optax.adamw(0.01, b1=tcfg.beta1, b2=tcfg.beta2, eps=tcfg.eps,
                        weight_decay=tcfg.weight_decay, mask=decay_mask(groups, tcfg))
    labels = flat(param_labels(groups))
    mats = lambda t: {k: v for k, v in flat(t).items() if labels[k] == "muon"}  # noqa: E731
    s, sm, sa = tx.init(params), ref_m.init(mats(params)), ref_a.init(params)
    p, pm, pa = params, mats(params), params
    upd, upd_m, upd_a = jax.jit(tx.update), jax.jit(ref_m.update), jax.jit(ref_a.update)
    for g in grads:
        u, s = upd(g, s, p)
        p = optax.apply_updates(p, u)
        um, sm = upd_m(mats(g), sm, pm)
        pm = optax.apply_updates(pm, um)
        ua, sa = upd_a(g, sa, pa)
        pa = optax.apply_updates(pa, ua)
    fp, fa = flat(p), flat(pa)
    assert set(pm) and set(fp) - set(pm)
    for k in fp:
        ref = pm[k] if labels[k] == "muon" else fa[k]
        np.testing.assert_allclose(fp[k], ref, rtol=0, atol=1e-6, err_msg=k)
        if labels[k] == "muon":  # and differs from what AdamW would have done
            assert np.abs(np.asarray(fp[k]) - np.asarray(fa[k])).max() > 1e-3, k
