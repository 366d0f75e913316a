"""Checkpoint porting between HuggingFace (safetensors, hub names), torch_ref files and jaxmoe
Orbax run dirs.

* :mod:`jaxmoe.port.hf_map` - one table per architecture: HF tensor name <-> jaxmoe leaf slice.
* :mod:`jaxmoe.port.safetensors_io` - streaming safetensors read/write, sharded index, FP8 dequant.
* :mod:`jaxmoe.port.sources` - ``hf:`` / ``torch:`` / ``orbax:`` endpoints, read one leaf at a time.
* :mod:`jaxmoe.port.convert` - the sinks and :func:`~jaxmoe.port.convert.convert` itself.
* :mod:`jaxmoe.port.logits` - running a checkpoint (jax, torch_ref, HF) and ``--verify``.
* :mod:`jaxmoe.port.cli` - the ``jaxmoe convert`` / ``jaxmoe logits`` commands.

Importing this package is cheap (no jax); ``logits`` imports jax when it runs a model.
"""
