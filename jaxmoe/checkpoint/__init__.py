"""Training checkpoints and the run directory: Orbax saves (async, keep-K, atomic, exact resume,
resharding), streaming saves one Zarr chunk at a time, partial Orbax reads, and what a run
directory holds.

Importing this package is cheap; ``checkpointer`` and ``stream`` import jax and Orbax.
May import: ``jaxmoe.storage``, ``jaxmoe.config``, ``jaxmoe.errors``.
"""
