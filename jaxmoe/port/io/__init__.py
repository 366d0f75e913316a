"""Raw file formats, no model knowledge: safetensors, DCP step directories (read without running
their code, ``.metadata`` written without torch), ``torch.save``'s zip, the ``[in, out]`` <->
``[out, in]`` transpose, and the HF files carried beside the weights (tokenizer, token ids).

May import: ``jaxmoe.storage``, ``jaxmoe.errors``.
"""
