"""Nested dicts <-> flat ``{"a/b/c": leaf}`` maps, the canonical parameter paths (docs/LAYOUT.md).

Pure Python: the HF mapping, the model's declarations and the HLO statistics all use these two;
:func:`key_path_str` names a leaf of a jax pytree by the same ``/``-joined path.
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


def key_path_str(key_path) -> str:
    """A jax pytree key path (``jax.tree_util.tree_leaves_with_path``) as the ``/``-joined path
    of :func:`flatten`: dict keys, attribute names (NamedTuple fields) and sequence indices."""
    parts = []
    for k in key_path:
        for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


__all__ = ["flatten", "key_path_str", "unflatten"]
