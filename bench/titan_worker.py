"""torchtitan as the peer of ``bench/gpu.sh``: one process that builds torchtitan's Qwen3-style MoE
at a bench shape and times its training steps (its own process: jaxmoe never imports torchtitan).

    python bench/titan_worker.py --shape JSON [--steps 10] [--compile] [--attn flex|sdpa]
                                 [--device cuda|cpu]

``--shape`` is one of ``bench/gpu.py``'s throughput shapes (the same ``model.*`` / ``moe.*`` /
``train.*`` keys as jaxmoe's config overrides). The model is torchtitan's ``Qwen3Model`` built from
torchtitan's own config helpers (``make_gqa_config``, ``make_moe_config``, ...) at those dims:
grouped-query attention (with QK-norm where the shape has ``model.qk_norm=true``), a softmax
top-k router with renormalised weights, and its default ``GroupedExperts`` (``torch._grouped_mm``
on bf16 operands); no shared expert, no load-balancing bias update (``load_balance_coeff=None``;
the jaxmoe variants run with every auxiliary loss off too). The step is what a one-GPU torchtitan
run does: fp32 parameters and AdamW state (as jaxmoe's fp32 master weights), the forward under
``torch.autocast(bfloat16)``, cross-entropy on the logits, backward, global-norm clipping at 1.0,
``AdamW`` (fused on CUDA). ``--compile`` compiles each transformer block with ``torch.compile``
(as torchtitan's ``apply_compile`` does, graph breaks allowed); ``--attn flex`` is torchtitan's FlexAttention with its
causal block mask from the positions, ``sdpa`` its ``ScaledDotProductAttention`` (causal), which
the CPU dry run uses. One ``RESULT {json}`` line on stdout: tokens/s (median step), the step
times, losses, peak device memory (CUDA) and the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _norm(dim: int):
    from torch import nn
    from torchtitan.models.common.nn_modules import RMSNorm

    return RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={"weight": nn.init.ones_})


def titan_config(shape: dict, attn: str):
    """torchtitan's ``Qwen3Model.Config`` at ``shape``'s dims, ``attn`` = flex or sdpa."""
    from functools import partial

    from torch import nn
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    d, hd = int(shape["model.d_model"]), int(shape["model.head_dim"])
    n_layers, vocab = int(shape["model.n_layers"]), int(shape["model.vocab_size"])
    e, k, f = int(shape["moe.n_experts"]), int(shape["moe.top_k"]), int(shape["moe.expert_ffn_dim"])
    qk_norm = str(shape.get("model.qk_norm", "false")).lower() == "true"
    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    out_init = {"weight": partial(nn.init.normal_, std=0.02 / (2 * n_layers) ** 0.5), "bias": nn.init.zeros_}
    experts_init = {"w1_EFD": init["weight"], "w3_EFD": init["weight"], "w2_EDF": out_init["weight"]}
    inner = ScaledDotProductAttention.Config() if attn == "sdpa" else get_attention_config(attn)
    rope = CosSinRoPE.Config(dim=hd, max_seq_len=int(shape["model.max_seq_len"]), theta=1e6)
    layers = []
    for _ in range(n_layers):
        layers.append(Qwen3TransformerBlock.Config(
            attention_norm=_norm(d), ffn_norm=_norm(d),
            attention=make_gqa_config(dim=d, n_heads=int(shape["model.n_heads"]),
                                      n_kv_heads=int(shape["model.n_kv_heads"]), head_dim=hd,
                                      wqkv_param_init=init, wo_param_init=out_init, inner_attention=inner,
                                      fuse_qkv=True, rope=rope, qk_norm=_norm(hd) if qk_norm else None),
            moe=make_moe_config(
                num_experts=e, load_balance_coeff=None,
                router=make_router_config(dim=d, num_experts=e, gate_param_init=init, top_k=k,
                                          score_func="softmax", route_norm=True),
                routed_experts=make_routed_experts_config(dim=d, hidden_dim=f, num_experts=e, top_k=k,
                                                          param_init=experts_init, comm_backend="standard")),
        ))
    return Qwen3Model.Config(
        vocab_size=vocab, dim=d, norm=_norm(d),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=d, param_init=init),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=init), layers=layers)


def run(shape: dict, steps: int, compile_blocks: bool, attn: str, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dev = torch.device(device)
    with torch.device(dev):
        model = titan_config(shape, attn).build()
    model.init_states(buffer_device=dev)
    model.train()
    if compile_blocks:  # as torchtitan's apply_compile: each transformer block on its own
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    b, s, vocab = int(shape["train.batch_size"]), int(shape["train.seq_len"]), int(shape["model.vocab_size"])
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, vocab, (b, s + 1), generator=g).to(dev)
    inputs, targets = toks[:, :-1], toks[:, 1:]
    masks = None
    if attn != "sdpa":  # one document per row: the causal block mask from the positions
        masks = model.get_attention_masks(torch.arange(s, device=dev).expand(b, s))

    def step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(inputs, attention_masks=masks) if masks is not None else model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    loss_first = float(step())  # compiles, if --compile
    first_s = time.perf_counter() - t
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    return {"framework": "torchtitan", "compile": compile_blocks, "attention": attn, "device": device,
            "torch": torch.__version__, "first_step_s": round(first_s, 3), "step_s": dt,
            "step_s_range": [min(times), max(times)], "tokens_per_s": b * s / dt, "loss_first": loss_first,
            "loss_last": float(loss), "peak_device_bytes":
                int(torch.cuda.max_memory_allocated()) if dev.type == "cuda" else None,
            "n_params": sum(p.numel() for p in model.parameters())}


def attach_ratios(results: list[dict]) -> list[str]:
    """Per jaxmoe throughput variant: ``torchtitan_tokens_per_s`` (the fastest torchtitan variant
    of its shape), ``ratio_to_torchtitan``; returns one ``jaxmoe / torchtitan`` line per shape."""
    best_t, best_j = {}, {}
    for r in results:
        shape = r["name"].split("/")[0]
        tps = r.get("tokens_per_s")
        if not tps:
            continue
        table = best_t if r.get("kind") == "torchtitan" else best_j if r.get("kind") == "throughput" else None
        if table is not None and tps > table.get(shape, (0, ""))[0]:
            table[shape] = (tps, r["name"])
    for r in results:
        if r.get("kind") == "throughput" and r.get("tokens_per_s"):
            t = best_t.get(r["name"].split("/")[0])
            r["torchtitan_tokens_per_s"] = t[0] if t else None
            r["ratio_to_torchtitan"] = r["tokens_per_s"] / t[0] if t else None
    lines = []
    for shape, (tps, name) in best_j.items():
        t = best_t.get(shape)
        lines.append(f"{shape}: jaxmoe / torchtitan = " + (f"{tps / t[0]:.2f} ({name} {tps:.0f} tok/s, {t[1]} "
                                                            f"{t[0]:.0f} tok/s)" if t else "n/a (no torchtitan run)"))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, help="JSON: a bench/gpu.py throughput shape")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--attn", default="flex", choices=("flex", "sdpa"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    rec = run(json.loads(args.shape), args.steps, args.compile, args.attn, args.device)
    print("RESULT " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
