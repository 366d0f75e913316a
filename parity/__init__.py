"""Parity suites: run jaxmoe and the PyTorch reference (torch_ref) on the same weights and batches
and compare routing, activations, losses, gradients and optimizer updates.

* :mod:`parity.runner` -- builds weights once, runs both sides, compares (``run_suite``).
* :mod:`parity.sides` -- the two sides (``JaxSide``, ``TorchSide``), weights and batches.
* :mod:`parity.checks` -- the comparisons (``Checks``, ``compare_*``, ``first_divergence``).
* :mod:`parity.tolerances` -- the tolerance profiles (measured; the one place for thresholds).
* :mod:`parity.report` -- report.json, report.md, plots, the ``--all`` summary.
* :mod:`parity.faults` -- fault injection self-test (the suite must be able to fail).
* :mod:`parity.cli` -- ``python -m parity run|selftest`` and ``jaxmoe parity``.

Importing this package does not import jax or torch.
"""
