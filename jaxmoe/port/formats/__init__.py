"""Checkpoint formats: the table of schemes, and parsing, opening and flags through it.

:data:`FORMATS` maps each scheme of ``SCHEME:PATH`` to its :class:`~.base.Format` class (the
protocol is :mod:`jaxmoe.port.formats.base`):

* ``hf``    :mod:`jaxmoe.port.formats.hf`    - a HuggingFace checkpoint directory;
* ``orbax`` :mod:`jaxmoe.port.formats.orbax` - a jaxmoe run dir (Orbax checkpoint);
* ``torch`` :mod:`jaxmoe.port.formats.torch` - torch_ref's single safetensors file;
* ``dcp``   :mod:`jaxmoe.port.formats.dcp`   - a torchtitan checkpoint step (DCP).

Adding a format is one module implementing the protocol plus one row here: ``convert``,
``logits``, ``--verify`` and ``train --init-from`` reach it through :func:`parse_endpoint`,
:func:`open_source`, ``Format.open_sink`` and the capabilities its class declares, and the
commands take its :class:`~.base.Option` flags from :func:`add_arguments`.
"""

from __future__ import annotations

from jaxmoe.errors import UserError
from jaxmoe.port.formats import dcp, hf, orbax, torch
from jaxmoe.port.formats.base import Endpoint, Format, Option, Source

FORMATS: dict[str, type[Format]] = {
    "hf": hf.HfFormat,
    "orbax": orbax.OrbaxFormat,
    "torch": torch.TorchFormat,
    "dcp": dcp.DcpFormat,
}

ROLE_WORDS = {"source": "sources", "sink": "destinations"}


def endpoint_help() -> str:
    """``hf:DIR | orbax:RUN_DIR[@STEP] | ...``: what a checkpoint flag takes."""
    return " | ".join(f.syntax for f in FORMATS.values())


def parse_endpoint(text: str, flag: str = "checkpoint") -> Endpoint:
    """The endpoint ``SCHEME:PATH`` names; a one-line UserError naming the valid forms."""
    scheme, sep, rest = str(text).partition(":")
    if not sep or scheme not in FORMATS or not rest:
        forms = [f.syntax for f in FORMATS.values()]
        expected = ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else forms[0]
        raise UserError(f"{flag} {text!r}: expected {expected}")
    return FORMATS[scheme].parse(str(text), rest, flag)


def open_source(ep: Endpoint) -> Source:
    """The opened source of ``ep`` (config and tensor headers read and checked)."""
    return ep.format.open_source(ep)


def options(roles=("source", "sink")) -> list[Option]:
    """Every format's options for ``roles``, once per name, in table order."""
    out: dict[str, Option] = {}
    for fmt in FORMATS.values():
        for opt in fmt.options:
            if opt.role in roles:
                out.setdefault(opt.name, opt)
    return list(out.values())


def add_arguments(parser, roles=("source", "sink")) -> None:
    """Add the formats' flags for ``roles`` to an argparse parser (values default to None)."""
    for opt in options(roles):
        if not opt.takes_value:
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const=True, default=None,
                                help=opt.help)
            continue
        parser.add_argument(opt.flag, dest=opt.name, choices=opt.choices, help=opt.help)


def option_values(args, roles=("source", "sink")) -> dict:
    """The formats' flags for ``roles`` as given on the command line (name -> value or None)."""
    return {opt.name: getattr(args, opt.name) for opt in options(roles)}


def bind_options(values: dict, source: Endpoint | None = None,
                 sink: Endpoint | None = None) -> tuple[Endpoint | None, Endpoint | None]:
    """``(source, sink)`` with the given format options attached to the one that takes each
    (values of None are not given). An option neither takes is a one-line UserError."""
    known = {opt.name: opt for opt in options()}
    eps = {"source": source, "sink": sink}
    for name, given in values.items():
        if given is None:
            continue
        if name not in known:
            raise TypeError(f"unknown checkpoint option {name!r}")
        opt = known[name]
        value = opt.value(given)
        ep = eps[opt.role]
        if ep is None or name not in {o.name for o in ep.format.options}:
            schemes = " / ".join(f"{s}:" for s, f in FORMATS.items()
                                 if any(o.name == name for o in f.options))
            have = "" if ep is None else f" ({ep.scheme}: takes no {opt.flag})"
            raise UserError(f"{opt.flag} applies to {schemes} {ROLE_WORDS[opt.role]} only{have}; "
                            "drop it")
        eps[opt.role] = ep.with_options(**{name: value})
    return eps["source"], eps["sink"]


def report_fields(sink: Endpoint) -> dict:
    """The reported sink options (:attr:`Option.report`) as written to ``sink``: the value used,
    None for a destination whose format has no such option."""
    out = {opt.name: None for opt in options(("sink",)) if opt.report}
    for opt in sink.format.options:
        if opt.report:
            out[opt.name] = sink.options.get(opt.name, opt.default)
    return out


__all__ = [
    "FORMATS", "add_arguments", "bind_options", "endpoint_help", "open_source", "option_values",
    "options", "parse_endpoint", "report_fields",
]
