"""Multi-token prediction (issue 39, item 2): ``model.mtp_layers`` / ``train.mtp_loss_coef``.

(a) the shift and its mask on a small row, by hand (jaxmoe and torch_ref), and the loss on
logits written by hand; (b) jaxmoe vs torch_ref on a tiny MLA MoE model with 1 and 2 depths:
the losses (``mtp_ce`` included) and EVERY gradient, through the parity sides (the HF name map
carries the MTP tensors to torch_ref, so it is checked too); (c) ``mtp_layers = 0`` changes
nothing, and the MTP depths leave the main forward alone; (d) bad values: one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxmoe.config import load_config
from jaxmoe.errors import ConfigError
from jaxmoe.model.mtp import shifted
from jaxmoe.model.transformer import Model
from jaxmoe.train.losses import mtp_cross_entropy, mtp_targets
from jaxmoe.train.objective import make_grad_fn
from jaxmoe.trees import flatten
from parity.sides import JaxSide, TorchSide, init_weights, make_batches, setup_numerics, to_hf
from torch_ref.layers import shift_left


def _cfg(n, **kw):
    sets = [f"model.mtp_layers={n}", "model.n_layers=2", "train.batch_size=2", "train.seq_len=16",
            "moe.compute_path=dense"]
    sets += [f"{k}={v}" for k, v in kw.items()]
    return load_config(preset="tiny-mla", overrides=sets)


# --------------------------------------------------------------------------------------------
# (a) by hand
# --------------------------------------------------------------------------------------------


def test_shift_and_mask_by_hand():
    tok = np.array([[10, 11, 12, 13, 14, 15]], np.int32)
    seg = np.array([[1, 1, 1, 2, 2, 0]], np.int32)
    got, ok = shifted(jnp.asarray(tok), 2)
    np.testing.assert_array_equal(np.asarray(got), [[12, 13, 14, 15, 0, 0]])
    np.testing.assert_array_equal(np.asarray(ok), [[1, 1, 1, 1, 0, 0]])
    # packed: position i is valid only when i + k lies in the same document
    got, ok = shifted(jnp.asarray(tok), 1, jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(got), [[11, 12, 0, 14, 0, 0]])
    np.testing.assert_array_equal(np.asarray(ok), [[1, 1, 0, 1, 0, 0]])
    t_got, t_ok = shift_left(torch.from_numpy(tok).long(), 1, torch.from_numpy(seg).long())
    np.testing.assert_array_equal(t_got.numpy(), [[11, 12, 0, 14, 0, 0]])
    np.testing.assert_array_equal(t_ok.numpy(), np.asarray(ok))
    # targets of depth k are the targets shifted by k (token i + k + 1), the mask follows
    batch = {"targets": jnp.asarray([[1, 2, 3, 4]]), "mask": jnp.asarray([[1.0, 1.0, 0.0, 1.0]])}
    t, m = mtp_targets(batch, 1)
    np.testing.assert_array_equal(np.asarray(t), [[2, 3, 4, 0]])
    np.testing.assert_array_equal(np.asarray(m), [[1, 0, 1, 0]])


def test_mtp_loss_by_hand():
    """Two depths, V = 2, logits [0, log 3] everywhere: -log p(1) = log(4/3), -log p(0) = log 4.
    targets [1, 0, 1, 1], mask all 1 (4 main valid tokens):
    depth 1 targets [0, 1, 1, -] -> log 4 + 2 log(4/3); depth 2 [1, 1, -, -] -> 2 log(4/3);
    mtp_ce = mean over depths of (sum / 4)."""
    cfg = _cfg(2)
    lg = jnp.broadcast_to(jnp.asarray([0.0, np.log(3.0)], jnp.float32), (2, 1, 4, 2))
    batch = {"targets": jnp.asarray([[1, 0, 1, 1]]), "mask": jnp.ones((1, 4))}
    got = float(mtp_cross_entropy(cfg, {"mtp_logits": lg}, batch))
    a, b = np.log(4 / 3), np.log(4.0)
    want = ((b + 2 * a) / 4 + (2 * a) / 4) / 2
    assert got == pytest.approx(want, rel=1e-6)


# --------------------------------------------------------------------------------------------
# (b) jaxmoe vs torch_ref: losses and every gradient
# --------------------------------------------------------------------------------------------


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


@pytest.mark.parametrize("n,packed", [(1, False), (2, True)])
def test_jax_vs_torch_ref_losses_and_every_gradient(n, packed):
    setup_numerics()
    cfg = _cfg(n)
    params, buffers = init_weights(cfg, 0, True, 1.0)
    js = JaxSide(cfg, params, buffers)
    ts = TorchSide(cfg, to_hf(cfg, params, buffers))
    batch = make_batches(cfg, 1, 0, packed=packed)[0]
    jf, tf = js.forward(batch), ts.forward(batch)
    assert jf["losses"]["mtp_ce"] > 1.0  # ~log V: a real term
    for k in ("ce", "mtp_ce", "loss"):
        assert jf["losses"][k] == pytest.approx(tf["losses"][k], rel=2e-5), k
    jg, tg = js.grads(batch), ts.grads(batch)
    assert set(jg) == set(tg)
    mtp_names = [k for k in tg if k.startswith(f"model.layers.{cfg.model.n_layers}.")]
    assert any("eh_proj" in k for k in mtp_names) and any("shared_head.norm" in k for k in mtp_names)
    for name in tg:
        assert _rel(jg[name], tg[name]) < 2e-4, name
    for name in mtp_names:  # the MTP depths are trained (all of them, the last one included)
        if "experts." not in name:
            assert np.abs(tg[name]).max() > 0, name


# --------------------------------------------------------------------------------------------
# (c) mtp_layers = 0 changes nothing; the depths leave the main forward alone
# --------------------------------------------------------------------------------------------


def test_zero_depths_is_the_old_model_and_depths_leave_main_alone():
    setup_numerics()
    base, with_mtp = _cfg(0), _cfg(1, **{"train.mtp_loss_coef": 0.0})
    p0, b0 = init_weights(base, 0, True, 1.0)
    assert "mtp" not in p0 and "mtp" not in b0
    p1, b1 = init_weights(with_mtp, 0, True, 1.0)
    p1 = {**p0, "mtp": p1["mtp"]}
    b1 = {**b0, "mtp": b1["mtp"]}
    batch = {k: jnp.asarray(v) for k, v in make_batches(base, 1, 0)[0].items()}
    (g0, m0, _), (g1, m1, _) = (jax.jit(make_grad_fn(Model(c)))(p, b, batch)
                                for c, p, b in ((base, p0, b0), (with_mtp, p1, b1)))
    assert "mtp_ce" not in m0 and float(m1["mtp_ce"]) > 1.0
    assert float(m0["ce"]) == float(m1["ce"]) and float(m0["loss"]) == float(m1["loss"])
    assert set(g1) == set(g0) | {"mtp"}
    for name, a in flatten(g0).items():  # coefficient 0: the main gradients are the old model's
        np.testing.assert_allclose(flatten(g1)[name], a, rtol=0, atol=1e-7, err_msg=name)


# --------------------------------------------------------------------------------------------
# (d) bad values
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key,value,pattern", [
    ("model.mtp_layers", -1, "model.mtp_layers=-1 must be >= 0"),
    ("train.mtp_loss_coef", -0.5, "train.mtp_loss_coef=-0.5 must be >= 0"),
])
def test_bad_values_one_line(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(preset="tiny-mla", overrides=[f"{key}={value}"])
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# (e) porting: hf -> orbax -> hf byte-identical with the MTP layer; one line for a mismatch
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_hf_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 HF checkpoint with num_nextn_predict_layers = 1 (fp32), written by
    torch_ref (transformers' DeepseekV3 builds no MTP layer, so it cannot write one)."""
    from torch_ref.hf_io import save_hf
    from torch_ref.transformer import TorchTransformer

    cfg = _cfg(1)
    model = TorchTransformer(cfg, seed=0)
    with torch.no_grad():
        for b in model.expert_biases():
            b.copy_(torch.randn(b.shape) * 0.03)
    d = save_hf(model, tmp_path_factory.mktemp("mtp") / "hf")
    return cfg, d


def test_hf_orbax_hf_keeps_every_tensor_with_mtp(mtp_hf_dir, tmp_path):
    import json

    from hf_models import same_tensors

    from jaxmoe.port.commands.convert import convert
    from jaxmoe.port.formats import parse_endpoint as ep
    from jaxmoe.port.io.safetensors_io import SafetensorsReader

    cfg, d = mtp_hf_dir
    names = SafetensorsReader(d).names()
    mtp = [n for n in names if n.startswith("model.layers.2.")]
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias"} <= set(mtp)
    assert json.loads((d / "config.json").read_text())["num_nextn_predict_layers"] == 1
    convert(ep(f"hf:{d}"), ep(f"orbax:{tmp_path}/run"))
    convert(ep(f"orbax:{tmp_path}/run"), ep(f"hf:{tmp_path}/back"))
    assert same_tensors(d, tmp_path / "back") == len(names)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("nextn,pattern", [
    (0, r"has multi-token-prediction layers model\.layers\.2\.\* \(\d+ tensors\) but model\.mtp_layers=0: "
        r"set model\.mtp_layers=1"),
    (2, r"model\.mtp_layers=2 but the checkpoint has 1 multi-token-prediction layers: set model\.mtp_layers=1"),
])
def test_mtp_layers_not_matching_the_checkpoint_one_line(mtp_hf_dir, tmp_path, nextn, pattern):
    import json
    import shutil

    from jaxmoe.errors import UserError
    from jaxmoe.port.commands.convert import convert
    from jaxmoe.port.formats import parse_endpoint as ep

    _, d = mtp_hf_dir
    src = tmp_path / "src"
    shutil.copytree(d, src)
    c = json.loads((src / "config.json").read_text())
    c["num_nextn_predict_layers"] = nextn
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(UserError, match=pattern) as e:
        convert(ep(f"hf:{src}"), ep(f"orbax:{tmp_path}/run"))
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_count_mtp_apart():
    from jaxmoe.config.counting import count_params

    c0, c1 = count_params(_cfg(0)), count_params(_cfg(1))
    assert c0["mtp_params"] == 0 and c1["total_params"] == c0["total_params"]
    cfg = _cfg(1)
    from jaxmoe.model.transformer import abstract_params, param_count

    assert c1["mtp_params"] == param_count(abstract_params(cfg)[0]["mtp"])
    v3 = count_params(load_config("deepseek-v3-671b"))
    assert round(v3["total_params"] / 1e9) == 671
    assert 11e9 < v3["mtp_params"] < 12e9 and round(v3["mtp_params_hf_stored"] / 1e9, 1) == 13.5


def test_dcp_refuses_mtp_in_one_line(mtp_hf_dir, tmp_path):
    from jaxmoe.errors import UserError
    from jaxmoe.port.commands.convert import convert
    from jaxmoe.port.formats import parse_endpoint as ep

    _, d = mtp_hf_dir
    with pytest.raises(UserError, match=r"model\.mtp_layers=1: the torchtitan \(dcp:\) name map has no") as e:
        convert(ep(f"hf:{d}"), ep(f"dcp:{tmp_path}/dcp"))
    assert "\n" not in str(e.value) and not (tmp_path / "dcp").exists()


# --------------------------------------------------------------------------------------------
# (f) training: mtp_ce in metrics.jsonl; micro-batches sum the MTP term exactly like the CE
# --------------------------------------------------------------------------------------------


def test_train_writes_mtp_ce_and_micro_batches_sum_it(tmp_path):
    import json

    from jaxmoe.cli import main

    base = ["model.mtp_layers=1", "train.batch_size=4", "train.seq_len=16", "train.eval_every=0",
            "moe.lb_coef=0", "moe.seq_aux_coef=0", "moe.router_z_coef=0"]
    args = ["train", "--quiet", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "run")]
    for s in base + ["train.micro_batches=2"]:
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["mtp_ce"] > 1.0 for r in rows)
    # the step's gradients with 2 micro-batches = with 1 (the MTP CE is a global sum, as the CE)
    grads = []
    for n in (1, 2):
        cfg = load_config(preset="tiny", overrides=base + [f"train.micro_batches={n}"])
        params, buffers = init_weights(cfg, 0, False, 1.0)
        batch = {k: jnp.asarray(v) for k, v in make_batches(cfg, 1, 0)[0].items()}
        g, m, _ = jax.jit(make_grad_fn(Model(cfg)))(params, buffers, batch)
        grads.append((flatten(g), float(m["mtp_ce"])))
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-6)
    for name, a in grads[0][0].items():
        assert _rel(grads[1][0][name], a) < 1e-5, name
