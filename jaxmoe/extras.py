"""Optional dependencies: import one lazily, or fail with one line naming the pip extra.

The core install (``pip install jaxmoe``) is what ``jaxmoe train`` needs: jax, flax, optax,
orbax-checkpoint, numpy, safetensors. Everything else is an extra of ``pyproject.toml``:

* ``[ref]``  torch + transformers: ``convert --verify``, ``logits --framework torch|hf``,
  ``parity``, ``torch_ref``;
* ``[text]`` tokenizers: ``--data text:`` and ``jaxmoe tokenizer``;
* ``[data]`` pyarrow + array_record: ``--data parquet:|hfds:|arrayrecord:``;
* ``[plot]`` matplotlib: ``jaxmoe plot``;
* ``[tb]``   tensorboardX: TensorBoard files (skipped with a note when absent);
* ``[wandb]`` wandb: ``train.wandb = true``;
* ``[lmeval]`` lm-eval: ``jaxmoe.train.lm_eval_model`` (jaxmoe as an lm-eval model);
* ``[titan]`` torchtitan (+ what it needs to import on CPU): ``jaxmoe config --from-titan``,
  ``python -m parity run --reference torchtitan``.
"""

from __future__ import annotations

import importlib
import importlib.util

from jaxmoe.errors import UserError

# top-level module -> the extra that installs it
EXTRA_OF = {
    "torch": "ref",
    "transformers": "ref",
    "torch_ref": "ref",
    "tokenizers": "text",
    "pyarrow": "data",
    "array_record": "data",
    "matplotlib": "plot",
    "tensorboardX": "tb",
    "wandb": "wandb",
    "lm_eval": "lmeval",
    "torchtitan": "titan",
}


def hint(module: str, what: str) -> str:
    """The one-line message for a missing optional ``module`` needed by ``what``."""
    top = module.split(".")[0]
    if top == "grain":  # a core dependency (the data pipeline), not an extra
        return (f"{what} needs grain, which is not installed: pip install 'grain>=0.2.18,<0.3' "
                "(or reinstall jaxmoe)")
    extra = EXTRA_OF.get(top, "ref")
    if extra == "titan":  # torchtitan's declared dependencies are not needed (pyproject.toml)
        return (f"{what} needs torchtitan, which is not installed: pip install 'jaxmoe[titan]' && "
                f"pip install --no-deps torchtitan==0.3.0 (or pip install -e '.[titan]' in a checkout, then the same)")
    return (f"{what} needs {top}, which is not installed: pip install 'jaxmoe[{extra}]' "
            f"(or pip install -e '.[{extra}]' in a checkout)")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str):
    """``import module`` or raise :class:`UserError` with :func:`hint`'s one line."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or module
        raise UserError(hint(missing if missing.split(".")[0] in EXTRA_OF else module, what)
                        ) from None


__all__ = ["EXTRA_OF", "hint", "installed", "require"]
