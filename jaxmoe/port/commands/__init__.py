"""The porting commands: ``jaxmoe convert`` (a source into a sink, atomically), ``jaxmoe logits``,
``convert --verify`` (jaxmoe against transformers / torch_ref / torchtitan's own model).

May import: ``jaxmoe.port.formats`` and below, ``torch_ref`` (the PyTorch side, lazily).
"""
