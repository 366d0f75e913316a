"""The planner (``jaxmoe plan``): per-device memory by kind, whether a layout fits, the train step
lowered on an abstract mesh, and the collectives and bytes of a compiled module.

May import everything below it, the training step included (it lowers the real step).
"""
