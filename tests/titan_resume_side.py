"""torchtitan's side of the cross-framework resume test (a test helper, run as a script).

``python tests/titan_resume_side.py SPEC.json``; ``SPEC`` names the torchtitan model (``titan``
FAMILY/FLAVOR, ``titan_set`` edits, ``layers`` kept), the jaxmoe config ``toml`` (its data and
its train section: lr, betas, eps, weight decay, clipping, the ``titan_wsd`` schedule over
``train.steps``), the checkpoint ``folder`` (``step-K`` inside), ``K``, ``M``, ``port`` and
``mode``:

* ``train_save_resume``: torchtitan's own model (seeded ``init_weights``), AdamW, LR schedulers
  and MoE bias hook train K steps on jaxmoe's batches 0..K-1 and save step K with its
  ``CheckpointManager`` (full state; ``train_state`` as its Trainer keeps it: ints); then fresh
  objects load step K with ``CheckpointManager.load`` and train M more on batches K..K+M-1;
* ``resume``: only the second half (the step was written by jaxmoe's ``dcp:`` sink).

Writes ``out.json`` (``losses_before`` / ``losses_after``, the loaded ``last_epoch``, ``train_state``
and param group) and ``loaded.npz`` (after ``load``: every model tensor by name and every
``state.<fqn>.<field>`` of the optimizer container's state dict) into ``folder``.

One training step is torchtitan's ``Trainer.train_step`` without parallelism (as
``parity.titan_side.TitanSide.train``): zero_grad; summed CE / valid tokens ``.backward()``;
``clip_grad_norm_``; ``optimizers.step()`` (the bias pre-hook); ``lr_schedulers.step()``. fp32
experts, SDPA attention, one thread (bitwise reproducible)."""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.distributed import utils as dist_utils

    from jaxmoe.config import load_config
    from jaxmoe.config.titan import config_from_titan
    from jaxmoe.data import make_data
    from jaxmoe.port.commands.titan_model import NoParallelism, build_titan_model

    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), WORLD_SIZE="1", RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = load_config(path=spec["toml"])
    t, o = cfg.train, cfg.optim
    titan = config_from_titan(spec["titan"], spec["titan_set"]).titan
    titan.layers = titan.layers[: spec["layers"]]
    K, M = spec["K"], spec["M"]
    data = make_data(cfg, "train", process_index=0, process_count=1)
    batches = [data.next_batch() for _ in range(K + M)]
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())

    class TrainState:  # torchtitan's Trainer keeps these as Python ints
        def __init__(self):
            self.step, self.ntokens_seen = 0, 0

        def state_dict(self):
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, sd):
            self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]

    def build():
        torch.manual_seed(0)
        model = build_titan_model(titan)
        model.init_weights()
        model.train()
        opt_cfg = default_adamw(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        opt_cfg.implementation = "for-loop"
        opts = OptimizersContainer(opt_cfg, model_parts=[model])
        sched = LRSchedulersContainer.Config(
            warmup_steps=o.warmup_steps, decay_ratio=o.titan_decay_ratio, decay_type=o.titan_decay_type,
            min_lr_factor=o.min_lr_ratio).build(optimizers=opts, training_steps=t.steps)
        register_moe_load_balancing_hook(opts, [model], NoParallelism())
        for mod in model.modules():
            if hasattr(mod, "tokens_per_expert_E") and mod.tokens_per_expert_E is not None:
                mod.tokens_per_expert_E.zero_()
        ts = TrainState()
        ckpt = CheckpointManager(
            CheckpointManager.Config(enable=True, folder=spec["folder"], interval=1, keep_latest_k=0),
            dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=sched,
            states={"train_state": ts}, sd_adapter=None)
        return model, opts, sched, ts, ckpt

    def steps(model, opts, sched, ts, which):
        losses = []
        for i in which:
            b = batches[i]
            opts.zero_grad()
            inputs = torch.from_numpy(b["inputs"].astype(np.int64))
            labels = torch.from_numpy(b["targets"].astype(np.int64)).masked_fill(
                torch.from_numpy(b["mask"]) <= 0, -100)
            loss, _ = loss_fn(model(inputs), labels, (labels != -100).sum())
            loss.backward()
            if o.grad_clip > 0:
                dist_utils.clip_grad_norm_(list(model.parameters()), o.grad_clip, foreach=True, pp_mesh=None,
                                           ep_enabled=False)
            opts.step()
            sched.step()
            ts.step += 1
            ts.ntokens_seen += labels.numel()
            losses.append(float(loss.detach()))
        return losses

    out = {}
    if spec["mode"] == "train_save_resume":
        model, opts, sched, ts, ckpt = build()
        out["losses_before"] = steps(model, opts, sched, ts, range(K))
        ckpt.save(curr_step=K, last_step=False)
        ckpt.close()
    model, opts, sched, ts, ckpt = build()
    if not ckpt.load(step=K):
        raise SystemExit(f"CheckpointManager.load(step={K}) found nothing in {spec['folder']}")
    group = {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.optimizers[0].param_groups[0].items()
             if k != "params"}
    out.update(last_epoch=sched.schedulers[0].last_epoch, train_state=ts.state_dict(), param_group=group)
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    arrays.update({k: v.detach().numpy().copy() for k, v in opts.state_dict().items()
                   if k.startswith("state.") and hasattr(v, "numpy")})
    np.savez(os.path.join(spec["folder"], "loaded.npz"), **arrays)
    out["losses_after"] = steps(model, opts, sched, ts, range(K, K + M))
    ckpt.close()
    with open(os.path.join(spec["folder"], "out.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
