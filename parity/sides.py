"""The two sides of a parity run (jaxmoe and torch_ref) and what they share.

* **Numerics set-up** (:func:`setup_numerics`): ``jax_default_matmul_precision="highest"``, torch
  TF32 off (both default to faster modes on GPUs; parity needs them pinned).
* **Weights, built once** (:func:`init_weights`): ``jaxmoe.model.transformer.init_params(cfg,
  seed)``; the expert bias (when the model has one) is randomised so that it really changes
  expert selection. The same arrays go to torch_ref through ``jaxmoe.port.maps.hf_map``
  (:func:`to_hf`: jaxmoe layout -> HF names, [in, out] -> [out, in]) and
  ``load_state_dict(strict=True)``.
* **Batches** (:func:`make_batches`): random tokens from a seeded numpy generator, targets = next
  token, a few padded (mask 0) positions so that the valid-token normalisation is exercised. With
  ``packed`` (``python -m parity run --packed``) every row is packed with documents of random
  lengths (:func:`pack_rows`): the batch also holds ``segment_ids`` and ``positions``, which
  both sides get, so attention masking across documents and per-document RoPE are compared.
* **The sides**: :class:`JaxSide` and :class:`TorchSide`, each with ``forward`` (probes and
  losses), ``grads`` (by HF name) and ``train`` (N optimizer steps).

Faults for the self-test (:mod:`parity.faults`) hook into the torch side only, through the
``fault`` argument (a config copy, a monkeypatch context, a weight edit).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from jaxmoe.config import Config
from jaxmoe.port.maps.hf_map import ZERO, entries, flatten
from parity.checks import routing_record, selection_gap

# jax, torch, torch_ref and the jaxmoe modules that import jax at import time are imported inside
# the functions that use them ("late" below): `import parity.runner` must not import jax or torch,
# so that `python -m parity --help` is instant and `--mesh` can set XLA_FLAGS before jax starts.


# --------------------------------------------------------------------------------------------
# Numerics set-up, weights and batches
# --------------------------------------------------------------------------------------------


def setup_numerics() -> None:
    """Pin matmul precision on both sides (GPUs default to TF32-like modes)."""
    import jax  # late: jax and torch (see the note on imports)
    import torch

    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def scale_init(cfg: Config, params, scale: float):
    """``params`` with every weight matrix (optimizer groups ``matrix``, ``embed``, ``head``:
    attention, MLPs, experts, routers, embedding, lm_head) multiplied by ``scale``; norm scales
    (group ``vector``) untouched.

    Why: the default init (std 0.02) leaves the logits nearly flat (std ~0.02) and the routing
    nearly uniform, so a real bug (a RoPE layout, an eps) moves the KL by ~1e-7 and most tokens'
    top-k choice is close to a tie. Scaled weights make the network *decisive*: logit std >= 1
    and clear routing gaps (measured by :func:`decisiveness`; docs/MEASUREMENTS.md, "Parity,
    decisive weights"). Used by the matrix and the self-test (``--init-scale``)."""
    import jax  # late: jax (see the note on imports)

    from jaxmoe.model.transformer import declared_groups

    if scale == 1.0:
        return params
    groups = declared_groups(cfg)
    return jax.tree.map(lambda g, p: p * scale if g != "vector" else p, groups, params)


def init_weights(cfg: Config, seed: int, randomize_bias: bool = True, init_scale: float = 1.0):
    """``(params, buffers)`` from jaxmoe's ``init_params``, weight matrices times ``init_scale``
    (:func:`scale_init`); the expert bias (if any) randomised (normal, std 0.03: comparable to the
    spread of sigmoid scores at init, so it changes which experts are selected) with a generator
    seeded by ``seed``."""
    import jax.numpy as jnp  # late: jax (see the note on imports)

    from jaxmoe.model.transformer import init_params

    if not (init_scale > 0 and np.isfinite(init_scale)):
        from jaxmoe.errors import UserError

        raise UserError(f"--init-scale {init_scale!r}: must be a positive finite number (e.g. 8)")
    params, buffers = init_params(cfg, seed)
    params = scale_init(cfg, params, float(init_scale))
    if randomize_bias and buffers.get("moe", {}).get("expert_bias") is not None:
        bias = buffers["moe"]["expert_bias"]
        rng = np.random.default_rng(seed + 12345)
        new = rng.normal(0.0, 0.03, size=bias.shape).astype(np.float32)
        buffers = {**buffers, "moe": {**buffers["moe"], "expert_bias": jnp.asarray(new)}}
    return params, buffers


def decisiveness(cfg: Config, logits: np.ndarray, scores: np.ndarray | None, bias=None) -> dict:
    """How decisive a forward pass is: the logit std, and per MoE layer the median selection-score
    gap at the top-k boundary (parity.checks.selection_gap) and the fraction of tokens whose gap is
    below 1e-3 (close to a tie)."""
    out = {"logit_std": float(np.std(logits.astype(np.float64)))}
    if scores is not None and len(scores):
        gaps = [selection_gap(scores[j], None if bias is None else bias[j], cfg.moe) for j in range(len(scores))]
        out["median_gap"] = [float(np.median(g)) for g in gaps]
        out["frac_gap_below_1e-3"] = [float((g < 1e-3).mean()) for g in gaps]
    return out


def to_hf(cfg: Config, params, buffers=None, *, with_buffers: bool = True,
          any_bias: bool = False) -> dict[str, np.ndarray]:
    """jaxmoe params/buffers (nested dicts) -> {HF name: fp32 numpy array [out, in]}.

    Uses the one mapping table (``jaxmoe.port.maps.hf_map.entries``); HF-only tensors that jaxmoe
    does not hold (a DeepSeek-V3 bias without ``use_expert_bias``) are zeros. With
    ``with_buffers=False`` buffer rows are skipped (used to name gradients). ``any_bias`` (torch_ref
    only): an expert bias the HF architecture cannot store goes by torch_ref's buffer name."""
    flat = {"params/" + k: v for k, v in flatten(params).items()}
    if buffers:
        flat.update({"buffers/" + k: v for k, v in flatten(buffers).items()})
    cache: dict[str, np.ndarray] = {}
    out = {}
    for ent in entries(cfg, any_bias=any_bias):
        if ent.key == ZERO or ent.key.startswith("buffers/"):
            if with_buffers:
                src = np.zeros(ent.hf_shape, np.float32) if ent.key == ZERO else None
                if src is None:
                    if ent.key not in cache:
                        cache[ent.key] = np.asarray(flat[ent.key], dtype=np.float32)
                    src = cache[ent.key][ent.index]
                out[ent.hf_name] = np.ascontiguousarray(src)
            continue
        if ent.key not in cache:
            cache[ent.key] = np.asarray(flat[ent.key], dtype=np.float32)
        a = cache[ent.key][ent.index] if ent.index else cache[ent.key]
        out[ent.hf_name] = np.ascontiguousarray(a.T if ent.transpose else a)
    return out


def make_batches(cfg: Config, n: int, seed: int, packed: bool = False) -> list[dict]:
    """``n`` batches ``{"inputs", "targets" int32 [B, S], "mask" f32 [B, S]}`` of random tokens
    (targets = the next token); the last 3 positions of the last row are padding (mask 0). With
    ``packed``, also ``segment_ids`` and ``positions`` int32 ``[B, S]`` (:func:`pack_rows`; the
    padding is segment 0)."""
    rng = np.random.default_rng(seed + 777)
    b, s, v = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    out = []
    for _ in range(max(1, n)):
        toks = rng.integers(0, v, size=(b, s + 1), dtype=np.int64).astype(np.int32)
        mask = np.ones((b, s), np.float32)
        mask[-1, -3:] = 0.0
        batch = {"inputs": toks[:, :-1].copy(), "targets": toks[:, 1:].copy(), "mask": mask}
        if packed:
            batch["segment_ids"], batch["positions"] = pack_rows(rng, mask > 0)
        out.append(batch)
    return out


def pack_rows(rng: np.random.Generator, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``segment_ids``, ``positions`` int32 ``[B, S]`` for rows whose ``valid [B, S]`` tokens (a
    prefix of each row) are cut into documents of random lengths 1 .. S/2 (the last one cut short
    at the row's end): documents numbered 1, 2, ... per row, positions 0, 1, ... inside each; the
    invalid tail (padding) is segment 0 with positions 0, 1, ... of its own."""
    b, s = valid.shape
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        n_valid = int(valid[r].sum())
        start, doc = 0, 1
        while start < n_valid:
            ln = min(int(rng.integers(1, max(2, s // 2) + 1)), n_valid - start)
            seg[r, start:start + ln] = doc
            pos[r, start:start + ln] = np.arange(ln)
            start, doc = start + ln, doc + 1
        pos[r, n_valid:] = np.arange(s - n_valid)
    return seg, pos


PACKING_KEYS = ("segment_ids", "positions")  # jaxmoe.train.objective.PACKING_KEYS (kept jax-free here)


def torch_batch(batch: dict) -> dict:
    import torch  # late: torch (see the note on imports)

    out = {
        "inputs": torch.from_numpy(batch["inputs"].astype(np.int64)),
        "targets": torch.from_numpy(batch["targets"].astype(np.int64)),
        "mask": torch.from_numpy(batch["mask"]),
    }
    for k in PACKING_KEYS:
        if batch.get(k) is not None:
            out[k] = torch.from_numpy(np.asarray(batch[k]).astype(np.int64))
    return out


def packing_kwargs(batch: dict) -> dict:
    """The model keyword arguments of a packed batch (``segment_ids``, ``positions``); ``{}``
    for a plain one."""
    return {k: batch[k] for k in PACKING_KEYS if batch.get(k) is not None}


# --------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------


def to_numpy(x) -> np.ndarray:
    """jax / torch / numpy -> numpy (fp32 and int kept; bf16 widened to fp32)."""
    try:
        import torch  # late, and optional here: jax and numpy inputs need no torch

        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.dtype == torch.bfloat16:
                x = x.float()
            return x.cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(x)
    if a.dtype.kind == "V" or str(a.dtype) == "bfloat16":
        a = a.astype(np.float32)
    return a


def _tree_np(tree):
    if isinstance(tree, dict):
        return {k: _tree_np(v) for k, v in tree.items()}
    return to_numpy(tree)


class JaxSide:
    """jaxmoe: jitted forward (with probes), gradients, train steps; optionally on a mesh."""

    def __init__(self, cfg: Config, params, buffers, mesh_ctx=None, namer=None):
        import jax  # late: jax (see the note on imports)

        from jaxmoe.model.transformer import Model

        self.cfg, self.ctx = cfg, mesh_ctx
        # names gradients and parameters: to_hf (HF names) unless a reference names them its way
        # (parity.titan_runner: jaxmoe.port.maps.titan_map.to_titan, torchtitan's native names)
        self.namer = functools.partial(to_hf, any_bias=True) if namer is None else namer
        self.model = Model(cfg) if mesh_ctx is None else mesh_ctx.model()
        self.params0, self.buffers0 = params, buffers
        if mesh_ctx is not None:
            params = mesh_ctx.place_params(params)
            buffers = mesh_ctx.place_params(buffers) if buffers else buffers
        self.params, self.buffers = params, buffers
        model = self.model

        def fwd(p, b, tokens, forced, pk):
            return model(p, b, tokens, forced_idx=forced, return_probes=True, **pk)

        self._fwd = jax.jit(fwd)

    def batch(self, batch: dict) -> dict:
        import jax.numpy as jnp  # late: jax (see the note on imports)

        if self.ctx is not None:
            return self.ctx.place_batch(batch)
        return {k: jnp.asarray(v) for k, v in batch.items()}

    def forward(self, batch: dict, forced=None) -> dict:
        """-> {"logits", "aux"} as numpy, plus "losses" from ``jaxmoe.train.losses.compute_loss``."""
        import jax.numpy as jnp  # late: jax (see the note on imports)

        from jaxmoe.train.losses import compute_loss

        jb = self.batch(batch)
        f = None if forced is None else jnp.asarray(forced, jnp.int32)
        logits, aux = self._fwd(self.params, self.buffers, jb["inputs"], f, packing_kwargs(jb))
        _, metrics = compute_loss(self.cfg, logits, aux, jb)
        return {"logits": to_numpy(logits), "aux": _tree_np(aux), "losses": {k: float(v) for k, v in metrics.items()}}

    def grads(self, batch: dict, forced=None, patch=None) -> dict[str, np.ndarray]:
        """Gradients by HF name, from the training path itself: ``make_grad_fn`` (micro-batch
        accumulation included), with ``forced_idx`` when a routing is replayed; ``patch`` (a
        context manager) is active while the function is traced (a fault's jax-side hook)."""
        import jax  # late: jax (see the note on imports)

        from jaxmoe.train.objective import make_grad_fn, with_forced_routing

        cfg = self.cfg
        jb = self.batch(batch if forced is None else with_forced_routing(batch, forced))
        with patch if patch is not None else contextlib.nullcontext():  # a fault's jax-side patch (traced here)
            grads, _, _ = jax.jit(make_grad_fn(self.model))(self.params, self.buffers, jb)
        return self.namer(cfg, _tree_np(grads), with_buffers=False)

    def train(self, batches: list[dict], forced: list | None = None) -> dict:
        """N steps of ``make_train_step``; -> {"losses": [...], "params": HF dict, "bias": [Lm, E]}.
        ``forced[i]`` (``idx [Lm, B*S, k]`` or None): step ``i`` replays that routing
        (:func:`parity.forcing.force_after_near_tie`)."""
        from jaxmoe.model.transformer import declared_groups  # late: jax (see the note on imports)
        from jaxmoe.train.objective import with_forced_routing
        from jaxmoe.train.optim import build_optimizer
        from jaxmoe.train.step import init_state, make_train_step

        cfg = self.cfg
        tx = build_optimizer(cfg.optim, cfg.train.steps, self.params0, declared_groups(cfg))
        state = init_state(cfg, tx, self.params0, self.buffers0)
        if self.ctx is not None:
            state = self.ctx.place_state(state)
        step = make_train_step(self.model, tx, donate=False)
        losses, counts, routing, first = [], [], [], None
        for i, b in enumerate(batches):
            jb = self.batch(b)
            # the step's routing, for the near-tie classification of a training flip: the same
            # forward on the same state (its counts are checked against the step's own below)
            _, aux = self._fwd(state["params"], state["buffers"], jb["inputs"], None, packing_kwargs(jb))
            bias = state["buffers"].get("moe", {}).get("expert_bias") if state["buffers"] else None
            r = aux["router"]
            fi = None if forced is None else forced[i]
            rec = routing_record(cfg.moe, to_numpy(r["topk_idx"]) if fi is None else fi, to_numpy(r["scores"]),
                                 None if bias is None else to_numpy(bias))
            state, m = step(state, jb if fi is None else with_forced_routing(jb, fi))
            losses.append(float(m["loss"]))
            counts.append(np.rint(to_numpy(m["counts"])).astype(np.int64))
            seen = np.stack([np.bincount(x.ravel(), minlength=cfg.moe.n_experts) for x in rec["idx"]])
            if seen.shape == counts[-1].shape and (seen != counts[-1]).any():
                rec["forward_differs"] = True  # a near-tie between the two compilations: reported, not hidden
            routing.append(rec)
            if i == 0:  # after update 1: the optimizer faults are localised here
                first = self._snapshot(state)
        out = self._snapshot(state)
        return {"losses": losses, **out, "counts": counts, "routing": routing, "params1": first["params"],
                "bias1": first["bias"]}

    def _snapshot(self, state) -> dict:
        params, buffers = _tree_np(state["params"]), _tree_np(state["buffers"])
        return {"params": self.namer(self.cfg, params, with_buffers=False),
                "bias": buffers.get("moe", {}).get("expert_bias")}


def split_rows(batch: dict, n: int) -> list[dict]:
    size = batch["inputs"].shape[0] // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]


def split_forced(forced: np.ndarray, cfg: Config, n: int) -> list[np.ndarray]:
    """forced_idx ``[Lm, B*S, k]`` (row-major tokens) -> per micro-batch ``[Lm, (B/n)*S, k]``."""
    lm, _, k = forced.shape
    b, s = cfg.train.batch_size, cfg.train.seq_len
    f = np.asarray(forced).reshape(lm, b, s, k)
    size = b // n
    return [f[:, i * size:(i + 1) * size].reshape(lm, size * s, k) for i in range(n)]


class TorchSide:
    """torch_ref on the same weights; ``fault`` (parity.faults) may alter it."""

    def __init__(self, cfg: Config, hf: dict[str, np.ndarray], fault=None, jax_info=None):
        import torch  # late: torch (see the note on imports)

        self.fault = fault
        self.cfg = fault.torch_config(cfg) if fault is not None else cfg
        torch.manual_seed(self.cfg.train.seed)
        self.hf = hf
        self.jax_info = jax_info  # what a fault may need to pick its target (e.g. expert counts)
        self.model = self._build()

    def _build(self):
        import torch  # late: torch (see the note on imports)

        from torch_ref.transformer import TorchTransformer

        model = TorchTransformer(self.cfg, seed=self.cfg.train.seed)
        state = {k: torch.from_numpy(v.copy()) for k, v in self.hf.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"torch_ref state_dict does not match the HF map: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        if self.fault is not None:
            self.fault.edit_weights(model, self.jax_info)
        return model

    def patched(self):
        return self.fault.patch() if self.fault is not None else contextlib.nullcontext()

    def forward(self, batch: dict, forced=None) -> dict:
        import torch  # late: torch (see the note on imports)

        from torch_ref.losses import compute_loss

        tb = torch_batch(batch)
        f = None if forced is None else torch.from_numpy(np.asarray(forced).astype(np.int64))
        with self.patched(), torch.no_grad():
            logits, aux = self.model(tb["inputs"], forced_idx=f, return_probes=True, **packing_kwargs(tb))
            _, metrics = compute_loss(self.cfg, logits, aux, tb)
        return {"logits": to_numpy(logits), "aux": _tree_np(aux), "losses": dict(metrics)}

    def grads(self, batch: dict, forced=None) -> dict[str, np.ndarray]:
        import torch  # late: torch (see the note on imports)

        from torch_ref.losses import loss_terms, weighted_total
        from torch_ref.train import accumulate_gradients

        cfg, model = self.cfg, self.model
        model.zero_grad(set_to_none=True)
        tb = torch_batch(batch)
        with self.patched():
            if forced is None:
                accumulate_gradients(model, tb, cfg)
            else:
                n = cfg.train.micro_batches
                n_valid = ((tb["mask"] > 0) & (tb["targets"] >= 0)).sum().clamp(min=1)
                for mb, fi in zip(split_rows(tb, n), split_forced(forced, cfg, n)):
                    logits, aux = model(mb["inputs"], forced_idx=torch.from_numpy(fi.astype(np.int64)),
                                        **packing_kwargs(mb))
                    terms = loss_terms(cfg, logits, aux, mb, n_valid=n_valid)
                    weighted_total(cfg, terms, aux_scale=1.0 / n).backward()
        out = {}
        for name, p in model.named_parameters():
            out[name] = np.zeros(tuple(p.shape), np.float32) if p.grad is None else to_numpy(p.grad).astype(np.float32)
        model.zero_grad(set_to_none=True)
        return out

    def train(self, batches: list[dict]) -> dict:
        """N ``torch_ref.train.train_step`` calls on a fresh copy of the initial weights."""
        import torch_ref.train as ttrain  # late: torch (see the note on imports)

        model = self._build()  # fresh weights: forward/grad checks must not leak into training
        # expert counts of each step, captured from the MoE blocks' aux (train_step returns none)
        seen: list = []
        blocks = model.moe_blocks()
        hooks = [blk.register_forward_hook(
            lambda mod, inp, out, j=j: seen.append((j, to_numpy(out[1]["counts"]), to_numpy(out[1]["topk_idx"]),
                                                    to_numpy(out[1]["scores"]))))
                 for j, blk in enumerate(blocks)]
        losses, counts, routing, first = [], [], [], None
        try:
            with self.patched():  # optimizer faults patch the optimizer's construction too
                # looked up on the module while patched: a fault may replace make_optimizer
                opt = ttrain.make_optimizer(model, self.cfg)
                sched = ttrain.make_scheduler(opt, self.cfg)
                for i, b in enumerate(batches):
                    seen.clear()
                    biases = model.expert_biases()
                    bias_now = np.stack([to_numpy(x) for x in biases]) if biases else None
                    losses.append(float(ttrain.train_step(model, opt, sched, torch_batch(b), self.cfg)["loss"]))
                    c = np.zeros((len(blocks), self.cfg.moe.n_experts), np.int64)
                    for j, cj, _, _ in seen:
                        c[j] += cj.astype(np.int64)
                    counts.append(c)
                    if len(seen) == len(blocks):  # one forward (no micro-batches): its routing per token
                        order = sorted(seen, key=lambda x: x[0])
                        routing.append(routing_record(self.cfg.moe, np.stack([x[2] for x in order]),
                                                      np.stack([x[3] for x in order]), bias_now))
                    if i == 0:  # after update 1: the optimizer faults are localised here
                        first = self._snapshot(model)
        finally:
            for h in hooks:
                h.remove()
        return {"losses": losses, **self._snapshot(model), "counts": counts,
                "routing": routing if len(routing) == len(losses) else None, "params1": first["params"],
                "bias1": first["bias"]}

    @staticmethod
    def _snapshot(model) -> dict:
        params = {n: to_numpy(p).astype(np.float32) for n, p in model.named_parameters()}
        biases = model.expert_biases()
        return {"params": params, "bias": np.stack([to_numpy(b) for b in biases]) if biases else None}
