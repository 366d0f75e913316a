"""Collectives and bytes in the compiled (SPMD-partitioned) optimizer update, expert vs dense
parameters, for Muon's two placements (optim.muon_placement) on 8 fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python bench/optimizer_collectives.py [PRESET ...]

Experts are laid out either by the rules table ("rules") or with their E axis over fsdp x expert
("factored": whole experts per device), written as parameter shardings.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from jax.sharding import PartitionSpec as P

from jaxmoe.config import load_config
from jaxmoe.model.transformer import abstract_params
from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.parallel.sharding import declared_axes_flat, param_specs
from jaxmoe.plan.hlo_stats import optimizer_update_collectives, total
from jaxmoe.trees import key_path_str


def factored(cfg, sizes):
    params, _ = abstract_params(cfg)
    axes = declared_axes_flat(cfg)
    live = tuple(a for a in ("fsdp", "expert") if sizes[a] > 1)

    def one(kp, spec):
        ax = axes[key_path_str(kp)]
        if "experts" not in ax:
            return spec
        return P(*[(live if len(live) > 1 else live[0]) if n == "experts" else None for n in ax])

    specs = param_specs(params, axes, sizes)
    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=lambda x: isinstance(x, P))


def main():
    print("| preset | mesh | experts | placement | expert ops / bytes | dense ops / bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for preset in sys.argv[1:] or ("tiny", "tiny-mla"):
        for sizes in (dict(replica=1, fsdp=2, expert=4, tensor=1), dict(replica=1, fsdp=8, expert=1, tensor=1)):
            mesh = make_mesh(sizes)
            for layout in ("rules", "factored"):
                for placement in ("replicated", "owner"):
                    cfg = load_config(preset, overrides=["optim.optimizer=muon", f"optim.muon_placement={placement}"])
                    specs = factored(cfg, sizes) if layout == "factored" else None
                    r = optimizer_update_collectives(cfg, mesh, specs=specs)
                    (eo, eb), (do, db) = total(r["expert"]), total(r["dense"])
                    desc = ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
                    print(f"| {preset} | {desc} | {layout} | {placement} | {eo} / {eb} | {do} / {db} |", flush=True)


if __name__ == "__main__":
    main()
