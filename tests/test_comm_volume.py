"""``comm_bytes_per_step`` (jaxmoe/plan/hlo_stats.py, jaxmoe/plan/lower.py): each collective of a
compiled module under the mesh axes its replica groups span, bytes per device, times loop trip
counts -- against hand counts on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmoe.parallel.mesh import make_mesh
from jaxmoe.plan.hlo_stats import axes_of_groups, comm_bytes_by_axis, replica_groups

SIZES = {"replica": 1, "fsdp": 2, "expert": 4, "tensor": 1}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(SIZES, jax.devices()[:8])


def test_replica_group_forms_map_to_axes():
    """Explicit, iota and XLA's mesh form; device ids are flattened mesh positions
    (replica, fsdp, expert, tensor) = (1, 2, 4, 1): ids differing by 4 differ in fsdp."""
    explicit = "x = f32[4] all-gather(y), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}"
    assert replica_groups(explicit) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axes_of_groups(replica_groups(explicit), SIZES) == "fsdp"
    iota = "x = f32[4] all-reduce(y), replica_groups=[2,4]<=[8], to_apply=%add"
    assert replica_groups(iota) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert axes_of_groups(replica_groups(iota), SIZES) == "expert"
    tr = "x = f32[4] all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    assert axes_of_groups(replica_groups(tr), SIZES) == "fsdp"
    mesh_form = ("x = f32[] all-reduce(y), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
                 "device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true")
    assert axes_of_groups(replica_groups(mesh_form), SIZES) == "expert"
    perm = "x = f32[4] collective-permute(y), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
    assert axes_of_groups(replica_groups(perm), SIZES) == "expert"
    assert axes_of_groups(replica_groups("x = f32[4] all-reduce(y), to_apply=%add"), SIZES) == "fsdp+expert"
    assert axes_of_groups([[0, 1, 4, 5]], SIZES) == "fsdp+expert"


def test_hand_count_gather_psum_permute_in_a_scan(mesh):
    """A (16, 32) f32 weight sharded over fsdp and gathered: 16*32*4 = 2048 bytes over fsdp; inside a
    3-step scan, a psum over expert of a per-device (4, 32) f32 block (512 bytes, 3 times) and a
    ppermute over expert of the same block (512 bytes, 3 times)."""
    from jax import shard_map

    def inner(h):
        def body(c, _):
            c = jax.lax.psum(c, "expert")
            return jax.lax.ppermute(c, "expert", [(i, (i + 1) % 4) for i in range(4)]), None
        return jax.lax.scan(body, h, None, length=3)[0]

    ring = shard_map(inner, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"), check_vma=False)

    def f(x, w):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return ring(x @ w.T)

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("expert")))
    w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    text = jax.jit(f).lower(x, w).compile().as_text()
    got = comm_bytes_by_axis(text, SIZES)
    assert got["fsdp"] == {"all-gather": {"count": 1, "bytes": 16 * 32 * 4}}, got
    assert got["expert"]["all-reduce"] == {"count": 3, "bytes": 3 * 4 * 16 * 4}, got
    assert got["expert"]["collective-permute"] == {"count": 3, "bytes": 3 * 4 * 16 * 4}, got
    assert set(got) == {"fsdp", "expert"}
