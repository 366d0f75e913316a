"""Checkpoint porting between HuggingFace (safetensors, hub names), torch_ref files, torchtitan
DCP steps and jaxmoe Orbax run dirs, in four layers (each imports only the ones before it):

* :mod:`jaxmoe.port.io` - raw file formats (safetensors, DCP, ``torch.save``'s zip, HF meta files).
* :mod:`jaxmoe.port.maps` - name maps: jaxmoe leaves <-> HF tensors, <-> torchtitan names and state.
* :mod:`jaxmoe.port.formats` - the table of checkpoint schemes (``hf:`` / ``orbax:`` / ``torch:`` /
  ``dcp:``), one module each, reading and writing one leaf at a time; the protocol in ``formats.base``.
* :mod:`jaxmoe.port.commands` - ``jaxmoe convert`` / ``logits`` and ``convert --verify``.

Importing this package is cheap (no jax); ``logits`` imports jax when it runs a model.
"""
