"""rljax.sharding: mesh specs, mesh layout, logical rules, specs, topology, reshard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rljax import sharding as sh


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dp8", {"dp": 8, "fsdp": 1, "tp": 1, "sp": 1}),
        ("tp8", {"dp": 1, "fsdp": 1, "tp": 8, "sp": 1}),
        ("dp2,tp2,sp2", {"dp": 2, "fsdp": 1, "tp": 2, "sp": 2}),
        ("sp4,dp2", {"dp": 2, "fsdp": 1, "tp": 1, "sp": 4}),
        (" tp4 , dp2 ", {"dp": 2, "fsdp": 1, "tp": 4, "sp": 1}),
        ({"tp": 2, "sp": 4}, {"dp": 1, "fsdp": 1, "tp": 2, "sp": 4}),
        ("fsdp8", {"dp": 1, "fsdp": 8, "tp": 1, "sp": 1}),
        ("dp2,fsdp4", {"dp": 2, "fsdp": 4, "tp": 1, "sp": 1}),
        ("tp2,FSDP4", {"dp": 1, "fsdp": 4, "tp": 2, "sp": 1}),
    ],
)
def test_parse_mesh(spec, expected, devices):
    got = sh.parse_mesh(spec)
    assert got == expected
    assert list(got) == ["dp", "fsdp", "tp", "sp"]


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("xp2", "unknown axis 'xp'"),
        ("dp2,xp4", "unknown axis 'xp'"),
        ("dp0", "size of 'dp' is 0"),
        ("tp-2", "size of 'tp' is -2"),
        ("dp2,dp4", "axis 'dp' is repeated"),
        ("fsdp2,fsdp4", "axis 'fsdp' is repeated"),
        ("fsdp0", "size of 'fsdp' is 0"),
        ("fsd8", "unknown axis 'fsd'; accepted axes are dp, fsdp, tp, sp"),
        ("dp2,fsdp2", "mesh dp2,fsdp2 needs 4 devices, found 8 (cpu)"),
        ("dpx", "not a number"),
        ("sp2.5", "not a number"),
        ("dp", "has no size"),
        ("", "empty"),
        ("dp2,tp2", "mesh dp2,tp2 needs 4 devices, found 8 (cpu)"),
        ("dp4,tp4", "needs 16 devices, found 8"),
    ],
)
def test_parse_mesh_errors(spec, fragment, devices):
    with pytest.raises(ValueError) as e:
        sh.parse_mesh(spec)
    msg = str(e.value)
    assert fragment in msg
    assert "\n" not in msg


def test_parse_mesh_device_count_argument():
    assert sh.parse_mesh("dp2,tp2", devices=4) == {"dp": 2, "fsdp": 1, "tp": 2, "sp": 1}
    with pytest.raises(ValueError, match="needs 4 devices, found 2"):
        sh.parse_mesh("dp2,tp2", devices=2)


@pytest.mark.parametrize("spec", ["dp8", "dp2,tp2,sp2", "tp2,sp4", "dp4,sp2", "tp4,dp2", "tp8", "fsdp8", "dp2,fsdp4",
                                  "fsdp4,tp2", "fsdp2,tp2,sp2"])
def test_make_mesh_names_sizes_and_tp_innermost(spec, devices):
    mesh = sh.make_mesh(spec)
    sizes = sh.parse_mesh(spec)
    # fsdp is an axis only where it splits something: other meshes are laid out as before it existed
    assert mesh.axis_names == (("dp", "fsdp", "tp", "sp") if sizes["fsdp"] > 1 else ("dp", "tp", "sp"))
    assert sh.mesh_sizes(mesh) == sizes
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # tp groups are runs of consecutive devices (the innermost physical axis), then sp, then fsdp, then dp.
    assert sorted(ids.flat) == list(range(8))
    expected = np.arange(8).reshape(sizes["dp"], sizes["fsdp"], sizes["sp"], sizes["tp"]).transpose(0, 1, 3, 2)
    expected = expected.reshape(mesh.devices.shape)  # without an fsdp split the (size-1) fsdp axis is not there
    np.testing.assert_array_equal(ids, expected)


def test_make_mesh_on_device_subset(devices):
    mesh = sh.make_mesh("dp2,tp2", devices=devices[:4])
    assert mesh.devices.size == 4
    with pytest.raises(ValueError, match=r"mesh dp8 needs 8 devices, found 4 \(cpu\)"):
        sh.make_mesh("dp8", devices=devices[:4])


@pytest.mark.parametrize("spec, actor_dp", [("dp8", 8), ("dp2,tp2,sp2", 2), ("tp2,sp4", 1), ("tp4,dp2", 2), ("fsdp8", 8),
                                            ("dp2,fsdp4", 8), ("fsdp4,tp2", 4)])
def test_topology(spec, actor_dp, devices):
    topo = sh.topology(sh.make_mesh(spec))
    assert topo["platform"] == "cpu"
    assert topo["process_count"] == 1
    assert topo["devices_per_process"] == 8
    assert topo["world_size"] == 8
    assert topo["mesh"] == sh.parse_mesh(spec)
    assert topo["actor_dp"] == actor_dp == sh.data_shards(sh.make_mesh(spec))
    assert topo["state_shards"] == sh.parse_mesh(spec)["fsdp"] and topo["batch_axes"] == ["dp", "fsdp"]
    import json

    json.dumps(topo)


def test_rules_table_maps_megatron_layout(devices):
    mesh = sh.make_mesh("dp2,tp2,sp2")
    spec = lambda axes, shape: sh.logical_to_spec(axes, mesh=mesh, shape=shape)
    assert spec(("embed", "heads", "head_dim"), (8, 4, 2)) == P(None, "tp")
    assert spec(("heads", "head_dim", "embed"), (4, 2, 8)) == P("tp")
    assert spec(("embed", "mlp"), (8, 16)) == P(None, "tp")
    assert spec(("mlp", "embed"), (16, 8)) == P("tp")
    assert spec(("vocab", "embed"), (32, 8)) == P("tp")
    assert spec(("embed", "vocab"), (8, 32)) == P(None, "tp")
    assert spec(("batch", "length", "embed"), (4, 8, 8)) == P("dp", "sp")
    # a size the axis does not divide is replicated (e.g. 3 kv heads on tp2)
    assert spec(("embed", "kv_heads", "head_dim"), (8, 3, 2)) == P()
    # without a mesh the table is applied as is
    assert sh.logical_to_spec(("batch", "length", "heads")) == P(("dp", "fsdp"), "sp", "tp")
    # Megatron-SP: the residual stream's sequence is split over sp and tp; a length that
    # only sp divides keeps sp (the longest dividing run of the axes), not nothing
    assert spec(("batch", "residual_length", "embed"), (4, 8, 8)) == P("dp", ("sp", "tp"))
    assert spec(("batch", "residual_length", "embed"), (4, 6, 8)) == P("dp", "sp")
    assert spec(("batch", "residual_length", "embed"), (4, 5, 8)) == P("dp")


def test_rules_are_the_only_place_parallelism_lives(devices):
    mesh = sh.make_mesh("dp2,tp2,sp2")
    fsdp_like = dict(sh.LOGICAL_AXIS_RULES) | {"embed": "dp", "batch": ("dp", "sp")}
    assert sh.logical_to_spec(("embed", "mlp"), rules=fsdp_like, mesh=mesh, shape=(8, 8)) == P("dp", "tp")
    assert sh.logical_to_spec(("batch", "length"), rules=fsdp_like, mesh=mesh, shape=(8, 8)) == P(("dp", "sp"))


def test_unknown_logical_axis_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown logical axis 'hedas'"):
        sh.logical_to_spec(("hedas",))
    with pytest.raises(ValueError, match="rank 2 but the array shape is"):
        sh.logical_to_spec(("batch", "length"), shape=(2, 3, 4))


def test_batch_and_kv_cache_specs(devices):
    mesh = sh.make_mesh("dp2,tp2,sp2")
    assert sh.batch_spec((8, 16), mesh) == P("dp", "sp")
    assert sh.batch_spec((8,), mesh) == P("dp")
    assert sh.batch_spec((8, 16, 3), mesh) == P("dp", "sp")
    assert sh.batch_spec((8, 15), mesh) == P("dp")  # odd length: sequence replicated
    assert sh.kv_cache_spec((2, 4, 32, 2, 8), mesh) == P(None, "dp", None, "tp")
    assert sh.kv_cache_spec() == P(None, ("dp", "fsdp"), None, "tp")  # the table as is, without a mesh
    batch = {"tokens": jnp.zeros((8, 16), jnp.int32), "rewards": jnp.zeros((8,))}
    shard = sh.batch_shardings(batch, mesh)
    assert shard["tokens"].spec == P("dp", "sp") and shard["rewards"].spec == P("dp")


def test_reshard_between_layouts(devices):
    learner = sh.make_mesh("dp2,tp2,sp2")
    sampler = sh.make_mesh("dp2,tp4")
    x = jnp.arange(64.0).reshape(8, 8)
    tree = {"w": jax.device_put(x, NamedSharding(learner, P(None, "tp"))), "b": jax.device_put(x[0], NamedSharding(learner, P()))}
    target = {"w": NamedSharding(sampler, P("tp")), "b": NamedSharding(sampler, P("tp"))}
    out = sh.reshard(tree, target)
    assert out["w"].sharding == target["w"] and out["b"].sharding == target["b"]
    np.testing.assert_array_equal(out["w"], x)
    np.testing.assert_array_equal(out["b"], x[0])
    # one sharding for every leaf
    one = sh.reshard(tree, NamedSharding(sampler, P()))
    assert all(l.sharding.spec == P() for l in jax.tree.leaves(one))
    # the shard each device holds has the target shape
    assert out["w"].addressable_shards[0].data.shape == (2, 8)


def test_reshard_inside_jit_is_a_constraint(devices):
    mesh = sh.make_mesh("dp8")
    target = NamedSharding(mesh, P("dp"))
    y = jax.jit(lambda t: sh.reshard(t, target))({"a": jnp.ones((8, 2))})
    assert y["a"].sharding.spec == P("dp")


def test_reshard_bad_targets(devices):
    mesh = sh.make_mesh("dp8")
    with pytest.raises(ValueError, match="reshard"):
        sh.reshard({"a": jnp.ones(2), "b": jnp.ones(2)}, {"a": NamedSharding(mesh, P())})
    with pytest.raises(ValueError, match="must be a jax.sharding.Sharding"):
        sh.reshard({"a": jnp.ones(2)}, {"a": "dp"})


def test_sharding_imports_no_other_rljax_package():
    import ast
    import pathlib

    root = pathlib.Path(sh.__file__).parent
    for file in root.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for n in names:
                    # rljax._meshspec is the dependency-free mesh-spec syntax shared with rljax.config.
                    assert not (n.startswith("rljax") and not n.startswith(("rljax.sharding", "rljax._meshspec"))), (file, n)
                    assert not n.startswith(("tensorflow", "jetstream", "torch")), (file, n)


def test_fsdp_shards_parameters_along_embed_and_the_batch_with_dp(devices):
    """The table's fsdp rows: a parameter's model dimension on fsdp (beside tp on heads / mlp /
    vocab), the batch on dp x fsdp, and an activation's embed left whole once the batch took
    fsdp; a mesh without an fsdp split has no fsdp axis, so dp8's specs name no fsdp."""
    spec = lambda m, axes, shape: sh.logical_to_spec(axes, mesh=sh.make_mesh(m), shape=shape)
    assert spec("fsdp8", ("layers", "embed", "heads", "head_dim"), (2, 64, 4, 8)) == P(None, "fsdp", "tp")
    assert spec("fsdp4,tp2", ("layers", "embed", "heads", "head_dim"), (2, 64, 4, 8)) == P(None, "fsdp", "tp")
    assert spec("fsdp4,tp2", ("vocab", "embed"), (32, 64)) == P("tp", "fsdp")
    assert spec("fsdp4,tp2", ("layers", "mlp", "embed"), (2, 16, 64)) == P(None, "tp", "fsdp")
    assert spec("dp2,fsdp4", ("batch", "length"), (8, 16)) == P(("dp", "fsdp"), "sp")
    assert spec("dp2,fsdp4", ("batch", "length", "embed"), (8, 16, 64)) == P(("dp", "fsdp"), "sp")
    assert spec("dp2,fsdp4", ("batch", "length", "embed"), (4, 16, 64)) == P("dp", "sp", "fsdp")  # 4 rows, 8 shards
    assert spec("dp2,fsdp4", ("cache_batch",), (8,)) == P(("dp", "fsdp"))
    assert spec("dp8", ("embed", "mlp"), (64, 16)) == P(None, "tp")
    assert spec("dp8", ("batch", "length"), (8, 16)) == P("dp", "sp")
    assert spec("fsdp8", ("embed", "mlp"), (12, 16)) == P(None, "tp")  # 12 does not divide by 8: replicated
    assert sh.mesh_batch_axes(sh.make_mesh("dp2,fsdp4")) == ("dp", "fsdp") and sh.mesh_batch_axes(sh.make_mesh("dp8")) == ("dp",)
    assert sh.mesh_batch_axes(sh.make_mesh("tp8")) == () and sh.data_shards(sh.make_mesh("fsdp4,tp2")) == 4


def test_fsdp_splits_params_and_optimizer_moments(devices):
    """Parameters placed by the table on fsdp8 hold an eighth per device, and AdamW's moments
    initialised from them inherit the layout (so the whole training state is split)."""
    import optax

    from rljax import models

    cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2)
    mesh = sh.make_mesh("fsdp8")
    shardings = models.param_shardings(cfg, mesh)
    _, shapes = models.abstract_params(cfg)
    params = jax.tree.map(lambda s, d: jax.device_put(jnp.ones(s.shape, s.dtype), d), shapes, shardings)
    opt = optax.adamw(1e-3).init(params)
    leaves = jax.tree.leaves(params) + jax.tree.leaves(opt)
    big = [x for x in leaves if x.ndim >= 2 and x.size >= 256]
    assert big
    for x in big:
        assert x.addressable_shards[0].data.size * 8 == x.size, (x.shape, x.sharding)
