"""jaxmoe: a JAX/Flax Mixture-of-Experts trainer.

Kept light on purpose: ``import jaxmoe.config`` must not import jax (torch_ref shares the config).
"""

__version__ = "0.1.0"
