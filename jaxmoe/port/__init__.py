"""Checkpoint porting between HuggingFace (safetensors, hub names), torch_ref files and jaxmoe
Orbax run dirs.

* :mod:`jaxmoe.port.hf_map` - one table per architecture: HF tensor name <-> jaxmoe leaf slice.
* :mod:`jaxmoe.port.safetensors_io` - streaming safetensors read/write, sharded index, FP8 dequant.
* :mod:`jaxmoe.port.formats` - the table of checkpoint formats (``hf:`` / ``orbax:`` / ``torch:``),
  one module each, reading and writing one leaf at a time; the protocol in ``formats.base``.
* :mod:`jaxmoe.port.hf_meta` - non-weight HF files (tokenizer, token ids) carried along.
* :mod:`jaxmoe.port.orbax_read` - partial reads of an Orbax leaf (a layer's / expert's slice).
* :mod:`jaxmoe.port.convert` - :func:`~jaxmoe.port.convert.convert`: a source into a sink.
* :mod:`jaxmoe.port.logits` - running a checkpoint (jax, torch_ref, HF).
* :mod:`jaxmoe.port.verify` - ``convert --verify``: both sides in different frameworks.
* :mod:`jaxmoe.port.cli` - the ``jaxmoe convert`` / ``jaxmoe logits`` commands.

Importing this package is cheap (no jax); ``logits`` imports jax when it runs a model.
"""
