"""transformers as a third side: the HF model users port from, on the same weights.

:class:`HFSide` builds the ``transformers`` model of the preset's architecture (DeepSeek-V3,
Qwen3-MoE, Mixtral) from the parity run's weights: torch_ref holds them by HF name, writes an HF
checkpoint (``torch_ref.hf_io.save_hf``: ``config.json`` from ``jaxmoe.config.hf.to_hf_config``,
per-expert tensors) and ``from_pretrained`` loads it (transformers 5 fuses the experts into
``experts.gate_up_proj [E, 2I, D]`` / ``experts.down_proj [E, D, I]`` on load).

Names. Every parameter of the run is found in the HF model *by value*: each HF tensor, or each
expert slice / gate-up half of a fused one, is matched to the run's tensor with identical bytes
(random weights are all distinct). So gradients and trained parameters come back under the
run's HF names, and a name that cannot be found (a loading or mapping error) fails the run.

What is compared (parity.hf_runner): routing per MoE layer (captured from the routers'
``(logits, weights, indices)`` with forward hooks), gate weights, logits and KL, the losses,
every gradient, and after ``--steps N`` with torch AdamW on the HF model the loss curve and every
parameter. The objective on both sides is ``ce + z_loss_coef * z_loss`` (+ ``lb_coef *`` HF's own
``aux_loss`` when ``moe.lb_scope == "pooled"``, the scope whose definition is HF's): HF computes
no sequence-aux or router-z loss, so those terms are left out of *both* objectives here (they are
compared against torch_ref by ``--reference torch_ref``).
"""

from __future__ import annotations

import hashlib
import tempfile

import numpy as np

from jaxmoe.archs import get_arch
from jaxmoe.config import Config
from jaxmoe.errors import UserError
from parity.checks import routing_record
from parity.sides import TorchSide, to_numpy, torch_batch


def lb_pooled(cfg: Config) -> bool:
    """HF's load-balance loss equals jaxmoe's only under the pooled scope (Qwen3 / Mixtral)."""
    return getattr(cfg.moe, "lb_scope", "layer") == "pooled" and cfg.moe.score_func == "softmax"


def _key(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return hashlib.sha1(a.tobytes() + str(a.shape).encode()).digest()


def _pieces(t: np.ndarray):
    """Candidate sub-tensors of an HF parameter: itself, and for a fused expert tensor each
    expert's slice and the two halves of that slice (gate / up), each as stored and transposed.
    Yields ``(where, array)`` with ``where = (expert or None, axis or None, half slice, transposed)``
    (see :func:`_take`)."""
    experts = range(t.shape[0]) if t.ndim == 3 else [None]
    for e in experts:
        s = t if e is None else t[e]
        if s.ndim != 2:
            yield (e, None, None, False), s
            continue
        for tr in (False, True):
            yield (e, None, None, tr), (s.T if tr else s)
            for ax in (0, 1):
                n = s.shape[ax]
                if n % 2 == 0:
                    for sl in (slice(0, n // 2), slice(n // 2, n)):
                        piece = s[sl] if ax == 0 else s[:, sl]
                        yield (e, ax, sl, tr), (piece.T if tr else piece)


def _take(t, where):
    e, ax, sl, tr = where
    s = t if e is None else t[e]
    if ax is not None:
        s = s[sl] if ax == 0 else s[:, sl]
    return s.T if tr else s


class HFSide:
    """The transformers model on the run's weights; forward, gradients and AdamW steps by the
    run's HF names (see the module doc)."""

    def __init__(self, cfg: Config, hf: dict[str, np.ndarray], grad_names: list[str]):
        import torch  # late: torch and transformers (see parity.sides on imports)
        import transformers

        from torch_ref.hf_io import save_hf

        self.cfg = cfg
        arch = get_arch(cfg.model.hf_arch)
        cls = getattr(transformers, arch.hf_class)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(TorchSide(cfg, hf).model, tmp)
            self.model = cls.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
        self.model.train()  # no dropout in these configs; train mode as the training step runs
        self.routers = [m for m in self.model.modules() if type(m).__name__.lower().endswith("router")]
        if len(self.routers) != cfg.model.n_moe_layers:
            raise UserError(f"--reference hf: found {len(self.routers)} router modules in "
                            f"{arch.hf_class}, expected {cfg.model.n_moe_layers}")
        self.names = self._map_names(hf, grad_names)

    def _map_names(self, hf, grad_names) -> dict[str, tuple]:
        """run name -> (HF parameter name, index, transposed), matched by value."""
        found: dict[str, tuple] = {}
        params = {pname: to_numpy(p) for pname, p in self.model.named_parameters()}
        for n in grad_names:  # same name, same values (norm scales are all ones: names decide)
            if n in params and params[n].shape == hf[n].shape and np.array_equal(params[n], hf[n]):
                found[n] = (n, (None, None, None, False))
        want: dict[bytes, list[str]] = {}
        for n in grad_names:
            if n not in found:
                want.setdefault(_key(hf[n]), []).append(n)
        for pname, p in params.items():
            if pname in found:
                continue
            for where, piece in _pieces(p):
                names = want.get(_key(piece))
                if names:
                    found[names.pop(0)] = (pname, where)
        missing = sorted(set(grad_names) - set(found))
        if missing:
            raise UserError(f"--reference hf: {len(missing)} parameters not found in the transformers model "
                            f"by value (first: {missing[:3]}); the HF export or loading lost them")
        return found

    def _by_name(self, tensors: dict) -> dict[str, np.ndarray]:
        return {n: np.ascontiguousarray(_take(tensors[p], where)).astype(np.float32)
                for n, (p, where) in self.names.items()}

    def _run(self, inputs):
        """Model forward with router capture: -> (logits, aux_loss or None, [(logits, w, idx)])."""
        seen = []
        hooks = [r.register_forward_hook(lambda mod, inp, out: seen.append(out)) for r in self.routers]
        try:
            # Qwen3-MoE / Mixtral (softmax routers) return their load-balance loss as aux_loss: always
            # asked for (a figure), added to the objective only under the pooled scope
            kw = {"output_router_logits": True} if self.cfg.moe.score_func == "softmax" else {}
            out = self.model(input_ids=inputs, use_cache=False, **kw)
        finally:
            for h in hooks:
                h.remove()
        return out.logits, getattr(out, "aux_loss", None), seen

    def objective(self, batch_t: dict):
        """(total, metrics, router outputs, logits): ``ce + zc * z_loss (+ lb_coef * aux)``."""
        import torch  # late: torch

        from torch_ref.losses import valid_mask

        logits, aux_loss, routers = self._run(batch_t["inputs"])
        valid = valid_mask(batch_t).float()
        n_valid = valid.sum().clamp(min=1.0)
        lg = logits.float()
        lse = torch.logsumexp(lg, -1)
        nll = lse - lg.gather(-1, batch_t["targets"].clamp(min=0)[..., None])[..., 0]
        ce = (nll * valid).sum() / n_valid
        zl = (lse.pow(2) * valid).sum() / n_valid
        total = ce + self.cfg.train.z_loss_coef * zl
        metrics = {"ce": float(ce.detach()), "z_loss": float(zl.detach())}
        if aux_loss is not None:
            metrics["lb"] = float(aux_loss.detach())
            if lb_pooled(self.cfg):
                total = total + self.cfg.moe.lb_coef * aux_loss
        metrics["loss"] = float(total.detach())
        return total, metrics, routers, logits

    def forward(self, batch: dict) -> dict:
        """-> {"logits", "aux": {"router": {...}, "counts", "dropped"}, "losses"} like the sides."""
        import torch  # late: torch

        e = self.cfg.moe
        with torch.no_grad():
            _, metrics, routers, logits = self.objective(torch_batch(batch))
        lg, scores, idx = self._router_arrays(routers)
        w = np.stack([to_numpy(r[1]) for r in routers]) if routers else np.zeros((0,))
        counts = np.stack([np.bincount(i.ravel(), minlength=e.n_experts) for i in idx]) if routers else idx
        return {"logits": to_numpy(logits), "losses": metrics,
                "aux": {"router": {"logits": lg, "scores": scores.astype(np.float32), "topk_idx": idx,
                                   "topk_weights": w},
                        "counts": counts, "dropped": np.zeros(len(idx), np.int64)}}

    def _router_arrays(self, routers) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(router logits, scores, top-k ids) ``[Lm, T, ...]`` of the captured router outputs."""
        lg = np.stack([to_numpy(r[0]) for r in routers]) if routers else np.zeros((0,))
        if self.cfg.moe.score_func == "sigmoid":
            scores = 1 / (1 + np.exp(-lg.astype(np.float64)))
        else:
            ex = np.exp(lg - lg.max(-1, keepdims=True))
            scores = ex / ex.sum(-1, keepdims=True)
        idx = np.stack([to_numpy(r[2]).astype(np.int64) for r in routers]) if routers else np.zeros((0,))
        return lg, scores, idx

    def grads(self, batch: dict) -> dict[str, np.ndarray]:
        self.model.zero_grad(set_to_none=True)
        total, _, _, _ = self.objective(torch_batch(batch))
        total.backward()
        g = {n: (np.zeros(tuple(p.shape), np.float32) if p.grad is None else to_numpy(p.grad))
             for n, p in self.model.named_parameters()}
        self.model.zero_grad(set_to_none=True)
        return self._by_name(g)

    def params(self) -> dict[str, np.ndarray]:
        return self._by_name({n: to_numpy(p) for n, p in self.model.named_parameters()})

    def train(self, batches: list[dict]) -> dict:
        """N steps of torch AdamW on the HF model with the run's hyper-parameters: decay on
        matrices and the lm_head (norms / embeddings per ``decay_norms`` / ``decay_embeddings``),
        global-norm clipping, torch_ref's LR schedule, the expert-bias sign update."""
        import torch  # late: torch

        from torch_ref.losses import update_expert_bias
        from torch_ref.train import lr_factor

        t, e = self.cfg.optim, self.cfg.moe
        if t.optimizer != "adamw":
            raise UserError("--reference hf trains with torch AdamW only (the fused expert tensors of "
                            "transformers 5 are 3-D, which torch.optim.Muon rejects); use --optimizer adamw "
                            "or --steps 0")
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            emb = n.endswith("embed_tokens.weight")
            if emb:
                (decay if t.decay_embeddings else no_decay).append(p)
            elif p.ndim >= 2 or n.startswith("lm_head."):
                decay.append(p)
            else:
                (decay if t.decay_norms else no_decay).append(p)
        groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        biases = [getattr(r, "e_score_correction_bias", None) for r in self.routers]
        losses, counts, routing, first = [], [], [], None
        for i, b in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            bias_now = [to_numpy(x) for x in biases if x is not None]
            total, m, routers, _ = self.objective(torch_batch(b))
            if routers:
                _, scores, idx = self._router_arrays(routers)
                routing.append(routing_record(self.cfg.moe, idx, scores, np.stack(bias_now) if bias_now else None))
            total.backward()
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
            torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), max_norm)
            for g in opt.param_groups:
                g["lr"] = t.lr * lr_factor(self.cfg, i)
            opt.step()
            losses.append(m["loss"])
            c = np.stack([np.bincount(to_numpy(r[2]).ravel().astype(np.int64), minlength=e.n_experts) for r in routers])
            counts.append(c)
            if e.use_expert_bias:
                with torch.no_grad():
                    for bias, cj in zip(biases, c):
                        bias.copy_(update_expert_bias(bias, torch.from_numpy(cj), e.bias_update_rate,
                                                      e.bias_update_rule))
            if i == 0:
                first = self._snapshot(biases)
        return {"losses": losses, **self._snapshot(biases), "counts": counts, "routing": routing,
                "params1": first["params"], "bias1": first["bias"]}

    def _snapshot(self, biases) -> dict:
        have = [b for b in biases if b is not None]
        return {"params": self.params(), "bias": np.stack([to_numpy(b) for b in have]) if have else None}


__all__ = ["HFSide", "lb_pooled"]
