"""Meshes: the logical-axis sharding rules, the device mesh and placement, multi-host start-up, and
expert-parallel dispatch (the mesh form of the experts' compute, inside ``shard_map``).

May import: ``jaxmoe.model``, ``jaxmoe.config``, ``jaxmoe.errors``, ``jaxmoe.trees``.
"""
