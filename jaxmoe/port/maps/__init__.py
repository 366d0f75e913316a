"""Name maps: jaxmoe leaves <-> HF tensors (per architecture, both expert layouts) and <->
torchtitan's native names, weights and training state.

May import: ``jaxmoe.port.io``, ``jaxmoe.archs``, ``jaxmoe.config``, ``jaxmoe.model`` (the
parameter declarations), ``jaxmoe.errors``, ``jaxmoe.trees``.
"""
