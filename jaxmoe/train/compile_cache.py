"""The persistent XLA compilation cache of ``jaxmoe train``: a second run of the same config skips
most of the compile.

On by default, in a user cache directory keyed by jax version and backend:
``$JAXMOE_CACHE_DIR`` or ``$XDG_CACHE_HOME/jaxmoe`` (default ``~/.cache/jaxmoe``), then
``jax-<version>-<backend>/``. Opt out with ``JAXMOE_COMPILE_CACHE=0`` (or ``--no-compile-cache``).
A cache directory configured for jax already (``JAX_COMPILATION_CACHE_DIR``) is used as it is.
:class:`CacheHits` counts the hits while it is active, so the "compiled in ..." line can say
whether the step came from the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def cache_dir() -> Path:
    base = os.environ.get("JAXMOE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxmoe")
    return Path(base) / f"jax-{jax.__version__}-{jax.default_backend()}"


def enable(enabled: bool = True) -> str | None:
    """Turn the cache on (unless disabled); returns the directory in use, or None."""
    if not enabled or os.environ.get("JAXMOE_COMPILE_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return str(current)
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable cache location must not stop training
        return None
    jax.config.update("jax_compilation_cache_dir", str(d))
    return str(d)


class CacheHits:
    """Counts persistent-cache hits between ``__enter__`` and ``__exit__``."""

    EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.hits = 0

    def _listen(self, event, **kwargs):
        if event == self.EVENT:
            self.hits += 1

    def __enter__(self):
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc):
        unregister = getattr(jax.monitoring, "unregister_event_listener", None)
        if unregister is not None:
            try:
                unregister(self._listen)
            except (AssertionError, KeyError, ValueError):  # already gone
                pass
        return False


__all__ = ["CacheHits", "cache_dir", "enable"]
