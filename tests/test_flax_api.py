"""The public Flax API: the model is an nnx.Module a user can instantiate, inspect, run and train
with optax in a few lines (the README's example), and every parameter's metadata comes from its
declaration in the module that creates it."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxmoe
from jaxmoe.config import load_config


def test_model_is_an_nnx_module_that_trains_with_optax():
    cfg = load_config("tiny", overrides=["train.seq_len=32", "train.batch_size=4"])
    model = jaxmoe.Transformer(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model, nnx.Module)
    assert isinstance(model.moe, jaxmoe.MoEBlock) and isinstance(model.moe.experts, jaxmoe.Experts)
    assert model.moe.experts.gate_proj.shape == (2, 8, 64, 64)  # [layers, E, D, I]
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    data = jaxmoe.make_data(cfg, "train")

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(jaxmoe.lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    batch = {k: jnp.asarray(v) for k, v in data.next_batch().items()}
    losses = [float(step(model, opt, batch)) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[2] < losses[0], losses
    logits, aux = model(batch["inputs"])
    assert logits.shape == (4, 32, 256) and aux["router"]["topk_idx"].shape == (2, 4 * 32, 2)


def test_a_block_runs_standalone():
    cfg = load_config("tiny-mla")
    block = jaxmoe.MoEBlock(cfg, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, 8, 64))
    y, routing = block(x)
    assert y.shape == x.shape and routing["topk_idx"].shape == (16, 2)
    # a standalone block is materialised (not left as declarations) and has no layer axis
    assert block.router.get_value().shape == (64, 8) and float(jnp.std(block.router.get_value())) > 0


def test_every_leaf_metadata_comes_from_its_declaration(monkeypatch):
    """Sharding specs and optimizer groups follow the declaration: change one declaration (the
    q projection's logical axes and optimizer group) and both follow, with no table to edit."""
    from jaxmoe.model import transformer
    from jaxmoe.model.params import Linear
    from jaxmoe.parallel.sharding import param_specs
    from jaxmoe.train.optim import param_labels

    cfg = load_config("tiny")
    decl = transformer.model_declarations(cfg)
    for path, d in decl.items():
        assert len(d.axes) == len(d.shape), path
        assert (d.group is not None) == d.trained, path
        assert d.axes[0] == "layers" if path.startswith(("dense/", "moe/")) else "layers" not in d.axes
    sizes = {"replica": 1, "fsdp": 2, "expert": 1, "tensor": 2}
    params, _ = transformer.abstract_params(cfg)
    spec = param_specs(params, {k: d.axes for k, d in decl.items()}, sizes)["moe"]["attn"]["q_proj"]
    assert tuple(spec) == (None, "fsdp", "tensor")

    real = Linear.declare

    def patched(shape, axes, init, **meta):
        if axes[-1] == "heads" and shape[-1] == 64 and shape[-2] == 64 and axes[-2] == "embed":
            return real(shape, axes[:-2] + ("heads", "embed"), init, group="vector")
        return real(shape, axes, init, **meta)

    monkeypatch.setattr(Linear, "declare", staticmethod(patched))
    transformer._TEMPLATES.clear()
    cfg2 = load_config("tiny", overrides=["train.seed=1"])  # another template key
    decl2 = transformer.model_declarations(cfg2)
    assert decl2["moe/attn/q_proj"].axes == ("layers", "heads", "embed")
    spec2 = param_specs(params, {k: d.axes for k, d in decl2.items()}, sizes)["moe"]["attn"]["q_proj"]
    assert tuple(spec2) == (None, "tensor", "fsdp")
    labels = param_labels(transformer.declared_groups(cfg2))
    assert labels["moe"]["attn"]["q_proj"] == "adamw" and labels["moe"]["attn"]["k_proj"] == "muon"
    transformer._TEMPLATES.clear()


def test_import_jaxmoe_is_light():
    import subprocess

    code = "import sys, jaxmoe, jaxmoe.config; assert 'jax' not in sys.modules, 'jaxmoe imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_flax_example_runs():
    """The README's Flax example, verbatim (so it cannot rot)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"## The model as a Flax module.*?```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert np.isfinite(float(scope["loss"]))
