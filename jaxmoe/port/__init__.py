"""Checkpoint porting between HuggingFace (safetensors, hub names), torch_ref files and jaxmoe
Orbax run dirs.

* :mod:`jaxmoe.port.hf_map` - one table per architecture: HF tensor name <-> jaxmoe leaf slice.
* :mod:`jaxmoe.port.safetensors_io` - streaming safetensors read/write, sharded index, FP8 dequant.
* :mod:`jaxmoe.port.convert` - the ``jaxmoe convert`` / ``jaxmoe logits`` commands and ``--verify``.

Importing this package is cheap (no jax); ``convert`` imports jax when it runs a model.
"""
