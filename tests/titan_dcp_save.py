"""Write a torchtitan DCP checkpoint with torchtitan's own ``CheckpointManager`` (a test helper,
run as a script: ``python tests/titan_dcp_save.py OUT FLAVOR WORLD RANK PORT [model_only|hf]``).

Every rank builds ``FLAVOR``'s model (CPU, fp32, seeded random parameters, buffers at init), with ``WORLD`` > 1 shards
it FSDP-style (every parameter and saved buffer a DTensor ``Shard(0)`` over a gloo mesh of ``WORLD``
ranks, so each tensor's rows lie in different ``__R_0.distcp`` files), takes one AdamW step (the
optimizer moments exist) and saves step 1 into ``OUT/step-1`` -- the full state (model, optimizer,
lr_scheduler, dataloader-less train state) or, with ``model_only``, the model only, or with ``hf``
the model as HF safetensors through the flavor's own ``StateDictAdapter`` (torchtitan's HF export:
no config.json). With ``trained`` (one rank) it instead trains 10 steps as torchtitan's recipe does
-- its AdamW, its warmup schedule and its MoE load-balancing pre-hook, which moves every
``expert_bias_E`` after each step -- on seeded random tokens, and saves the model only into
``OUT/step-10``. Rank 0 then
writes ``OUT/reference.npz``: every model tensor, full, by torchtitan name (what the checkpoint must
read back as)."""

from __future__ import annotations

import os
import sys
import zlib


def main(out: str, flavor: str, world: int, rank: int, port: int, mode: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from jaxmoe.config.titan import FAMILIES, parse_name, titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_titan_model(titan_model_config(flavor), fp32_experts=False)
    # trained: weights 5x larger, so that the MoE output (and the routing the bias moves) shows
    # in the logits
    std = 0.1 if mode == "trained" else 0.02
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * std)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for mod in model.modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
            for bname, b in list(mod.named_buffers(recurse=False)):
                if b is not None and b.ndim and bname not in mod._non_persistent_buffers_set:
                    mod.register_buffer(bname, distribute_tensor(b, mesh, [Shard(0)]))
    optimizers = OptimizersContainer(default_adamw(lr=1e-3), model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    step = 10 if mode == "trained" else 1
    if mode == "trained":
        _train(model, optimizers, lr_schedulers, step)
    else:
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 1e-3
        optimizers.step()
        optimizers.zero_grad()
        lr_schedulers.step()
    if world > 1:  # the step changed the weights: the reference is what was saved
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}
    else:
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}

    class TrainState:
        def state_dict(self):
            return {"step": torch.tensor(step), "ntokens_seen": torch.tensor(4096)}

        def load_state_dict(self, sd):
            pass

    adapter = None
    if mode == "hf":
        import importlib

        family, name = parse_name(flavor)
        spec = importlib.import_module(FAMILIES[family][0]).model_registry(name)
        adapter = spec.state_dict_adapter(titan_model_config(flavor), None)
    cfg = CheckpointManager.Config(enable=True, folder=out, interval=1, keep_latest_k=0,
                                   last_save_model_only=mode in ("model_only", "hf", "trained"),
                                   last_save_in_hf=mode == "hf")
    ckpt = CheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": TrainState()},
                             sd_adapter=adapter)
    ckpt.save(curr_step=step, last_step=True)
    ckpt.close()
    if rank == 0:
        np.savez(os.path.join(out, "reference.npz"), **{k: v.numpy() for k, v in full.items()})
    dist.barrier()
    dist.destroy_process_group()


def _train(model, optimizers, lr_schedulers, steps: int) -> None:
    """``steps`` steps of torchtitan's recipe: summed CE / valid tokens, its AdamW, its schedule,
    and its load-balancing hook (torchtitan's own ``register_moe_load_balancing_hook``)."""
    import torch
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    from jaxmoe.port.commands.titan_model import NoParallelism

    register_moe_load_balancing_hook(optimizers, [model], NoParallelism())
    model.train()  # torchtitan counts tokens per expert (what the hook reads) in training mode only
    rng = torch.Generator().manual_seed(1)
    vocab = model.tok_embeddings.num_embeddings
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 33), generator=rng)
        optimizers.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        lr_schedulers.step()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), a[5] if len(a) > 5 else "full")
