"""torchtitan as a parity side: its own model of a flavor, on the run's weights, in fp32 on CPU.

:class:`TitanSide` builds torchtitan's model from the flavor's config
(``torchtitan.models.<family>.model_registry(flavor).model.build()``, after
:func:`jaxmoe.config.titan.apply_overrides`), loads the run's weights by torchtitan's native
names (:mod:`jaxmoe.port.maps.titan_map`: one table), and computes what torchtitan's trainer
computes: the logits, the loss as ``CrossEntropyLoss`` (summed cross-entropy divided by the
global count of valid tokens, ignore index -100), and the gradient of every parameter by
torchtitan name. Routing is captured from each ``moe.router`` (its ``(topk_scores,
topk_expert_ids, scores)``) and router logits from ``moe.router.gate``.

What has to change for an fp32 CPU run, and where it bites (all local to this side; nothing in
site-packages is edited):

* **attention**: torchtitan's language models use flex attention (no CPU backward) or varlen (no
  CPU kernel). Each layer's ``attention.inner_attention`` config is replaced with
  ``ScaledDotProductAttention.Config()`` before ``build()``: causal attention over the whole
  sequence (no per-document masking; the parity batches are one document per row). A packed run
  (``--packed``, ``flex=True``) keeps torchtitan's own ``FlexAttention``: forward only, under
  ``no_grad`` (see "Packed documents" below).
* **expert precision** (``fp32_experts=True``, the default): ``GroupedExperts.forward`` casts
  tokens and the three expert weights to **bf16** before ``torch._grouped_mm`` even in an fp32
  model (measured 4e-5 on logits). :class:`FP32GroupedExperts` is the same forward without the
  casts (``torch._grouped_mm`` runs fp32 on CPU); every ``inner_experts`` module is switched to
  it. ``fp32_experts=False`` keeps torchtitan's stock bf16 experts (the reported bf16 profile).
* **threads**: ``torch.set_num_threads(1)``. With fp32 experts on 2 threads most gradients differ
  run to run by ~1e-7; on one thread they are bitwise reproducible.
* **Packed documents** (``--packed``): torchtitan 0.3.0 marks documents by ``positions`` alone
  (its dataloaders emit per-document positions, padding included: a padded tail gets positions
  ``0, 1, ...`` of its own). ``Decoder.get_attention_masks(positions)`` builds the flex
  ``BlockMask`` of ``causal AND same document`` with the document id ``cumsum(positions == 0)``
  (``get_efficient_causal_mask_mod_for_packed_document``), and RoPE indexes its cache with the
  same per-document ``positions``. jaxmoe's ``segment_ids`` correspond exactly when every
  document (and the padded tail) starts at position 0 and positions restart nowhere else -- what
  :func:`parity.sides.pack_rows` makes and the batch contract says; then the two masks are equal
  and both sides rotate by the same positions. (Where they could differ: two padding runs
  separated by a document are one segment 0 to jaxmoe and two documents to torchtitan.) The
  compiled flex kernel (``torch.compile`` of ``flex_attention``, inductor C++ on CPU) runs the
  forward; its backward is not supported on CPU, so a packed torchtitan run compares the forward
  (routing, logits, loss) only.
* **ParallelDims**: not needed; the model is built and run without a device mesh (its token
  dispatcher falls back to local dispatch when there is no expert-parallel mesh).
"""

from __future__ import annotations

import numpy as np

from jaxmoe.errors import UserError
from jaxmoe.port.commands.titan_model import NoParallelism, build_titan_model
from parity.checks import routing_record
from parity.sides import to_numpy, torch_batch

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


class TitanSide:
    """torchtitan's model on the run's weights: forward with routing capture, loss, gradients by
    torchtitan name (see the module doc)."""

    def __init__(self, titan_cfg, tensors: dict[str, np.ndarray], *, fp32_experts: bool = True,
                 flex: bool = False):
        import torch  # late: torch and torchtitan

        torch.set_num_threads(1)  # bitwise-reproducible gradients (module doc)
        self.titan_cfg, self.tensors, self.fp32_experts = titan_cfg, tensors, fp32_experts
        self.flex = flex  # torchtitan's FlexAttention with document masks (packed batches; forward only)
        self.model = self._build()
        self.names = [n for n in tensors if n in dict(self.model.named_parameters())]
        self._attach(self.model)

    def _build(self):
        """torchtitan's model with the run's weights loaded (checked name by name)."""
        import torch  # late: torch and torchtitan

        tensors = self.tensors
        model = build_titan_model(self.titan_cfg, fp32_experts=self.fp32_experts, flex=self.flex)
        model.train()  # as the training step runs (no dropout in these models)
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        unknown = sorted(set(tensors) - set(params) - set(buffers))
        if unknown:
            raise UserError(f"--reference torchtitan: {len(unknown)} mapped tensors are not in torchtitan's "
                            f"model (first: {unknown[:3]})")
        unloaded = sorted(n for n in params if n not in tensors and not n.startswith("vision_encoder."))
        if unloaded:
            raise UserError(f"--reference torchtitan: {len(unloaded)} torchtitan parameters have no jaxmoe "
                            f"weight (first: {unloaded[:3]})")
        with torch.no_grad():
            for n, a in tensors.items():
                dst = params.get(n, buffers.get(n))
                if tuple(dst.shape) != a.shape:
                    raise UserError(f"--reference torchtitan: {n}: torchtitan {tuple(dst.shape)}, mapped {a.shape}")
                dst.copy_(torch.from_numpy(np.array(a, np.float32)))
        return model

    def _attach(self, model) -> None:
        """Use ``model`` for the forward/loss below (its routers captured)."""
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        self.model = model
        self.routers = [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]
        self.loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())

    def _run(self, inputs, positions=None):
        """-> (logits, [(router logits, (topk_scores, topk_ids, scores))] per MoE layer). With
        ``positions [B, S]`` (packed documents) they drive torchtitan's RoPE and its flex
        block-causal mask (``get_attention_masks``), as its trainer passes them."""
        seen_logits, seen = [], []
        hooks = []
        for r in self.routers:
            hooks.append(r.gate.register_forward_hook(lambda mod, inp, out: seen_logits.append(out)))
            hooks.append(r.register_forward_hook(lambda mod, inp, out: seen.append(out)))
        try:
            if positions is None:
                logits = self.model(inputs)
            else:
                if not self.flex:
                    raise UserError("a packed batch needs torchtitan's flex attention: TitanSide(..., flex=True)")
                logits = self.model(inputs, positions=positions,
                                    attention_masks=self.model.get_attention_masks(positions))
        finally:
            for h in hooks:
                h.remove()
        return logits, list(zip(seen_logits, seen))

    def objective(self, batch_t: dict):
        """torchtitan's loss: ``CrossEntropyLoss`` (sum) / global valid tokens."""
        labels = batch_t["targets"].masked_fill(batch_t["mask"] <= 0, IGNORE_INDEX)
        logits, routers = self._run(batch_t["inputs"], batch_t.get("positions"))
        n_valid = (labels != IGNORE_INDEX).sum()
        loss, _ = self.loss_fn(logits, labels, n_valid)
        return loss, routers, logits

    def forward(self, batch: dict) -> dict:
        """-> {"logits", "aux": {"router": {...}, "counts", "dropped"}, "losses"} like the sides."""
        import torch  # late: torch

        with torch.no_grad():
            loss, routers, logits = self.objective(torch_batch(batch))
        n_exp = self.routers[0].num_experts
        lg = np.stack([to_numpy(r[0]).reshape(-1, n_exp) for r in routers])
        w = np.stack([to_numpy(r[1][0]).reshape(lg.shape[1], -1) for r in routers])
        idx = np.stack([to_numpy(r[1][1]).reshape(lg.shape[1], -1).astype(np.int64) for r in routers])
        scores = np.stack([to_numpy(r[1][2]).reshape(-1, n_exp) for r in routers])
        counts = np.stack([np.bincount(i.ravel(), minlength=n_exp) for i in idx])
        ce = float(loss)
        return {"logits": to_numpy(logits), "losses": {"ce": ce, "loss": ce},
                "aux": {"router": {"logits": lg, "scores": scores, "topk_idx": idx, "topk_weights": w},
                        "counts": counts, "dropped": np.zeros(len(idx), np.int64)}}

    def grads(self, batch: dict) -> dict[str, np.ndarray]:
        """Gradient of torchtitan's loss for every mapped parameter, by torchtitan name."""
        self.model.zero_grad(set_to_none=True)
        loss, _, _ = self.objective(torch_batch(batch))
        loss.backward()
        params = dict(self.model.named_parameters())
        out = {n: (np.zeros(tuple(params[n].shape), np.float32) if params[n].grad is None
                   else to_numpy(params[n].grad).astype(np.float32)) for n in self.names}
        self.model.zero_grad(set_to_none=True)
        return out


    def moe_blocks(self) -> list:
        """The ``moe`` modules of the MoE layers, in layer order."""
        return [blk.moe for blk in self.model.layers.values() if getattr(blk, "moe_enabled", False)]

    def train(self, batches: list[dict], cfg, *, bias_hook: bool, moe=None) -> dict:
        """``len(batches)`` training steps as torchtitan's ``Trainer.train_step`` makes them (one
        micro-batch, no parallelism), on a fresh copy of the initial weights:

        ``optimizers.zero_grad()``; loss (summed CE / global valid tokens) ``.backward()``;
        ``torchtitan.distributed.utils.clip_grad_norm_(params, max_norm, foreach=True)``;
        ``optimizers.step()`` (its step pre-hook, :func:`register_moe_load_balancing_hook`, updates
        every MoE layer's ``expert_bias_E`` from ``tokens_per_expert_E`` and zeroes the counts);
        ``lr_schedulers.step()``.

        Built by torchtitan's own classes from ``cfg`` (jaxmoe's optim section, which
        :func:`jaxmoe.config.titan.map_titan_training` sets to torchtitan's defaults):
        ``OptimizersContainer`` over ``default_adamw(lr, betas, eps, weight_decay)`` (one AdamW
        group, decay on every parameter; ``implementation="for-loop"``: torchtitan's default
        "fused" is CUDA's kernel, the single-tensor path is torch's reference AdamW),
        ``LRSchedulersContainer.Config(warmup_steps, decay_ratio, decay_type, min_lr_factor)
        .build(training_steps=cfg.train.steps)``, and the bias hook when ``bias_hook`` (a stand-in for
        ``ParallelDims``: no mesh, no EP/TP). -> {"losses", "params" (by torchtitan name),
        "bias" [Lm, E] or None, "counts" [Lm, E] per step, "routing" (per step, with ``moe``, jaxmoe's
        moe section: :func:`parity.checks.routing_record`), "params1", "bias1"}."""
        from torchtitan.components.optimizer import (
            LRSchedulersContainer,
            OptimizersContainer,
            default_adamw,
            register_moe_load_balancing_hook,
        )
        from torchtitan.distributed import utils as dist_utils

        tcfg = cfg.optim
        if tcfg.optimizer != "adamw":
            raise UserError("--reference torchtitan --steps N: the torchtitan side runs torchtitan's AdamW "
                            f"(optim.optimizer=adamw), not {tcfg.optimizer!r} (its Muon needs a device mesh)")
        # torchtitan's own rules whatever jaxmoe's options say (decay on every parameter, its
        # warmup-stable-decay from the titan_* fields, its bias rule): a jaxmoe option set otherwise
        # (optim.decay_norms=false, optim.schedule=wsd, moe.bias_update_rule=sign) shows as a divergence
        self._attach(self._build())  # fresh weights: the forward/grad checks must not leak in
        model = self.model
        opt_cfg = default_adamw(lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=tcfg.eps,
                                weight_decay=tcfg.weight_decay)
        opt_cfg.implementation = "for-loop"
        optimizers = OptimizersContainer(opt_cfg, model_parts=[model])
        sched = LRSchedulersContainer.Config(
            warmup_steps=tcfg.warmup_steps, decay_ratio=tcfg.titan_decay_ratio, decay_type=tcfg.titan_decay_type,
            min_lr_factor=tcfg.min_lr_ratio).build(optimizers=optimizers, training_steps=cfg.train.steps)
        blocks = self.moe_blocks()
        if bias_hook:
            register_moe_load_balancing_hook(optimizers, [model], NoParallelism())
        for b in blocks:
            b.tokens_per_expert_E.zero_()
        losses, counts, routing, first = [], [], [], None
        n_exp = self.routers[0].num_experts if self.routers else 0
        for i, batch in enumerate(batches):
            optimizers.zero_grad()
            bias_now = self._snapshot(bias_hook, params=False)["bias"]  # what this step's forward selects with
            loss, routers, _ = self.objective(torch_batch(batch))
            if routers and moe is not None:
                idx = np.stack([to_numpy(r[1][1]).reshape(-1, r[1][1].shape[-1]) for r in routers])
                scores = np.stack([to_numpy(r[1][2]).reshape(idx.shape[1], -1) for r in routers])
                routing.append(routing_record(moe, idx, scores, bias_now))
            loss.backward()
            if tcfg.grad_clip > 0:
                dist_utils.clip_grad_norm_([p for p in model.parameters()], tcfg.grad_clip, foreach=True,
                                           pp_mesh=None, ep_enabled=False)
            optimizers.step()
            sched.step()
            if not bias_hook:  # torchtitan's hook zeroes them; without it they only accumulate
                for b in blocks:
                    b.tokens_per_expert_E.zero_()
            losses.append(float(loss.detach()))
            counts.append(np.stack([np.bincount(to_numpy(r[1][1]).ravel().astype(np.int64), minlength=n_exp)
                                    for r in routers]) if routers else np.zeros((0, 0), np.int64))
            if i == 0:
                first = self._snapshot(bias_hook)
        return {"losses": losses, **self._snapshot(bias_hook), "counts": counts, "routing": routing,
                "params1": first["params"], "bias1": first["bias"]}

    def _snapshot(self, with_bias: bool, params: bool = True) -> dict:
        bias = (np.stack([to_numpy(b.expert_bias_E).astype(np.float32) for b in self.moe_blocks()])
                if with_bias else None)
        if not params:
            return {"bias": bias}
        named = dict(self.model.named_parameters())
        return {"params": {n: to_numpy(named[n].detach()).astype(np.float32) for n in self.names}, "bias": bias}


__all__ = ["IGNORE_INDEX", "TitanSide"]
