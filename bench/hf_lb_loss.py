"""HF's Mixtral load-balance loss (``aux_loss``) against jaxmoe's two forms, on one batch.

A random-init transformers ``MixtralForCausalLM`` built from the ``mixtral-tiny`` preset (with
``--layers`` layers) runs on a 2 x 16 batch with ``output_router_logits=True``, without and with an
attention mask (right padding); jaxmoe's :func:`jaxmoe.train.losses.router_losses` is computed from the
same router logits with ``moe.lb_scope = "layer"`` (the per-layer sum) and with the HF import's
config (``"pooled"``). Prints one line per mask case. Needs torch and transformers (``[ref]``).

    python bench/hf_lb_loss.py --layers 3
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxmoe.config import load_config
from jaxmoe.config.hf import from_hf_config, to_hf_config
from jaxmoe.train.losses import router_losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args()
    cfg = load_config("mixtral-tiny", overrides=[f"model.n_layers={args.layers}"])
    d = to_hf_config(cfg)
    imported = from_hf_config(d)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig.from_dict(d)).eval()
    tok = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    for am in (None, mask):
        with torch.no_grad():
            out = model(input_ids=tok, attention_mask=am, output_router_logits=True)
        lg = np.stack([x.float().numpy() for x in out.router_logits])
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        idx = np.argsort(-p, -1, kind="stable")[..., : cfg.moe.top_k].astype(np.int32)
        rec = {"logits": jnp.asarray(lg), "scores": jnp.asarray(p), "topk_idx": jnp.asarray(idx)}
        pad = None if am is None else jnp.asarray(am.numpy())
        layer = float(router_losses(cfg, rec, 2, 16, pad)["lb"])
        pooled = float(router_losses(imported, rec, 2, 16, pad)["lb"])
        print(f"attention mask {am is not None}: {lg.shape[0]} MoE layers, k={cfg.moe.top_k}: "
              f"HF aux_loss {float(out.aux_loss):.6f}, jaxmoe pooled {pooled:.6f}, "
              f"jaxmoe per-layer {layer:.6f}")


if __name__ == "__main__":
    main()
