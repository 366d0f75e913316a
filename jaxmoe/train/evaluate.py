"""The held-out loss the loop records every ``train.eval_every`` steps (``eval_ce`` in the step's
row): the mean cross-entropy of ``train.eval_batches`` batches of the eval split, the same batches
every time (the eval data is built once, on first use, and rewound before each evaluation).
"""

from __future__ import annotations

import jax

from jaxmoe.config import Config
from jaxmoe.data import make_data
from jaxmoe.train.step import make_eval_step


class Evaluator:
    """``run(state) -> {"eval_ce": x}`` for the model ``model`` (see the module doc); ``place``
    puts a numpy batch on the devices as the train step's batches are."""

    def __init__(self, cfg: Config, model, place):
        self.cfg, self.model, self.place = cfg, model, place
        self.fn, self.data = None, None

    def run(self, state) -> dict:
        if self.fn is None:
            self.fn = make_eval_step(self.model)
        if self.data is None:
            self.data = make_data(self.cfg, "eval", process_index=jax.process_index(),
                                  process_count=jax.process_count(), workers=0)
        self.data.reset()
        ces = [float(jax.device_get(self.fn(state["params"], state["buffers"],
                                              self.place(self.data.next_batch()))["ce"]))
               for _ in range(self.cfg.train.eval_batches)]
        return {"eval_ce": sum(ces) / len(ces)}

    def close(self) -> None:
        if self.data is not None:
            self.data.close()


__all__ = ["Evaluator"]
