"""The config schema: sections of typed fields, the single source of truth for shapes,
routing, mesh, compute, optimizer, data, checkpoints and the run (pure Python: no jax, so torch_ref shares it).

Each field's type says what it accepts: a ``Literal[...]`` (or ``metadata["choices"]``) lists its
choices, which validation (:mod:`jaxmoe.config`) reads -- the one place a choice is declared.
Loading, ``--set`` overrides, TOML and validation live in :mod:`jaxmoe.config`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field, fields
from typing import Literal

from jaxmoe.archs import ARCH_NAMES

# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = "custom"
    # Which HuggingFace architecture this model corresponds to (weight interchange naming):
    # "qwen3_moe" (GQA + softmax), "mixtral", "deepseek_v3" (MLA + sigmoid; also Kimi-K2).
    hf_arch: str = field(default="qwen3_moe", metadata={"choices": ARCH_NAMES})
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    first_k_dense: int = 0  # the first k layers use a dense SwiGLU FFN instead of MoE
    # multi-token prediction (DeepSeek-V3 sec. 2.2, jaxmoe/model/mtp.py): N extra depths after the
    # main layers, each one decoder layer (MoE when the model has MoE layers); HF layers L..L+N-1
    mtp_layers: int = 0
    dense_ffn_dim: int = 128  # intermediate size of the dense FFN layers
    attention: Literal["gqa", "mla"] = "gqa"
    n_heads: int = 4
    # GQA
    n_kv_heads: int = 2
    head_dim: int = 16
    qk_norm: bool = False  # Qwen3-style RMSNorm on q and k per head
    # MLA (DeepSeek-V3)
    q_lora_rank: int = 0  # 0: q projected directly (no low-rank q)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # norms / positions
    rms_norm_eps: float = 1e-6
    # eps of MLA's low-rank norms (q_a_layernorm / kv_a_layernorm): HF DeepSeek-V3 fixes it at
    # 1e-6 whatever rms_norm_eps says
    mla_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_layout: Literal["half", "interleaved"] = "half"  # half-split (HF Llama/Qwen/Mixtral) | pairs
    rope_scaling: Literal["none", "yarn"] = "none"
    yarn_factor: float = 1.0
    yarn_original_max_pos: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # YaRN mscale / mscale_all_dim as in HF's rope_parameters; 0 = absent (HF: attention factor
    # mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are non-zero, else mscale(f))
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0  # HF rope_parameters.attention_factor; 0 = derived (above)
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_k_dense

    @property
    def q_head_dim(self) -> int:
        """Per-head query/key width used for attention scores."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 64  # intermediate size of one routed expert (SwiGLU)
    n_shared_experts: int = 0  # shared experts, fused into one SwiGLU of width n_shared * expert_ffn_dim
    # Routing semantics (router runs in fp32 always)
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # softmax: Mixtral/Qwen3 semantics = softmax over all experts, then top-k, then optional
    # renormalisation. sigmoid: DeepSeek-V3 semantics.
    norm_topk_prob: bool = True  # renormalise the k selected weights to sum to 1
    route_scale: float = 1.0  # multiply gate weights after normalisation (DeepSeek-V3: 2.5)
    n_groups: int = 1  # expert groups for group-limited selection (DeepSeek-V3: 8)
    topk_groups: int = 1  # groups kept (DeepSeek-V3: 4); group score = sum of its top-2 scores
    use_expert_bias: bool = False  # aux-loss-free balancing bias, used only for selection
    bias_update_rate: float = 1e-3  # sign-rule update rate of the expert bias
    # the expert-bias update after each step, on the step's counts n (jaxmoe.train.losses.update_expert_bias):
    # "sign_centred": delta = rate * sign(mean(n) - n), delta -= mean(delta) (jaxmoe's rule, and
    # torchtitan's optimizer pre-hook); "sign": without the centring (arXiv 2408.15664 as written)
    bias_update_rule: Literal["sign_centred", "sign"] = "sign_centred"
    # Aux losses (coefficients; 0 disables)
    lb_coef: float = 0.0  # global-batch load-balance loss, Switch form: E * sum_e f_e * P_e
    # "layer": the Switch loss of each MoE layer, summed over layers (balanced value = n MoE
    # layers); "pooled": transformers' Mixtral/Qwen3 load_balancing_loss_func, every MoE layer's
    # router probabilities and top-k counts pooled over tokens before one product (balanced value
    # = top_k), attention padding excluded when the batch has an attention mask / segment ids
    lb_scope: Literal["layer", "pooled"] = "layer"
    seq_aux_coef: float = 0.0  # DeepSeek-V3 sequence-wise balance loss
    router_z_coef: float = 0.0  # router z-loss: mean(logsumexp(router_logits)^2)
    # Expert compute path
    # implementations: jaxmoe.model.experts.PATHS (which also says which run under a mesh);
    # auto = per backend (jaxmoe.config.autoconf): blocked on CPU and GPU, ragged on TPU
    compute_path: Literal["auto", "dense", "ragged", "blocked"] = "auto"
    capacity_factor: float = 0.0  # dense path: 0 = dropless (capacity = worst case)
    block_size: int = 16  # blocked path: each expert's token group is padded to a multiple of this
    # ragged path's grouped matmul (jaxmoe.model.grouped_gemm): xla = jax.lax.ragged_dot (native on
    # TPU, lowered densely on CPU/GPU); mosaic_gpu = jax's Hopper Pallas kernels (bf16, GPU only);
    # tokamax = tokamax.ragged_dot (the [gpu] extra, Python >= 3.12); auto = tokamax on CUDA when
    # it imports, else xla (jaxmoe.config.autoconf)
    ragged_kernel: Literal["auto", "xla", "mosaic_gpu", "tokamax"] = "auto"
    router_init_std: float = 0.02


@dataclass
class MeshConfig:
    replica: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    # expert-parallel dispatcher (implementations: jaxmoe.parallel.expert_dispatch.DISPATCHERS); auto picks per backend
    dispatcher: Literal["auto", "all_to_all", "ragged_all_to_all", "allgather"] = "auto"
    a2a_capacity_factor: float = 0.0  # 0 = worst case (dropless)
    # expert-parallel axes (experts' E axis and the dispatch); "fsdp,expert" keeps experts whole
    # when fsdp > 1 (jaxmoe.parallel.sharding.LOGICAL_RULES["experts"])
    expert_axes: Literal["expert", "fsdp,expert"] = "expert"
    dispatch_chunks: int = 1  # split tokens into chunks so all-to-all overlaps compute
    xla_flags_profile: Literal["none", "gpu_overlap"] = "none"


@dataclass
class ComputeConfig:
    """How the model computes: precision and the kernels that give the same values (the model reads
    this section, never ``train``)."""

    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype (master params always fp32)
    # attention score kernel (jaxmoe.model.attention.attend): dot_product = jax.nn.dot_product_attention
    # (cuDNN flash on GPU), explicit = scores by hand; auto = dot_product on GPU, explicit elsewhere
    # (jaxmoe.config.autoconf)
    attention_kernel: Literal["auto", "dot_product", "explicit"] = "auto"
    # cross-entropy over this many tokens at a time, fused with the LM head, so the [T, V] fp32
    # logits are never held whole (jaxmoe.train.losses.chunked_cross_entropy); 0 = off; auto = 1024
    # when a micro-batch's logits hold >= 2^24 values (tokens x vocab), else 0 (jaxmoe.config.autoconf)
    ce_chunk_tokens: int | str = field(default="auto", metadata={"type": int, "auto": True})
    # layers per iteration of the layer scans (jaxmoe.model.transformer): 1 = rolled (compile time
    # flat in depth); N = N layers per iteration; 0 = every layer unrolled: no stacked per-layer
    # buffers to zero-fill, slice and write back (faster for shallow stacks on CPU; figures in
    # docs/MEASUREMENTS.md, "auto defaults"), compile time grows with depth; auto = on CPU 0 for stacks of at most
    # 8 layers, else 1; 1 on GPU/TPU (jaxmoe.config.autoconf)
    scan_unroll: int | str = field(default="auto", metadata={"type": int, "auto": True})
    # what each layer keeps for the backward: none (everything), full (its input only), save_dots
    # (matmul outputs), offload (its residuals in pinned_host memory, the rest recomputed)
    remat: Literal["none", "full", "save_dots", "offload"] = "none"
    # FP8 matmuls (jaxmoe.model.fp8): quantise-dequantise to e4m3 with current scaling, fp32
    # accumulation, of attention projections, dense MLPs, shared and routed experts (router, norms,
    # embeddings and LM head stay high precision). tensorwise / rowwise: torchao's recipes;
    # blockwise: DeepSeek-V3's 1x128 activation tiles and 128x128 weight blocks. Also `train.fp8`.
    fp8: Literal["none", "tensorwise", "rowwise", "blockwise"] = "none"


@dataclass
class OptimConfig:
    """The optimizer, its learning-rate schedule and its state's placement."""

    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    # cosine | linear | wsd | constant: jaxmoe's schedules (warmup, then decay reaching lr *
    # min_lr_ratio at the last step); titan_wsd: torchtitan 0.3.0's warmup-stable-decay
    # (LRSchedulersContainer: decay over round(steps * titan_decay_ratio) steps ending one virtual
    # step after the last, min_lr_ratio = its min_lr_factor); see jaxmoe.config.schedule
    schedule: Literal["cosine", "linear", "wsd", "constant", "titan_wsd"] = "cosine"
    wsd_decay_frac: float = 0.2  # wsd: decay over the last floor(frac * steps) steps
    titan_decay_ratio: float = 1.0  # titan_wsd: torchtitan's decay_ratio (1.0 = its None: decay after warmup)
    titan_decay_type: Literal["linear", "sqrt", "cosine"] = "linear"  # titan_wsd: torchtitan's decay_type
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms: bool = False  # AdamW decay on norms/vectors too (torchtitan: on, it decays all)
    decay_embeddings: bool = False  # AdamW decay on the embedding too (torchtitan: on)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    # Muon (matrices, including stacked expert weights per expert); AdamW for the rest
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coefficients: list = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    muon_eps: float = 1e-7
    muon_adjust_lr: Literal["original", "match_rms_adamw", "none"] = "original"
    muon_weight_decay: float = 0.1
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # bfloat16 as torch.optim.Muon
    # where Newton-Schulz runs on a mesh (jaxmoe.train.muon_placement): "owner" = whole matrices
    # where they live (experts), every other matrix on one owner device (balanced by NS FLOPs);
    # "replicated" = wherever XLA puts it (sharded matrices gathered). Same values; no mesh: same.
    muon_placement: Literal["replicated", "owner"] = "owner"
    # optimizer state (AdamW moments, Muon momentum) kept in pinned host memory, streamed to the
    # device for the update (jaxmoe.train.step); the same values as on device
    offload_optimizer: bool = False


@dataclass
class DataConfig:
    """Where the batches come from and how documents become rows."""

    # "default" (embedded stdlib corpus), "tokens:PATH" (.bin/.npy), "text:PATH" (+tokenizer),
    # or a mixture "mix:0.7*SPEC,0.3*SPEC" (jaxmoe.data.mixture); the --data flag
    source: str = "default"
    tokenizer: str = ""  # path to a HuggingFace tokenizers tokenizer.json for text data
    # rows (jaxmoe.data.packing): windows = fixed S+1-token windows across documents (no masks);
    # documents = documents packed first-fit into rows, with segment_ids/positions, padding masked
    packing: Literal["windows", "documents"] = "windows"
    doc_sep_id: int = -1  # documents packing on a flat token stream: the separator id (-1: none)
    mask_doc_start: bool = False  # documents packing: no loss on each document's first target
    workers: int = 0  # Grain worker processes preparing batches (0: in the training process)


@dataclass
class CheckpointConfig:
    """When a run saves, and how many checkpoints it keeps."""

    every: int = 0  # save every N steps (0: by time, see minutes); the --checkpoint-every flag
    minutes: float = 30.0  # when every is 0: save about this often (0: off)
    keep: int = 3  # keep the last K checkpoints


@dataclass
class TrainConfig:
    """The run: steps, the batch, evaluation, logging and when to stop."""

    seed: int = 0
    steps: int = 60
    batch_size: int = 8  # sequences per step (global)
    seq_len: int = 64
    micro_batches: int = 1  # gradient accumulation: batch_size split into this many micro-batches
    z_loss_coef: float = 0.0  # output-logit z-loss
    # multi-token prediction loss weight: total = ce + coef * mean over depths of the depth CE
    # (each over the main valid-token count); 0.3 = torchtitan 0.3's MTPLoss default (mtp_scale)
    mtp_loss_coef: float = 0.3
    eval_every: int = 20
    eval_batches: int = 2
    log_every: int = 1
    max_bad_steps: int = 3
    # W&B beside TensorBoard (the [wandb] extra, jaxmoe.train.wandb_log); tags comma-separated;
    # WANDB_MODE in the environment overrides wandb_mode
    wandb: bool = False
    wandb_project: str = "jaxmoe"
    wandb_name: str = ""  # default: the run directory's name
    wandb_tags: str = ""
    wandb_mode: Literal["online", "offline"] = "online"
    dead_expert_steps: int = 50  # one warning line when an expert got no token for N steps in a row (0: off)
    # fetch step n's metrics while step n+1 runs and prepare batches on a thread; false: the
    # synchronous loop (the same losses bit for bit; for comparison and debugging)
    async_loop: bool = True
    # "A:B": an XLA profiler trace (TensorBoard/xprof) of steps A..B (1-based, as in metrics.jsonl)
    # into the run directory's tb/plugins/profile (jaxmoe.train.profile_window); "" = none
    profile_steps: str = ""
    # emergency tier (jaxmoe.checkpoint.emergency): every N steps each process writes its shards
    # to local disk (0: off); a restart restores from the newest complete tier, local or persistent
    local_checkpoint_every: int = 0
    local_checkpoint_dir: str = ""  # "" = RUN_DIR/local_checkpoints; e.g. a node-local SSD path


SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "mesh": MeshConfig, "compute": ComputeConfig,
            "optim": OptimConfig, "data": DataConfig, "checkpoint": CheckpointConfig, "train": TrainConfig}

#: keys that moved out of ``[train]`` when it was split into sections: old (section, key) -> new.
#: An old key still works (in a file, a ``--set`` and a saved run's config), with one line of notice.
MOVED_KEYS = {
    **{("train", f.name): ("compute", f.name) for f in fields(ComputeConfig)},
    **{("train", f.name): ("optim", f.name) for f in fields(OptimConfig)},
    ("train", "data"): ("data", "source"),
    **{("train", k): ("data", k) for k in ("tokenizer", "packing", "doc_sep_id", "mask_doc_start")},
    ("train", "data_workers"): ("data", "workers"),
    ("train", "checkpoint_every"): ("checkpoint", "every"),
    ("train", "checkpoint_minutes"): ("checkpoint", "minutes"),
    ("train", "keep_checkpoints"): ("checkpoint", "keep"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    description: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def choices(cls, name: str) -> tuple | None:
    """The allowed values of field ``name`` of section class ``cls``: the arguments of its
    ``Literal[...]`` type, or ``metadata["choices"]`` (e.g. ``model.hf_arch`` from the
    architecture registry); None for a free field. The one declaration validation reads."""
    f = {f.name: f for f in fields(cls)}[name]
    if "choices" in f.metadata:
        return tuple(f.metadata["choices"])
    hint = _hints(cls)[name]
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return None


def allows_auto(cls, name: str) -> bool:
    """Whether field ``name`` of section ``cls`` is a number that also takes the string ``"auto"``
    (``metadata["auto"]``; resolved per backend and shape by :mod:`jaxmoe.config.autoconf`)."""
    return bool({f.name: f for f in fields(cls)}[name].metadata.get("auto"))


def field_type(cls, name: str) -> type:
    """The Python type a value of field ``name`` of section ``cls`` is coerced to
    (``metadata["type"]``, else a ``Literal``'s value type, else the default's type)."""
    f = {f.name: f for f in fields(cls)}[name]
    if "type" in f.metadata:
        return f.metadata["type"]
    hint = _hints(cls)[name]
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0])
    f = {f.name: f for f in fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return type(f.default)
    return type(f.default_factory())  # type: ignore[misc]


__all__ = ["MOVED_KEYS", "SECTIONS", "CheckpointConfig", "ComputeConfig", "Config", "DataConfig", "MeshConfig",
           "ModelConfig", "MoEConfig", "OptimConfig", "TrainConfig", "allows_auto", "choices", "field_type"]
