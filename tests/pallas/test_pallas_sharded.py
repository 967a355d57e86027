"""rljax.pallas under jax.shard_map on the 8-device CPU mesh dp2,tp2,sp2: tokens split over
dp / sp, the vocabulary over tp; values and both gradients equal the single-device result."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from rljax.pallas import fused_logprob, fused_logprob_sharded

B, T, H, V = 4, 6, 16, 256  # per shard: 2 x 3 tokens, 128 vocab columns


def mesh_222(axis_type):
    return jax.make_mesh((2, 2, 2), ("dp", "tp", "sp"), axis_types=(axis_type,) * 3)


@pytest.fixture(scope="module")
def problem():
    k = jax.random.split(jax.random.key(11), 5)
    hidden = jax.random.normal(k[0], (B, T, H), jnp.float32)
    unembed = jax.random.normal(k[1], (H, V), jnp.float32) * 0.5
    # Targets in both vocab halves, including the first and the last column.
    targets = jax.random.randint(k[2], (B, T), 0, V).at[0, 0].set(0).at[3, 5].set(V - 1)
    targets = targets.at[1, 2].set(V // 2 - 1).at[2, 3].set(V // 2)
    g_logp = jax.random.normal(k[3], (B, T), jnp.float32)
    g_ent = jax.random.normal(k[4], (B, T), jnp.float32)
    return hidden, unembed, targets, g_logp, g_ent


def vjps(fn, problem):
    """{"both" | "logp" | "entropy": [logp, entropy, d_hidden, d_unembed]}, the three pullbacks
    (cotangents on both outputs, on logp only, on entropy only) in one compiled function."""
    hidden, unembed, targets, g_logp, g_ent = problem

    @jax.jit
    def go(hidden, unembed):
        (logp, ent), pullback = jax.vjp(lambda h, w: fn(h, w, targets), hidden, unembed)
        zero = jnp.zeros_like(g_logp)
        cts = {"both": (g_logp, g_ent), "logp": (g_logp, zero), "entropy": (zero, g_ent)}
        return {k: (logp, ent, *pullback(ct)) for k, ct in cts.items()}

    return jax.tree.map(np.asarray, go(hidden, unembed))


def assert_matches(got, want, atol=1e-5):
    for name, g, w in zip(("logp", "entropy", "d_hidden", "d_unembed"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=atol, rtol=0, err_msg=name)


@pytest.fixture(scope="module")
def single_device(problem):
    return vjps(functools.partial(fused_logprob, impl="naive"), problem)


SHARDED_IMPLS = [
    pytest.param("chunked", dict(block_t=2, block_v=48), id="chunked"),  # ragged in-shard tail
    # interpret-mode Pallas inside shard_map is slow here; test_sharded_entry_point runs it by default
    pytest.param("pallas", dict(block_t=8, block_v=128), id="pallas", marks=pytest.mark.slow),
    # pallas_gpu is not here: JAX's generic Pallas interpreter (the GPU kernels' interpret mode)
    # pads masked loads with a value not typed as varying, which shard_map's check_vma rejects
    # (jax 0.10.2: "Primitive pad requires varying manual axes to match").
]


# The axis type only changes how the wrapper lays out its inputs, not the per-shard code, so
# Explicit runs with one impl.
@pytest.mark.parametrize("impl,blocks,axis_type", [
    pytest.param(*SHARDED_IMPLS[0].values, AxisType.Auto, id="chunked-auto"),
    pytest.param(*SHARDED_IMPLS[0].values, AxisType.Explicit, id="chunked-explicit"),
    pytest.param(*SHARDED_IMPLS[1].values, AxisType.Auto, id="pallas-auto"),
])
def test_sharded_entry_point_equals_single_device(problem, single_device, axis_type, impl, blocks):
    mesh = mesh_222(axis_type)
    fn = functools.partial(fused_logprob_sharded, mesh=mesh, impl=impl, **blocks)
    got = vjps(fn, problem)
    for cotangents in ("both", "logp", "entropy"):
        assert_matches(got[cotangents], single_device[cotangents])


def test_sharded_output_layout(problem):
    hidden, unembed, targets, _, _ = problem
    mesh = mesh_222(AxisType.Explicit)
    logp, ent = fused_logprob_sharded(hidden, unembed, targets, mesh=mesh, impl="chunked")
    assert logp.shape == ent.shape == (B, T) and logp.dtype == jnp.float32
    assert logp.sharding.spec == P("dp", "sp")


def test_sharded_flat_tokens_and_naive_shard_local(problem, single_device):
    """[N, H] tokens split over dp and sp together; naive needs vocab_axis=None."""
    hidden, unembed, targets, g_logp, g_ent = problem
    flat = (hidden.reshape(B * T, H), unembed, targets.reshape(-1), g_logp.reshape(-1),
            g_ent.reshape(-1))
    want = [x.reshape(-1, *x.shape[2:]) if i in (0, 1, 2) else x
            for i, x in enumerate(single_device["both"])]
    mesh = mesh_222(AxisType.Auto)
    for kw in (dict(impl="chunked", block_v=48), dict(impl="naive", vocab_axis=None)):
        got = vjps(functools.partial(fused_logprob_sharded, mesh=mesh, **kw), flat)
        assert_matches(got["both"], want)


@pytest.mark.parametrize("impl,blocks", SHARDED_IMPLS)
def test_inside_user_shard_map(problem, single_device, impl, blocks):
    """A trainer that wraps its whole loss in shard_map calls fused_logprob on local shards:
    shard-local over dp / sp with a replicated unembed, or with vocab_axis="tp"."""
    mesh = mesh_222(AxisType.Auto)
    tok = P("dp", "sp")
    for w_spec, vocab_axis in ((P(), None), (P(None, "tp"), "tp")):
        def fn(h, w, y, w_spec=w_spec, vocab_axis=vocab_axis):
            local = functools.partial(fused_logprob, impl=impl, vocab_axis=vocab_axis, **blocks)
            return jax.shard_map(local, mesh=mesh, in_specs=(P("dp", "sp", None), w_spec, tok),
                                 out_specs=(tok, tok))(h, w, y)
        got = vjps(fn, problem)
        assert_matches(got["entropy"], single_device["entropy"])
        assert_matches(got["logp"], single_device["logp"])


@pytest.mark.parametrize("kwargs,message", [
    (dict(vocab_axis="mp"), "axis 'mp' is not in the mesh"),
    (dict(seq_axis="tp"), "repeat an axis"),
    (dict(impl="naive"), "impl='naive' does not split the vocabulary"),
    (dict(mesh="dp2"), "mesh must be a jax.sharding.Mesh"),
])
def test_sharded_bad_arguments(problem, kwargs, message):
    hidden, unembed, targets, _, _ = problem
    kwargs = {"mesh": mesh_222(AxisType.Auto), **kwargs}
    with pytest.raises(ValueError, match=message):
        fused_logprob_sharded(hidden, unembed, targets, **kwargs)


def test_sharded_indivisible_sizes(problem):
    hidden, unembed, targets, _, _ = problem
    mesh = mesh_222(AxisType.Auto)
    message = r"V=255 does not divide by the size 2 of mesh axes \('tp',\)"
    with pytest.raises(ValueError, match=message):
        fused_logprob_sharded(hidden, unembed[:, :255], targets, mesh=mesh)
    with pytest.raises(ValueError, match=r"T=5 does not divide"):
        fused_logprob_sharded(hidden[:, :5], unembed, targets[:, :5], mesh=mesh)


def test_sharded_bfloat16_inputs(problem):
    """bf16 hidden / unembed on dp2,tp2,sp2: gradients come back in bf16 and match the
    single-device naive ones to bf16 rounding."""
    hidden, unembed, targets, g_logp, g_ent = problem
    bf16 = (hidden.astype(jnp.bfloat16), unembed.astype(jnp.bfloat16), targets, g_logp, g_ent)
    want = vjps(functools.partial(fused_logprob, impl="naive"), bf16)["both"]
    fn = functools.partial(fused_logprob_sharded, mesh=mesh_222(AxisType.Auto), impl="chunked")
    got = vjps(fn, bf16)["both"]
    for name, g, w in zip(("logp", "entropy", "d_hidden", "d_unembed"), got, want):
        assert g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) <= 1e-2 * np.max(np.abs(w)), name


def test_vocab_axis_misuse_is_rejected(problem):
    """vocab_axis without an unembed split over it (outside shard_map, or under
    check_vma=False, where shard_map's transpose would silently halve d_unembed)."""
    hidden, unembed, targets, _, _ = problem
    with pytest.raises(ValueError, match="vocab_axis='tp' needs unembed split over that mesh axis"):
        fused_logprob(hidden, unembed, targets, vocab_axis="tp")
    mesh = mesh_222(AxisType.Auto)
    local = functools.partial(fused_logprob, impl="chunked", vocab_axis="tp")
    tok = P("dp", "sp")
    for w_spec, check_vma in ((P(None, "tp"), False), (P(), True)):
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P("dp", "sp", None), w_spec, tok),
                           out_specs=(tok, tok), check_vma=check_vma)
        with pytest.raises(ValueError, match="needs unembed split over that mesh axis"):
            fn(hidden, unembed, targets)
