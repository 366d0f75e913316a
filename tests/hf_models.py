"""Shared by the HF checkpoint tests: a random transformers model of a preset's family and a
bit-exact comparison of two safetensors checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def random_hf_model(cfg, seed: int = 0, weight_scale: float = 1.0):
    """transformers' model of ``cfg``'s family (``to_hf_config``), random init with torch seed
    ``seed``, every weight matrix times ``weight_scale`` (decisive logits), and the expert-bias
    buffer (which the init leaves at zero) random, so its mapping is exercised."""
    import torch
    import transformers

    from jaxmoe.config.hf import to_hf_config

    d = to_hf_config(cfg)
    arch = d["architectures"][0]
    hcfg = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(d)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hcfg).eval()
    with torch.no_grad():
        if weight_scale != 1.0:
            for p in model.parameters():
                if p.ndim >= 2:
                    p.mul_(weight_scale)
        for name, b in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def same_tensors(a: Path, b: Path) -> int:
    """Assert that checkpoints ``a`` and ``b`` hold the same tensor names, dtypes, shapes and
    bytes; returns the number of tensors."""
    from jaxmoe.port.io.safetensors_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    assert sorted(ra.names()) == sorted(rb.names())
    for n in ra.names():
        x, y = ra.get(n), rb.get(n)
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), n  # bit-exact
    return len(ra.names())
