"""torchtitan as a parity side: its own model of a flavor, on the run's weights, in fp32 on CPU.

:class:`TitanSide` builds torchtitan's model from the flavor's config
(``torchtitan.models.<family>.model_registry(flavor).model.build()``, after
:func:`parity.titan_flavors.apply_overrides`), loads the run's weights by torchtitan's native
names (:mod:`jaxmoe.port.titan_map`: one table), and computes what torchtitan's trainer
computes: the logits, the loss as ``CrossEntropyLoss`` (summed cross-entropy divided by the
global count of valid tokens, ignore index -100), and the gradient of every parameter by
torchtitan name. Routing is captured from each ``moe.router`` (its ``(topk_scores,
topk_expert_ids, scores)``) and router logits from ``moe.router.gate``.

What has to change for an fp32 CPU run, and where it bites (all local to this side; nothing in
site-packages is edited):

* **attention**: torchtitan's language models use flex attention (no CPU backward) or varlen (no
  CPU kernel). Each layer's ``attention.inner_attention`` config is replaced with
  ``ScaledDotProductAttention.Config()`` before ``build()``: causal attention over the whole
  sequence (no per-document masking; the parity batches are one document per row).
* **expert precision** (``fp32_experts=True``, the default): ``GroupedExperts.forward`` casts
  tokens and the three expert weights to **bf16** before ``torch._grouped_mm`` even in an fp32
  model (measured 4e-5 on logits). :class:`FP32GroupedExperts` is the same forward without the
  casts (``torch._grouped_mm`` runs fp32 on CPU); every ``inner_experts`` module is switched to
  it. ``fp32_experts=False`` keeps torchtitan's stock bf16 experts (the reported bf16 profile).
* **threads**: ``torch.set_num_threads(1)``. With fp32 experts on 2 threads most gradients differ
  run to run by ~1e-7; on one thread they are bitwise reproducible.
* **ParallelDims**: not needed; the model is built and run without a device mesh (its token
  dispatcher falls back to local dispatch when there is no expert-parallel mesh).
"""

from __future__ import annotations

import copy

import numpy as np

from jaxmoe.errors import UserError
from parity.sides import to_numpy, torch_batch

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


def _fp32_experts_class():
    """``GroupedExperts`` with torchtitan's forward minus its bf16 casts (see the module doc)."""
    import torch  # late: torch and torchtitan
    import torch.nn.functional as F
    from torchtitan.models.common.moe import GroupedExperts

    class FP32GroupedExperts(GroupedExperts):
        """torchtitan 0.3.0 ``GroupedExperts.forward`` without ``.bfloat16()`` on the tokens and
        weights; the output keeps the input's dtype. No expert parallelism (plain tensors)."""

        def forward(self, x_RD, num_tokens_per_expert_E):
            offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
            h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
            return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    return FP32GroupedExperts


def build_titan_model(titan_cfg, *, fp32_experts: bool = True):
    """torchtitan's model of ``titan_cfg`` (a deep copy is edited: SDPA attention) on CPU, fp32."""
    import torch  # late: torch and torchtitan
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts

    tc = copy.deepcopy(titan_cfg)
    for layer in tc.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("cpu"):
        model = tc.build()
    if fp32_experts:
        cls = _fp32_experts_class()
        for mod in model.modules():
            if type(mod) is GroupedExperts:
                mod.__class__ = cls
    return model.float()


class TitanSide:
    """torchtitan's model on the run's weights: forward with routing capture, loss, gradients by
    torchtitan name (see the module doc)."""

    def __init__(self, titan_cfg, tensors: dict[str, np.ndarray], *, fp32_experts: bool = True):
        import torch  # late: torch and torchtitan

        torch.set_num_threads(1)  # bitwise-reproducible gradients (module doc)
        self.model = build_titan_model(titan_cfg, fp32_experts=fp32_experts)
        self.model.train()  # as the training step runs (no dropout in these models)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        self.names = [n for n in tensors if n in params]
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
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        self.routers = [m for m in self.model.modules() if isinstance(m, TokenChoiceTopKRouter)]
        from torchtitan.components.loss import CrossEntropyLoss

        self.loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())

    def _run(self, inputs):
        """-> (logits, [(router logits, (topk_scores, topk_ids, scores))] per MoE layer)."""
        seen_logits, seen = [], []
        hooks = []
        for r in self.routers:
            hooks.append(r.gate.register_forward_hook(lambda mod, inp, out: seen_logits.append(out)))
            hooks.append(r.register_forward_hook(lambda mod, inp, out: seen.append(out)))
        try:
            logits = self.model(inputs)
        finally:
            for h in hooks:
                h.remove()
        return logits, list(zip(seen_logits, seen))

    def objective(self, batch_t: dict):
        """torchtitan's loss: ``CrossEntropyLoss`` (sum) / global valid tokens."""
        labels = batch_t["targets"].masked_fill(batch_t["mask"] <= 0, IGNORE_INDEX)
        logits, routers = self._run(batch_t["inputs"])
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


__all__ = ["IGNORE_INDEX", "TitanSide", "build_titan_model"]
