"""``data.source`` specs with mixtures: ``mix:W1*SPEC1,W2*SPEC2,...``.

A mixture draws the rows of each batch from several sources in the proportions of the weights
(normalised to sum to 1). The interleaving is Grain's ``IterDataset.mix``: a fixed, deterministic
schedule of which source gives row ``k`` (integer arithmetic on the proportions, so that every
prefix of the rows holds each source's share up to rounding; no random draw), the same on every
process, resuming exactly from the iterator state (its row counter). Each source
keeps its own order, sharding, tokenization and packing; per-source token counts are kept by
:class:`jaxmoe.data.pipeline.DataIterator` and written to ``metrics.jsonl`` as ``data_tokens``.

A plain spec (no ``mix:``) is a mixture of one source with weight 1.
"""

from __future__ import annotations

import math

from jaxmoe.errors import UserError

PREFIX = "mix:"


def parse_data_spec(spec: str) -> list[tuple[float, str]]:
    """``[(weight, source spec), ...]`` with the weights normalised; UserError on a bad spec."""
    spec = spec.strip()
    if not spec.startswith(PREFIX):
        if not spec:
            raise UserError("data.source is empty; use default, tokens:PATH, text:PATH or mix:...")
        return [(1.0, spec)]
    body = spec[len(PREFIX):]
    out: list[tuple[float, str]] = []
    for part in body.split(","):
        w, star, src = part.partition("*")
        if not star or not src.strip():
            raise UserError(f"data.source mixture part {part!r} is not WEIGHT*SPEC "
                            "(e.g. mix:0.7*tokens:a.bin,0.3*text:b.jsonl)")
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"data.source mixture weight {w!r} in {part!r} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise UserError(f"data.source mixture weight {w.strip()} of {src.strip()} must be > 0")
        if src.strip().startswith(PREFIX):
            raise UserError(f"data.source mixture part {part!r}: mixtures do not nest")
        out.append((weight, src.strip()))
    names = [s for _, s in out]
    if len(set(names)) != len(names):
        raise UserError(f"data.source mixture names a source twice ({spec}); merge their weights")
    total = sum(w for w, _ in out)
    return [(w / total, s) for w, s in out]


__all__ = ["PREFIX", "parse_data_spec"]
