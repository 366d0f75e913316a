"""torchtitan's own model of a flavor, built on CPU in fp32 by torchtitan's classes: the torchtitan
side of ``convert --verify`` and of the parity suite (``parity.titan_side``).

Two things change for a CPU run, both local to the built model (nothing in site-packages is edited):

* **attention**: each layer's ``attention.inner_attention`` config becomes
  ``ScaledDotProductAttention.Config()`` before ``build()`` (flex attention has no CPU backward;
  varlen has no CPU kernel), unless ``flex=True`` keeps the flavor's own FlexAttention (packed
  documents, forward only).
* **expert precision** (``fp32_experts=True``): torchtitan's ``GroupedExperts.forward`` casts the
  tokens and the three expert weights to bf16 before ``torch._grouped_mm`` even in an fp32 model;
  :func:`fp32_experts_class` is the same forward without the casts.

torch and torchtitan are imported inside the functions (the ``[titan]`` extra).
"""

from __future__ import annotations

import copy

from jaxmoe.errors import UserError


def fp32_experts_class():
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


def build_titan_model(titan_cfg, *, fp32_experts: bool = True, flex: bool = False):
    """torchtitan's model of ``titan_cfg`` on CPU, fp32 (a deep copy is edited: SDPA attention,
    unless ``flex`` keeps the flavor's own, FlexAttention, for packed documents)."""
    import torch  # late: torch and torchtitan
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.moe import GroupedExperts

    tc = copy.deepcopy(titan_cfg)
    for layer in tc.layers:
        if not flex:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        elif not isinstance(layer.attention.inner_attention, FlexAttention.Config):
            raise UserError(f"--packed --reference torchtitan: the flavor's attention is "
                            f"{type(layer.attention.inner_attention).__qualname__}, not FlexAttention "
                            "(varlen has no CPU kernel); use a flex flavor")
    with torch.device("cpu"):
        model = tc.build()
    if fp32_experts:
        cls = fp32_experts_class()
        for mod in model.modules():
            if type(mod) is GroupedExperts:
                mod.__class__ = cls
    return model.float()


class NoParallelism:
    """What ``register_moe_load_balancing_hook`` reads of ``ParallelDims`` on one process: no
    meshes (``ParallelDims`` itself assumes CUDA when no accelerator is present)."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, name):
        del name
        return None



__all__ = ["NoParallelism", "build_titan_model", "fp32_experts_class"]
