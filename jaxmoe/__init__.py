"""jaxmoe: a JAX/Flax Mixture-of-Experts trainer.

The Flax API, importable from here::

    import jaxmoe, optax
    from flax import nnx

    cfg = jaxmoe.load_config("tiny")
    model = jaxmoe.Transformer(cfg, rngs=nnx.Rngs(0))      # an nnx.Module (nnx.display(model))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    loss, grads = nnx.value_and_grad(jaxmoe.lm_loss)(model, batch)
    opt.update(model, grads)

Kept light on purpose: the names below are loaded on first use, so that ``import jaxmoe.config``
never imports jax (torch_ref shares the config).
"""

__version__ = "0.1.0"

# name -> module that defines it (loaded lazily, see the module doc)
_API = {
    "Config": "jaxmoe.config",
    "load_config": "jaxmoe.config",
    "Transformer": "jaxmoe.model.transformer",
    "MoEBlock": "jaxmoe.model.moe",
    "Experts": "jaxmoe.model.experts",
    "apply_model": "jaxmoe.model.transformer",
    "init_params": "jaxmoe.model.transformer",
    "compute_loss": "jaxmoe.train.losses",
    "lm_loss": "jaxmoe.train.objective",
    "make_data": "jaxmoe.data",
}

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'jaxmoe' has no attribute {name!r}")
