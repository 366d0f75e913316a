"""Training: losses, the objective (micro-batches, gradients), optimizers (AdamW, Muon with its
Newton-Schulz placement), the jitted step, the loop and its helpers (data prefetch, preemption,
metrics, checkpoint cadence), ``--init-from`` / ``--resume-from``, and ``jaxmoe train`` / ``plot``.

May import everything below it: config, model, parallel, checkpoint, data, port, storage.
"""
