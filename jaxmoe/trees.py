"""Nested dicts <-> flat ``{"a/b/c": leaf}`` maps, the canonical parameter paths (docs/LAYOUT.md).

Pure Python: the HF mapping, the model's declarations and the HLO statistics all use these two.
"""

from __future__ import annotations


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a/b/c": leaf}."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, path))
        else:
            out[path] = v
    return out


def unflatten(flat: dict) -> dict:
    """{"a/b/c": leaf} -> nested dict."""
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = v
    return tree


__all__ = ["flatten", "unflatten"]
