"""The systems that ``bench/train_step.py`` times side by side: each ``make_*`` returns ``(run,
sync)``, a callable doing one train step on one fixed batch and the function that waits for its
result. They live here so that ``train_step.py`` keeps the timing protocol (workers, rounds,
ratios) and this file what is timed; ``train_step`` re-exports every name."""

from __future__ import annotations


def batch_np(seed, vocab, b, s):
    """The one fixed batch every system trains on (the same tokens on every side)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, (b, s + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "mask": np.ones((b, s), np.float32)}


def cfg_batch(cfg):
    return batch_np(0, cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len)


def make_jaxmoe(cfg):
    import jax

    from jaxmoe.model.transformer import Model, declared_groups, init_params
    from jaxmoe.train.optim import build_optimizer
    from jaxmoe.train.step import init_state, make_train_step

    params, buffers = init_params(cfg, 0)
    tx = build_optimizer(cfg.optim, cfg.train.steps, params, declared_groups(cfg))
    box = {"state": init_state(cfg, tx, params, buffers)}
    step = make_train_step(Model(cfg), tx)
    batch = {k: jax.device_put(v) for k, v in cfg_batch(cfg).items()}

    def run():
        box["state"], m = step(box["state"], batch)
        return m["loss"]

    return run, lambda x: x.block_until_ready()


def _hf_model(cfg):
    import torch
    import transformers

    from jaxmoe.archs import get_arch
    from jaxmoe.config.hf import to_hf_config

    d = to_hf_config(cfg)
    d.update(output_router_logits=False, router_aux_loss_coef=0.0, use_cache=False)
    arch = get_arch(cfg.model.hf_arch).hf_class
    hcfg = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(d)
    hcfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, arch)(hcfg).train()


def make_hf(cfg, compiled: bool):
    import torch

    model = _hf_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    b = cfg_batch(cfg)
    inputs, targets = torch.from_numpy(b["inputs"].astype("int64")), torch.from_numpy(b["targets"].astype("int64"))

    def loss_fn():
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    fwd = torch.compile(loss_fn) if compiled else loss_fn

    def run():
        opt.zero_grad(set_to_none=True)
        loss = fwd()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return run, lambda x: float(x)


def make_torch_ref(cfg):
    import torch

    from torch_ref.train import make_optimizer, make_scheduler, train_step
    from torch_ref.transformer import TorchTransformer

    model = TorchTransformer(cfg, seed=0)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    b = {k: torch.from_numpy(v.astype("int64") if v.dtype == "int32" else v) for k, v in cfg_batch(cfg).items()}
    return (lambda: train_step(model, opt, sched, b, cfg)["loss"]), lambda x: x


def make_titan(cfg, compiled: bool = False):
    """torchtitan's own model of the flavor (``cfg.model.name`` = ``titan:FAMILY/FLAVOR``) and the
    train step its ``Trainer.train_step`` makes on one process: ``optimizers.zero_grad()``, its
    ``CrossEntropyLoss`` (summed CE / valid tokens) ``.backward()``, ``dist_utils.clip_grad_norm_
    (foreach=True)``, ``optimizers.step()`` (its MoE expert-bias pre-hook, when the flavor has a
    bias, updates ``expert_bias_E``), ``lr_schedulers.step()``. The optimizer is its
    ``OptimizersContainer`` over ``default_adamw`` with its default ``implementation="fused"``
    (torch's fused AdamW, which has a CPU kernel). What differs from a GPU torchtitan run, and is
    stated in the output: attention is torchtitan's ``ScaledDotProductAttention`` (its flavors'
    FlexAttention has no CPU backward), the experts run in fp32 (its ``GroupedExperts`` casts to
    bf16 for ``torch._grouped_mm`` even in an fp32 model; jaxmoe runs fp32 too), eager unless
    ``compiled`` (each transformer block under ``torch.compile``, as its ``apply_compile``)."""
    import torch
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.distributed import utils as dist_utils

    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import NoParallelism, build_titan_model

    spec = cfg.model.name.removeprefix("titan:")
    torch.manual_seed(0)
    model = build_titan_model(titan_model_config(spec), fp32_experts=True)
    model.init_states(buffer_device=torch.device("cpu"))
    model.train()
    if compiled:  # as torchtitan's apply_compile: each transformer block on its own
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block))
    o = cfg.optim
    optimizers = OptimizersContainer(default_adamw(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                                   weight_decay=o.weight_decay), model_parts=[model])
    sched = LRSchedulersContainer.Config(
        warmup_steps=o.warmup_steps, decay_ratio=o.titan_decay_ratio, decay_type=o.titan_decay_type,
        min_lr_factor=o.min_lr_ratio).build(optimizers=optimizers, training_steps=cfg.train.steps)
    if cfg.moe.use_expert_bias:
        register_moe_load_balancing_hook(optimizers, [model], NoParallelism())
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    b = cfg_batch(cfg)
    inputs, labels = (torch.from_numpy(b[k].astype("int64")) for k in ("inputs", "targets"))
    n_valid = (labels != -100).sum()
    params = list(model.parameters())

    def run():
        optimizers.zero_grad()
        loss, _ = loss_fn(model(inputs), labels, n_valid)
        loss.backward()
        dist_utils.clip_grad_norm_(params, o.grad_clip, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        sched.step()
        return loss.detach()

    return run, lambda x: float(x)
