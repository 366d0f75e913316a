"""``jaxmoe plan`` (jaxmoe/plan/memory.py, jaxmoe/plan/lower.py): the CLI contract, bad-input lines, the
accounting against the rules and against XLA:CPU's memory_analysis() on small presets, lowering
on an abstract mesh and the optimizer update's collectives in the partitioned module.

The europa-952b --lower runs (minutes on 2 cores) are ``slow``; their output is recorded in
docs/MEASUREMENTS.md ("Planner: europa-952b").
"""

import json
import math

import pytest

from jaxmoe.cli import main
from jaxmoe.config import load_config
from jaxmoe.config.counting import count_params
from jaxmoe.parallel.mesh import parse_mesh
from jaxmoe.plan.memory import MAX_REPLICATED_DENSE, make_plan, plan_config

CONTRACT = {"total_params", "active_params", "flops_per_token", "per_device", "fits", "lowered",
            "replicated_dense_fraction", "optimizer_update_collectives"}
KINDS = {"params", "grads", "optimizer_state", "dispatch_buffers", "activations"}


def _run_json(capsys, argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_contract_fields_and_memory_spaces(capsys):
    out = _run_json(capsys, ["--preset", "tiny", "--mesh", "fsdp=2,expert=4", "--set", "mesh.expert_axes=fsdp,expert",
                             "--optimizer", "muon", "--device-memory", "1", "--host-memory", "1"])
    assert CONTRACT <= set(out)
    assert KINDS <= set(out["per_device"])
    for v in out["per_device"].values():
        assert set(v) == {"device", "pinned_host"}
    c = count_params(load_config("tiny"))
    assert (out["total_params"], out["active_params"]) == (c["total_params"], c["active_params"])
    assert out["fits"] is True and out["lowered"] is False and out["experts_whole"] is True
    # exact parameter bytes per device: fp32 params / 8 devices (tiny shards every leaf but norms)
    total_bytes = 4 * c["total_params"]
    assert total_bytes / 8 <= out["per_device"]["params"]["device"] <= total_bytes / 8 * 1.1
    # the optimizer state moves to pinned_host with --offload-optimizer
    off = _run_json(capsys, ["--preset", "tiny", "--mesh", "fsdp=2,expert=4", "--optimizer", "adamw",
                             "--offload-optimizer", "--host-memory", "1"])
    st = off["per_device"]["optimizer_state"]
    assert st["device"] == 0 and st["pinned_host"] > 0
    # text output names the same figures
    assert main(["plan", "--preset", "tiny", "--mesh", "expert=8"]) == 0
    text = capsys.readouterr().out
    assert "fits: yes" in text and "optimizer_state" in text


def test_does_not_fit_names_the_largest_contributors(capsys):
    out = _run_json(capsys, ["--preset", "tiny", "--mesh", "expert=8", "--device-memory", "0.0001"])
    assert out["fits"] is False
    (over,) = out["does_not_fit"]
    assert over["memory_space"] == "device" and over["need_bytes"] > over["have_bytes"]
    sizes = [c["bytes"] for c in over["largest"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) >= 2


@pytest.mark.parametrize("argv,match", [
    (["--preset", "nope", "--mesh", "expert=8"], r"nope"),
    (["--preset", "tiny", "--mesh", "expert=3"], r"mesh axis expert=3 does not divide moe.n_experts=8"),
    (["--preset", "tiny", "--mesh", "fsdp=4,expert=4", "--set", "mesh.expert_axes=fsdp,expert"],
     r"mesh axis fsdp=4\*expert=4 does not divide moe.n_experts=8"),
    (["--preset", "tiny", "--mesh", "expert=-1"], r"give every mesh axis a size"),
    (["--preset", "tiny", "--mesh", "experts=8"], r"unknown axis 'experts'"),
    (["--preset", "tiny", "--mesh", "expert=8", "--tokens-per-device", "100"], r"multiple of train.seq_len=64"),
    (["--preset", "tiny", "--mesh", "expert=8", "--device-memory", "-1"], r"--device-memory -1.0: must be >= 0"),
    (["--mesh", "expert=8"], r"give --preset"),
])
def test_bad_input_is_one_line(capsys, argv, match):
    import re

    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


def test_europa_layouts_accounting():
    """Without lowering (seconds): the factored layout keeps experts whole, replicates < 5% of the
    dense weights and fits 96 GB; replica=4,expert=384 replicates most dense weights and does not."""
    new = make_plan(plan_config(load_config("europa-952b"), parse_mesh("replica=4,fsdp=128,expert=3"),
                                optimizer="muon"), device_memory_gb=96, host_memory_gb=120)
    assert new["fits"] and new["experts_whole"] and new["replicated_dense_fraction"] <= MAX_REPLICATED_DENSE
    assert not new["layout_problems"]
    old = make_plan(plan_config(load_config("europa-952b"), parse_mesh("replica=4,expert=384"), optimizer="muon"),
                    device_memory_gb=96, host_memory_gb=120)
    assert not old["fits"] and old["replicated_dense_fraction"] > 0.5 and old["layout_problems"]
    # the measurement: ~10.2B parameters per device on the old layout (40.9 GB fp32)
    assert 10.0e9 < old["per_device"]["params"]["device"] / 4 < 10.4e9


slow = pytest.mark.slow
# Planner vs XLA:CPU memory_analysis(), measured table: docs/MEASUREMENTS.md ("Planner: europa-952b
# layouts"). Every preset x optimizer x remat policy is a case; each is one compile of the real
# step (the cost), so the fast tier runs the four cheapest that between them cover both presets,
# both optimizers and every remat policy (tiny-mla adamw/full: the case the dispatch model was
# fixed for), and the rest are slow.
MEMORY_FAST = {("tiny-mla", "adamw", "full"), ("tiny", "muon", "none"), ("tiny", "adamw", "save_dots"),
               ("tiny", "adamw", "offload")}
MEMORY_CASES = [pytest.param(p, o, r, marks=() if (p, o, r) in MEMORY_FAST else slow, id=f"{p}-{o}-{r}")
                for p in ("tiny", "tiny-mla") for o in ("adamw", "muon")
                for r in ("none", "full", "save_dots", "offload")]


@pytest.fixture(scope="module")
def memory_analyses():
    """(preset, optimizer, remat) -> (config, XLA's memory_analysis figures): one compile per
    combination for the whole module, whichever test asks first."""
    from jaxmoe.plan.lower import compiled_memory

    cache = {}

    def get(preset, optimizer, remat):
        key = (preset, optimizer, remat)
        if key not in cache:
            # compute.scan_unroll=1: the planner models the rolled layer scan, what `auto` picks on
            # a GPU; XLA:CPU here would otherwise compile auto's CPU choice (these layers unrolled)
            cfg = plan_config(load_config(preset, overrides=["mesh.expert_axes=fsdp,expert", "compute.scan_unroll=1"]),
                              parse_mesh("fsdp=2,expert=4"), optimizer=optimizer, remat=remat)
            cache[key] = (cfg, compiled_memory(cfg))
        return cache[key]

    return get


@pytest.mark.parametrize("preset,optimizer,remat", MEMORY_CASES)
def test_planner_agrees_with_xla_memory_analysis(memory_analyses, preset, optimizer, remat):
    """The planner's per-device device total within 15% of XLA:CPU's memory_analysis() of the
    real train step compiled on 8 fake devices (arguments + outputs - donated aliases + temps),
    on fsdp=2,expert=4 with whole experts."""
    cfg, xla = memory_analyses(preset, optimizer, remat)
    plan = make_plan(cfg)["per_device_total"]["device"]
    assert abs(plan - xla["peak_bytes"]) <= 0.15 * xla["peak_bytes"], (plan, xla, plan / xla["peak_bytes"])


def test_lower_and_optimizer_update_collectives(capsys):
    """--lower on tiny: the real step lowers for cuda on an abstract mesh; the Muon update of whole
    experts has no collectives in the partitioned module, while FSDP-sharded experts
    (mesh.expert_axes='expert' with fsdp=2) and FSDP-sharded dense matrices do."""
    from jaxmoe.plan.lower import optimizer_update_collectives

    out = _run_json(capsys, ["--preset", "tiny", "--mesh", "fsdp=2,expert=4", "--set", "mesh.expert_axes=fsdp,expert",
                             "--optimizer", "muon", "--lower"])
    assert out["lowered"] is True and out["lowering"]["platform"] == "cuda"
    shapes = {d["path"]: d["per_device_shape"] for d in out["lowering"]["largest_per_device_inputs"]}
    assert shapes["params/moe/experts/gate_proj"] == [2, 1, 64, 64]  # one whole expert per device
    c = out["optimizer_update_collectives"]
    assert "after SPMD partitioning" in c["module"] and c["same_specs"]
    assert c["expert"]["ops"] == 0 and c["expert"]["bytes"] == 0
    assert c["dense"]["ops"] > 0
    fsdp_experts = plan_config(load_config("tiny"), parse_mesh("fsdp=2,expert=4"), optimizer="muon")
    assert optimizer_update_collectives(fsdp_experts)["expert"]["ops"] > 0
    _check_comm_bytes(out, plan_config(load_config("tiny", overrides=["mesh.expert_axes=fsdp,expert"]),
                                       parse_mesh("fsdp=2,expert=4"), optimizer="muon"))


def _check_comm_bytes(out, cfg):
    """comm_bytes_per_step (tests/test_comm_volume.py has the hand counts): every key names mesh
    axes of size > 1, each figure sums its collectives, and the fsdp axis moves at least the full
    bytes of the dense (non-expert) weights sharded over it (each is gathered at least once forward)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxmoe.model.transformer import abstract_params
    from jaxmoe.plan.lower import state_specs

    comm = out["comm_bytes_per_step"]
    assert comm and all(set(k.split("+")) <= {"fsdp", "expert"} for k in comm), comm
    assert comm == {a: sum(r["bytes"] for r in ops.values()) for a, ops in out["comm_collectives"].items()
                    if a != "none"}
    params = abstract_params(cfg)[0]
    specs = state_specs(cfg, {"params": params, "buffers": {}, "opt_state": {}})["params"]
    leaves = jax.tree_util.tree_leaves_with_path(params)
    sharded = sum(math.prod(p.shape) * p.dtype.itemsize
                  for (kp, p), s in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))
                  if "fsdp" in jax.tree.leaves(tuple(s)) and "experts" not in jax.tree_util.keystr(kp))
    over_fsdp = sum(v for k, v in comm.items() if "fsdp" in k.split("+"))
    assert sharded > 0 and over_fsdp >= sharded, (comm, sharded)


@slow
def test_europa_lowered_show():
    """The issue's Show (minutes on 2 cores): europa-952b on replica=4,fsdp=128,expert=3 with Muon
    lowers, fits 96 GB + 120 GB, replicates <= 5% of the dense weights and its expert update has
    no collectives; replica=4,expert=384 does not fit."""
    cfg = plan_config(load_config("europa-952b"), parse_mesh("replica=4,fsdp=128,expert=3"), optimizer="muon")
    new = make_plan(cfg, device_memory_gb=96, host_memory_gb=120, lower=True)
    assert new["lowered"] and new["fits"] and new["replicated_dense_fraction"] <= 0.05
    assert new["optimizer_update_collectives"]["expert"]["ops"] == 0
    old = make_plan(plan_config(load_config("europa-952b"), parse_mesh("replica=4,expert=384"), optimizer="muon"),
                    device_memory_gb=96, host_memory_gb=120, lower=True)
    assert old["lowered"] and not old["fits"] and old["replicated_dense_fraction"] > 0.5


def test_planned_batch_carries_the_document_keys_when_packing_documents():
    """data.packing=documents: the planner's abstract batch has segment_ids/positions (int32,
    sharded like inputs), so the planned graph holds the document mask the real run computes."""
    from jax.sharding import AbstractMesh, AxisType

    from jaxmoe.parallel.sharding import AXES
    from jaxmoe.plan.lower import abstract_inputs

    mesh = AbstractMesh((1,) * len(AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    for packing, extra in (("windows", set()), ("documents", {"segment_ids", "positions"})):
        cfg = load_config("tiny", overrides=[f"data.packing={packing}"])
        _, _, batch = abstract_inputs(cfg, mesh)
        assert set(batch) == {"inputs", "targets", "mask"} | extra
        for k in extra:
            assert batch[k].dtype == "int32" and batch[k].sharding == batch["inputs"].sharding
