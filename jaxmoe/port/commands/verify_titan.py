"""torchtitan as a ``convert --verify`` side: its own model of a ``dcp:`` checkpoint's flavor.

A ``dcp:`` checkpoint is torchtitan's format, so ``--verify`` runs it in torchtitan (the
``titan`` framework of :attr:`jaxmoe.port.formats.base.Format.verify_frameworks`): the model of
the flavor is built by torchtitan's own classes (:func:`jaxmoe.port.commands.titan_model.build_titan_model`: CPU,
fp32, fp32 grouped experts, SDPA attention), its state dict is filled **by the names the model
itself declares** from the step directory through jaxmoe's safe reader
(:class:`jaxmoe.port.io.dcp_io.DcpDir`: nothing from the checkpoint is unpickled by torch, and
:mod:`jaxmoe.port.maps.titan_map` is not consulted), and ``model.load_state_dict`` takes them through
torchtitan's own load hooks (Qwen3's ``wq``/``wk``/``wv`` merged into ``wqkv`` there). The logits
and the residual stream after each layer (forward hooks on ``model.layers``) are what
:func:`titan_side` returns.

Which model: the flavor a checkpoint's config came from. A config names one when its
``model.name`` is ``titan:FAMILY/FLAVOR`` (what ``--titan FAMILY/FLAVOR`` and ``jaxmoe config
--from-titan`` give) and its model and routing fields are still the flavor's own
(:func:`titan_flavor`); a ``--titan`` jaxmoe preset or a config ``.toml`` that differs from every
flavor (e.g. the flavor with ``--set moe.score_func=sigmoid``) has no torchtitan model: ``--verify``
then runs jaxmoe on that side, as before, and says so in one ``note:`` line. A ``dcp:`` destination
holds no config either: it is verified as the model of the conversion's source
(:func:`dcp_destination`).

``--verify-layers N``: the flavor's layer list is cut to its first ``N`` entries before building
(dense layers come first in every flavor jaxmoe maps, so the cut keeps ``min(k, N)`` of them, as
:func:`jaxmoe.port.commands.verify.truncated` does), and only those layers' tensors are read.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np

from jaxmoe.config import Config, config_to_toml
from jaxmoe.errors import UserError
from jaxmoe.port.formats.base import Endpoint, shape_text

TITAN = "titan"  # the framework name in Format.verify_frameworks
PREFIX = "titan:"  # model.name of a config mapped from a torchtitan flavor
#: the routing fields that change a forward (the rest of moe.* is training: losses, bias update,
#: jaxmoe's expert compute path)
FORWARD_MOE = ("n_experts", "top_k", "expert_ffn_dim", "n_shared_experts", "score_func", "norm_topk_prob",
               "route_scale", "n_groups", "topk_groups", "use_expert_bias")


def titan_flavor(cfg: Config) -> tuple[str | None, str]:
    """``(FAMILY/FLAVOR, "")`` when torchtitan has a model of ``cfg`` (see the module doc), else
    ``(None, why not)``."""
    name = cfg.model.name
    if not name.startswith(PREFIX):
        return None, f"model {name!r} is a jaxmoe config, not a torchtitan FAMILY/FLAVOR"
    spec = name[len(PREFIX):]
    from jaxmoe.config.titan import titan_config  # late: torchtitan

    try:
        flavor = titan_config(spec)
    except UserError as e:
        return None, f"torchtitan's {spec} is not available ({e})"
    m_have, m_want = dataclasses.asdict(cfg.model), dataclasses.asdict(flavor.model)
    differ = [f"model.{k}" for k in m_want if k != "init_std" and m_have[k] != m_want[k]]
    differ += [f"moe.{k}" for k in FORWARD_MOE if getattr(cfg.moe, k) != getattr(flavor.moe, k)]
    if differ:
        return None, f"the config differs from torchtitan's {spec} in {', '.join(differ[:4])}"
    return spec, ""


def usable(ep: Endpoint) -> tuple[bool, str]:
    """Whether torchtitan runs ``ep`` (a ``dcp:`` endpoint with its ``--titan`` spec); else why not."""
    if not ep.options.get("titan"):
        return False, "no --titan model"
    from jaxmoe.config import named_config

    spec, why = titan_flavor(named_config(ep.options["titan"]))
    return spec is not None, why


def dcp_destination(dst: Endpoint, cfg: Config, scratch: Path) -> Endpoint:
    """``dst`` (a written ``dcp:`` step, which holds no config) with the ``--titan`` spec of the
    source's config ``cfg``: its torchtitan flavor, else a copy of ``cfg`` as a ``.toml`` in
    ``scratch`` (jaxmoe then runs it)."""
    spec, _ = titan_flavor(cfg)
    if spec is None:
        path = scratch / "source-config.toml"
        path.write_text(config_to_toml(cfg))
        spec = str(path)
    return dst.with_options(titan=spec)


def titan_model(ep: Endpoint, n_layers: int | None = None):
    """torchtitan's model of ``ep``'s flavor (first ``n_layers`` layers), fp32 on CPU, with the
    checkpoint's tensors loaded by the model's own state-dict names (eval mode)."""
    import torch  # late: torch and torchtitan

    from jaxmoe.config import named_config
    from jaxmoe.config.titan import titan_model_config
    from jaxmoe.port.commands.titan_model import build_titan_model
    from jaxmoe.port.io.dcp_io import DcpDir

    spec, why = titan_flavor(named_config(ep.options["titan"]))
    if spec is None:
        raise UserError(f"{ep}: torchtitan cannot run it: {why}")
    tc = titan_model_config(spec)
    if n_layers is not None:
        tc.layers = tc.layers[:n_layers]
    model = build_titan_model(tc, fp32_experts=True).eval()
    d = DcpDir(ep.path, str(ep))
    d.check_files()
    state = {}
    for name, t in model.state_dict().items():
        if name not in d.tensors:
            raise UserError(f"{ep}: torchtitan's {spec} model has tensor {name}, which the checkpoint "
                            "does not hold")
        if d.shape(name) != tuple(t.shape):
            raise UserError(f"{ep}: tensor {name} has shape {shape_text(d.shape(name))} in the checkpoint "
                            f"but torchtitan's {spec} model says {shape_text(t.shape)}")
        state[name] = torch.from_numpy(np.asarray(d.read(name), np.float32))
    model.load_state_dict(state, strict=True)
    return model


def titan_side(ep: Endpoint, tokens: np.ndarray, n_layers: int | None = None):
    """torchtitan on the ``dcp:`` step ``ep``: ``(logits, hidden [n-1, B, S, D])``, hidden the
    residual stream after each of the first ``n - 1`` layers (the last is checked by the logits)."""
    import torch  # late: torch

    from jaxmoe.config import named_config
    from jaxmoe.port.commands.logits import check_tokens

    check_tokens(tokens, named_config(ep.options["titan"]))
    model = titan_model(ep, n_layers)
    layers = list(model.layers.values())
    seen: list = []
    hooks = [layer.register_forward_hook(lambda mod, inp, out: seen.append(out)) for layer in layers[:-1]]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torchtitan's router asks for an fp32 CPU autocast, which torch declines (harmless)
            warnings.filterwarnings("ignore", message="In CPU autocast", category=UserWarning)
            logits = model(torch.from_numpy(np.asarray(tokens, np.int64)))
    finally:
        for h in hooks:
            h.remove()
    hidden = np.stack([h.float().numpy() for h in seen]) if seen else None
    return logits.float().numpy(), hidden


__all__ = ["FORWARD_MOE", "TITAN", "dcp_destination", "titan_flavor", "titan_model", "titan_side", "usable"]
