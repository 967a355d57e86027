"""rljax.models: forward semantics, padding, sequence parallelism, mesh invariance, KV cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import models
from rljax import sharding as sh

TINY = models.get_config("tiny")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tokens_for(config, b, t, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, config.vocab_size, dtype=jnp.int32)


# One jitted entry point for the tests (the graphdef and mesh are static): eager op-by-op
# dispatch on 8 fake devices is far slower than compiling once.
_forward = jax.jit(models.forward, static_argnums=0, static_argnames=("mesh",))
_logits = jax.jit(lambda gd, p, t, m: models.compute_logits(p, models.forward(gd, p, t, mask=m)), static_argnums=0)


def logits_of(graphdef, params, toks, mask=None):
    return _logits(graphdef, params, toks, jnp.ones(toks.shape, bool) if mask is None else mask)


@pytest.fixture(scope="module")
def tiny():
    graphdef, params = models.init_params(TINY, seed=0)
    return graphdef, params


# --------------------------------------------------------------------------- config / structure


def test_presets_have_the_published_parameter_counts():
    counts = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "llama-3.2-1b": 1_235_814_400}
    for name, expected in counts.items():
        config = models.get_config(name)
        _, shapes = models.abstract_params(config)
        assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) == expected == config.num_params()


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(num_heads=3), "multiple of num_kv_heads"),
        (dict(dtype="float16"), "ModelConfig.dtype"),
        (dict(architecture="gpt2"), "ModelConfig.architecture"),
        (dict(num_layers=0), "ModelConfig.num_layers"),
        (dict(head_dim=7), "positive even"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "not supported"),
    ],
)
def test_config_errors(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        TINY.replace(**changes)
    with pytest.raises(ValueError, match="unknown model preset"):
        models.get_config("gpt-5")


def test_split_merge_roundtrip_and_logical_axes():
    model = models.create_model(TINY, seed=3)
    graphdef, params = models.split(model)
    assert isinstance(params, dict) and set(params) == {"embed", "layers", "final_norm", "lm_head"}
    axes = models.param_logical_axes(TINY)
    assert axes["layers"]["attn"]["q_proj"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["mlp"]["down_proj"] == ("layers", "mlp", "embed")
    assert params["layers"]["attn"]["q_proj"].shape == (TINY.num_layers, TINY.hidden_size, TINY.num_heads, TINY.head_dim)
    # layers are initialised independently
    assert not np.allclose(params["layers"]["mlp"]["up_proj"][0], params["layers"]["mlp"]["up_proj"][1])
    assert axes["embed"] == ("vocab", "embed") and axes["lm_head"] == ("embed", "vocab")
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(params)
    again = models.split(models.merge(graphdef, params))[1]
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_init_params_independent_of_mesh(devices, tiny):
    _, params = tiny
    mesh = sh.make_mesh("dp2,tp2,sp2")
    _, sharded = models.init_params(TINY, seed=0, mesh=mesh)
    layer = sharded["layers"]  # stacked: leading [L] axis, replicated
    # Megatron layout: heads, MLP hidden and vocab on tp; norms replicated
    assert layer["attn"]["q_proj"].sharding.spec == P(None, None, "tp")
    assert layer["attn"]["k_proj"].sharding.spec == P(None, None, "tp")
    assert layer["attn"]["q_bias"].sharding.spec == P(None, "tp")
    assert layer["attn"]["o_proj"].sharding.spec == P(None, "tp")
    assert layer["mlp"]["gate_proj"].sharding.spec == P(None, None, "tp")
    assert layer["mlp"]["down_proj"].sharding.spec == P(None, "tp")
    assert layer["attn_norm"]["scale"].sharding.spec == P()
    assert sharded["embed"].sharding.spec == P("tp")
    assert sharded["lm_head"].sharding.spec == P(None, "tp")
    assert layer["mlp"]["up_proj"].addressable_shards[0].data.shape == (TINY.num_layers, TINY.hidden_size, TINY.intermediate_size // 2)
    jax.tree.map(np.testing.assert_array_equal, sharded, params)


def test_forward_shapes_and_unembedding(tiny):
    graphdef, params = tiny
    toks = tokens_for(TINY, 2, 8)
    hidden = models.forward(graphdef, params, toks)
    assert hidden.shape == (2, 8, TINY.hidden_size) and hidden.dtype == jnp.float32
    assert models.unembedding(params).shape == (TINY.hidden_size, TINY.vocab_size)
    logits = models.compute_logits(params, hidden)
    assert logits.shape == (2, 8, TINY.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, hidden @ params["lm_head"], rtol=1e-6, atol=1e-6)
    # final hidden states are RMS-normalised (scale 1 at init; eps=1e-6 against mean squares ~1e-3)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(hidden**2, -1)), 1.0, rtol=1e-2)


def test_tied_embeddings_unembed_is_embedding_transpose():
    config = TINY.replace(tie_embeddings=True)
    graphdef, params = models.init_params(config, seed=1)
    assert "lm_head" not in params
    np.testing.assert_array_equal(models.unembedding(params), params["embed"].T)
    hidden = _forward(graphdef, params, tokens_for(config, 1, 4))
    np.testing.assert_allclose(models.compute_logits(params, hidden), hidden @ params["embed"].T, rtol=1e-6, atol=1e-6)


def test_causality(tiny):
    graphdef, params = tiny
    toks = tokens_for(TINY, 1, 12)
    changed = toks.at[0, 7:].set((toks[0, 7:] + 1) % TINY.vocab_size)
    a = _forward(graphdef, params, toks)
    b = _forward(graphdef, params, changed)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert not np.allclose(a[:, 7:], b[:, 7:])


def test_left_padded_equals_unpadded(tiny):
    graphdef, params = tiny
    lengths = [9, 12, 1]
    t = 12
    rows = [tokens_for(TINY, 1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    toks = jnp.stack([jnp.pad(r, (t - len(r), 0), constant_values=7) for r in rows])
    mask = jnp.arange(t)[None, :] >= (t - jnp.array(lengths))[:, None]
    padded = logits_of(graphdef, params, toks, mask)
    for i, r in enumerate(rows):
        alone = logits_of(graphdef, params, r[None])[0]  # unpadded
        np.testing.assert_allclose(padded[i, t - len(r):], alone, rtol=1e-5, atol=1e-5)
    # right padding too: the real tokens never see the padding
    toks_r = jnp.stack([jnp.pad(r, (0, t - len(r)), constant_values=7) for r in rows])
    mask_r = jnp.arange(t)[None, :] < jnp.array(lengths)[:, None]
    right = logits_of(graphdef, params, toks_r, mask_r)
    for i, r in enumerate(rows):
        np.testing.assert_allclose(right[i, : len(r)], padded[i, t - len(r):], rtol=1e-5, atol=1e-5)


def test_explicit_positions_are_used(tiny):
    graphdef, params = tiny
    toks = tokens_for(TINY, 1, 6)
    base = _forward(graphdef, params, toks)
    shifted = _forward(graphdef, params, toks, positions=jnp.arange(6)[None] + 5)
    assert not np.allclose(base, shifted)
    same = _forward(graphdef, params, toks, positions=jnp.arange(6)[None])
    np.testing.assert_array_equal(base, same)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(tokens=jnp.zeros((2, 4))), "tokens must be an integer array of rank 2"),
        (dict(tokens=jnp.zeros((4,), jnp.int32)), "tokens must be an integer array of rank 2"),
        (dict(mask=jnp.ones((2, 3), bool)), "mask must have the shape of tokens"),
        (dict(positions=jnp.ones((1, 4), jnp.int32)), "positions must have the shape of tokens"),
    ],
)
def test_forward_bad_inputs(tiny, kwargs, fragment):
    graphdef, params = tiny
    args = dict(tokens=jnp.zeros((2, 4), jnp.int32)) | kwargs
    toks = args.pop("tokens")
    with pytest.raises(ValueError, match=fragment):
        models.forward(graphdef, params, toks, **args)


def test_bfloat16_params_and_compute():
    config = TINY.replace(dtype="bfloat16", param_dtype=jnp.bfloat16)
    graphdef, params = models.init_params(config, seed=0)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    hidden = _forward(graphdef, params, tokens_for(config, 2, 8))
    assert hidden.dtype == jnp.bfloat16
    ref_graphdef, _ = models.abstract_params(TINY)
    ref = _forward(ref_graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params), tokens_for(config, 2, 8))
    assert rel_err(hidden.astype(jnp.float32), ref) < 5e-2


@pytest.mark.parametrize("variant", [dict(remat=True), dict(scan_layers=False),
                                     pytest.param(dict(remat=True, remat_policy="minimal"), marks=pytest.mark.slow)],
                         ids=["remat", "unrolled", "remat-minimal"])
def test_layer_variants_same_values_and_gradients(tiny, variant):
    """Rematerialised and unrolled layers compute what the scanned default does."""
    graphdef, params = tiny
    other, _ = models.abstract_params(TINY.replace(**variant))
    toks = tokens_for(TINY, 2, 8)

    def loss(gd):
        return lambda p: jnp.mean(models.compute_logits(p, models.forward(gd, p, toks)) ** 2)

    v0, g0 = jax.jit(jax.value_and_grad(loss(graphdef)))(params)
    v1, g1 = jax.jit(jax.value_and_grad(loss(other)))(params)
    assert rel_err(v1, v0) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g0)


def test_flattened_token_dots_equal_einsums(tiny, monkeypatch):
    """The projections as 2-D dots over flattened tokens (single device, the default) give the
    einsum's values and gradients; dense() contracts one axis (q/k/v, MLP) or two (o_proj)."""
    from rljax.models import transformer

    x = jax.random.normal(jax.random.key(1), (2, 3, 4, 5))
    w = jax.random.normal(jax.random.key(2), (4, 5, 6))
    np.testing.assert_allclose(transformer.dense(x, w, None, 2), jnp.einsum("btnd,ndh->bth", x, w), rtol=1e-5)
    np.testing.assert_allclose(transformer.dense(x[..., 0], w[:, 0], None), jnp.einsum("btn,nh->bth", x[..., 0], w[:, 0]),
                               rtol=1e-5)
    graphdef, params = tiny
    toks = tokens_for(TINY, 2, 8)

    def value_and_grad():
        loss = lambda p: jnp.mean(models.compute_logits(p, models.forward(graphdef, p, toks)) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))(params)

    v0, g0 = value_and_grad()
    monkeypatch.setattr(transformer, "FLATTEN_TOKEN_DOTS", False)
    v1, g1 = value_and_grad()
    assert rel_err(v0, v1) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_rope_llama3_scaling_changes_only_long_wavelengths():
    from rljax.models.transformer import rope_inv_freq

    base = TINY.replace(head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * np.pi / f0
    np.testing.assert_array_equal(f1[wavelen < 64 / 4], f0[wavelen < 64 / 4])
    np.testing.assert_allclose(f1[wavelen > 64], f0[wavelen > 64] / 8.0, rtol=1e-6)
    assert np.all(f1 <= f0)


# --------------------------------------------------------------------------- sequence parallel


@pytest.mark.parametrize(
    "spec, n, num_kv_heads",
    [
        ("sp8", 4, 2),
        ("dp2,tp2,sp2", 4, 1),  # kv heads repeated to split over tp
        ("tp4,sp2", 6, 2),  # heads do not divide tp: replicated over tp
        pytest.param("dp2,tp2,sp2", 4, 4, marks=pytest.mark.slow),
        pytest.param("dp2,tp2,sp2", 4, 2, marks=pytest.mark.slow),
        pytest.param("tp2,sp4", 4, 2, marks=pytest.mark.slow),
        pytest.param("dp4,sp2", 4, 1, marks=pytest.mark.slow),
    ],
)
def test_sequence_parallel_attention_equals_dense(spec, n, num_kv_heads, devices):
    mesh = sh.make_mesh(spec)
    b, t, d = 4, 16, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, n, d))
    k = jax.random.normal(ks[1], (b, t, num_kv_heads, d))
    v = jax.random.normal(ks[2], (b, t, num_kv_heads, d))
    # left padding, right padding, none, and a hole in the middle
    lengths = jnp.array([16, 11, 3, 16])
    valid = jnp.arange(t)[None, :] >= (t - lengths)[:, None]
    valid = valid.at[1].set(jnp.arange(t) < 11).at[3, 5:9].set(False)
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    dense = models.dense_attention(q, k, v, idx, idx, valid)
    sp = jax.jit(lambda q, k, v, m: models.sequence_parallel_attention(q, k, v, m, mesh))(q, k, v, valid)
    assert rel_err(sp, dense) < 1e-6
    # gradients flow through the all-gathers identically
    g_dense = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(models.dense_attention(q, k, v, idx, idx, valid))), (0, 1, 2)))(q, k, v)
    g_sp = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(models.sequence_parallel_attention(q, k, v, valid, mesh))), (0, 1, 2)))(q, k, v)
    for a, c in zip(g_sp, g_dense):
        assert rel_err(a, c) < 1e-5


@pytest.mark.parametrize("block", [pytest.param(4, marks=pytest.mark.slow), 7, 64])
def test_blockwise_attention_equals_dense(block):
    b, tq, tk, n, kh, d = 3, 9, 21, 4, 2, 8
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (b, tq, n, d))
    k = jax.random.normal(ks[1], (b, tk, kh, d))
    v = jax.random.normal(ks[2], (b, tk, kh, d))
    # queries are the last tq tokens (as on an sp shard); left padding of 0, 5 and 15 keys,
    # so row 2 has query rows that see no key at all
    q_index = jnp.broadcast_to(jnp.arange(tk - tq, tk), (b, tq)) - jnp.array([[0], [0], [9]])
    k_index = jnp.broadcast_to(jnp.arange(tk), (b, tk))
    k_valid = k_index >= jnp.array([[0], [5], [15]])
    dense = lambda q, k, v: models.dense_attention(q, k, v, q_index, k_index, k_valid)
    assert rel_err(jax.jit(dense)(q, k, v), models.attention(q, k, v, q_index, k_index, k_valid, block_size=None)) == 0
    blockwise = lambda q, k, v: models.blockwise_attention(q, k, v, q_index, k_index, k_valid, block_size=block)
    assert rel_err(jax.jit(blockwise)(q, k, v), dense(q, k, v)) < 1e-6
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * jnp.arange(d))
    g_dense = jax.jit(jax.grad(loss(dense), (0, 1, 2)))(q, k, v)
    g_block = jax.jit(jax.grad(loss(blockwise), (0, 1, 2)))(q, k, v)
    for a, c in zip(g_block, g_dense):
        assert rel_err(a, c) < 1e-5
    with pytest.raises(ValueError, match="block_size must be positive"):
        models.blockwise_attention(q, k, v, q_index, k_index, k_valid, block_size=0)


def test_segment_ids_keep_attention_inside_each_segment(devices):
    """Two sequences packed in one row attend as if each were alone (dense, blockwise, sp)."""
    n, kh, d = 4, 2, 8
    ks = jax.random.split(jax.random.key(2), 3)
    q, k, v = (jax.random.normal(kk, (2, 16, h, d)) for kk, h in zip(ks, (n, kh, kh)))
    seg = jnp.array([[1] * 5 + [2] * 9 + [0] * 2, [1] * 16])  # row 0: lengths 5 and 9, 2 padding
    valid = seg > 0
    idx = jnp.broadcast_to(jnp.arange(16), (2, 16))
    dense_attention = jax.jit(models.dense_attention)  # one compile per shape instead of one per op
    packed = dense_attention(q, k, v, idx, idx, valid, seg, seg)
    for lo, hi in ((0, 5), (5, 14)):  # each segment alone, from index 0
        sl = lambda x: x[:1, lo:hi]
        i = jnp.arange(hi - lo)[None]
        alone = dense_attention(sl(q), sl(k), sl(v), i, i, jnp.ones((1, hi - lo), bool))
        assert rel_err(packed[:1, lo:hi], alone) < 1e-6
    assert rel_err(packed[1:], dense_attention(q, k, v, idx, idx, valid)[1:]) < 1e-6
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * valid[..., None, None])
    dense = lambda q, k, v: models.dense_attention(q, k, v, idx, idx, valid, seg, seg)
    block = lambda q, k, v: models.blockwise_attention(q, k, v, idx, idx, valid, seg, seg, block_size=3)
    assert rel_err(jax.jit(block)(q, k, v), packed) < 1e-6
    for a, c in zip(jax.jit(jax.grad(loss(block), (0, 1, 2)))(q, k, v), jax.jit(jax.grad(loss(dense), (0, 1, 2)))(q, k, v)):
        assert rel_err(a, c) < 1e-5
    mesh = sh.make_mesh("dp2,tp2,sp2")
    sp = jax.jit(lambda q, k, v: models.sequence_parallel_attention(q, k, v, valid, mesh, segment_ids=seg))(q, k, v)
    assert rel_err(sp, packed) < 1e-6
    with pytest.raises(ValueError, match="pass both q_segment and k_segment"):
        models.attention(q, k, v, idx, idx, valid, seg, None, block_size=None)


def test_blockwise_attention_in_the_model_and_under_sp(tiny, devices):
    graphdef, params = tiny
    blocked, _ = models.abstract_params(TINY.replace(attn_block_size=8))
    dense, _ = models.abstract_params(TINY.replace(attn_block_size=None))
    toks = tokens_for(TINY, 4, 24, seed=9)
    mask = jnp.arange(24)[None, :] >= jnp.array([[0], [3], [11], [20]])
    mesh = sh.make_mesh("dp2,tp2,sp2")  # 12 local queries against 24 gathered keys in blocks of 8

    def loss(gd, mesh=None):
        return lambda p: jnp.sum(models.compute_logits(p, models.forward(gd, p, toks, mask=mask, mesh=mesh)) ** 2 * mask[..., None])

    ref_v, ref_g = jax.jit(jax.value_and_grad(loss(dense)))(params)
    # blockwise (local queries against the gathered keys, in blocks) on a mesh == dense on one device
    v, g = jax.jit(jax.value_and_grad(loss(blocked, mesh)))(sh.reshard(params, models.param_shardings(TINY, mesh)))
    assert rel_err(v, ref_v) < 1e-5
    assert max(jax.tree.leaves(jax.tree.map(rel_err, g, ref_g))) < 1e-5


def test_sequence_parallel_attention_is_a_shard_map(devices):
    mesh = sh.make_mesh("dp2,tp2,sp2")
    q = jnp.zeros((2, 8, 4, 8))
    text = jax.jit(lambda q: models.sequence_parallel_attention(q, q, q, jnp.ones((2, 8), bool), mesh)).lower(q).as_text()
    assert "all_gather" in text or "all-gather" in text


# --------------------------------------------------------------------------- mesh invariance

# dp8 and dp2,tp2,sp2 in the default run; the other layouts with the slow tests.
MESHES = ["dp8", "dp2,tp2,sp2", *(pytest.param(m, marks=pytest.mark.slow) for m in ("tp2,sp4", "dp4,sp2", "tp4,dp2"))]


@pytest.fixture(scope="module")
def single_device_reference(tiny):
    graphdef, params = tiny
    toks = tokens_for(TINY, 8, 16, seed=5)
    lengths = jnp.array([16, 12, 9, 16, 3, 16, 14, 7])
    mask = jnp.arange(16)[None, :] >= (16 - lengths)[:, None]  # left-padded
    target = jnp.roll(toks, -1, axis=1)

    def run(params, toks, mask, mesh):
        hidden = models.forward(graphdef, params, toks, mask=mask, mesh=mesh)
        logits = models.compute_logits(params, hidden)
        return hidden, logits

    def loss(params, toks, mask, mesh):
        _, logits = run(params, toks, mask, mesh)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, target[..., None], -1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    ref = jax.jit(lambda p: run(p, toks, mask, None))(params)
    ref_grad = jax.jit(jax.grad(lambda p: loss(p, toks, mask, None)))(params)
    return dict(toks=toks, mask=mask, run=run, loss=loss, ref=ref, ref_grad=ref_grad)


@pytest.mark.parametrize("spec", MESHES)
def test_mesh_invariance(spec, tiny, single_device_reference, devices):
    graphdef, params = tiny
    r = single_device_reference
    mesh = sh.make_mesh(spec)
    shardings = models.param_shardings(TINY, mesh)
    params_s = sh.reshard(params, shardings)
    batch = sh.reshard({"toks": r["toks"], "mask": r["mask"]}, sh.batch_shardings({"toks": r["toks"], "mask": r["mask"]}, mesh))
    fwd = jax.jit(lambda p, b: r["run"](p, b["toks"], b["mask"], mesh))
    hidden, logits = fwd(params_s, batch)
    grad = jax.jit(jax.grad(lambda p, b: r["loss"](p, b["toks"], b["mask"], mesh)), out_shardings=shardings)(params_s, batch)
    assert hidden.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "sp")), 3)
    assert rel_err(hidden, r["ref"][0]) <= 1e-5
    assert rel_err(logits, r["ref"][1]) <= 1e-5
    errs = jax.tree.map(rel_err, grad, r["ref_grad"])
    worst = max(jax.tree.leaves(errs))
    assert worst <= 1e-5, errs


# --------------------------------------------------------------------------- KV cache


def _greedy_reference(graphdef, params, prompts, steps):
    """Greedy decoding by recomputing the full forward over the whole sequence every step.

    Sequences are left-aligned in a fixed ``[B, P+steps]`` buffer with the tail masked as
    padding, so one compiled forward serves every step (causality makes
    the tail irrelevant; test_left_padded_equals_unpadded checks padding invariance).
    """
    b, total = len(prompts), max(len(p) for p in prompts) + steps
    buf = np.zeros((b, total), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = np.asarray(p)
    out, seen = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        mask = np.arange(total)[None, :] < lens[:, None]
        logits = logits_of(graphdef, params, jnp.asarray(buf), jnp.asarray(mask))
        last = np.asarray(logits)[np.arange(b), lens - 1]
        for i in range(b):
            nxt = int(np.argmax(last[i]))
            out[i].append(nxt)
            seen[i].append(last[i])
            buf[i, lens[i]] = nxt
        lens = lens + 1
    return out, seen


def test_live_decode_attention_equals_dense_over_the_whole_cache():
    """Blocks past the longest live slot are skipped; the last block may overlap (M % block != 0)."""
    layers, s, m, n, kh, d, tn = 2, 4, 21, 4, 2, 8, 2
    ks = jax.random.split(jax.random.key(3), 3)
    ck = jax.random.normal(ks[0], (layers, s, m, kh, d))
    cv = jax.random.normal(ks[1], (layers, s, m, kh, d))
    q = jax.random.normal(ks[2], (s, tn, n, d))
    k_index = jnp.broadcast_to(jnp.arange(m), (s, m))
    dense_attention = jax.jit(models.dense_attention)
    # one compile per block size (the index is traced), not one per index and block size
    lives = [jax.jit(functools.partial(models.live_decode_attention, layer=1, block_size=b)) for b in (4, 5, 256)]
    for index in ([0, 3, 9, 1], [15, 2, 19, 7], [4, 4, 4, 4]):
        q_index = jnp.array(index)[:, None] + jnp.arange(tn)
        dense = dense_attention(q, ck[1], cv[1], q_index, k_index, jnp.ones((s, m), bool))
        for live in lives:
            assert rel_err(live(q, ck, cv, q_index=q_index), dense) < 1e-6
    # only the slots marked live set the bound; theirs stay exact
    mask = jnp.array([True, False, True, False])
    q_index = jnp.array([[3], [20], [6], [20]])
    out = models.live_decode_attention(q[:, :1], ck, cv, 0, q_index, live=mask, block_size=4)
    dense = models.dense_attention(q[:, :1], ck[0], cv[0], q_index, k_index, jnp.ones((s, m), bool))
    assert rel_err(out[mask], dense[mask]) < 1e-6 and bool(jnp.all(jnp.isfinite(out)))


def test_slot_cache_attention_equals_dense_whole_cache_or_live_blocks():
    """The engine's per-layer ``[S,K,M,D]`` cache: read whole in place, or (live blocks under half
    the cache) block by block, the last keys in blocks of ``block_size // 8``. Both equal dense
    attention."""
    s, m, n, kh, d, tn = 4, 21, 4, 2, 8, 2
    ks = jax.random.split(jax.random.key(4), 3)
    ck = jax.random.normal(ks[0], (s, kh, m, d))
    cv = jax.random.normal(ks[1], (s, kh, m, d))
    q = jax.random.normal(ks[2], (s, tn, n, d))
    k_index = jnp.broadcast_to(jnp.arange(m), (s, m))
    attend = jax.jit(models.slot_cache_attention, static_argnames="block_size")
    sm = lambda c: jnp.swapaxes(c, 1, 2)  # the [S,M,K,D] layout dense_attention takes
    # [0,3,1,2] with blocks of 4: 2 live blocks (8 < 21 / 2) are read; the others read everything
    for index in ([0, 3, 9, 1], [15, 2, 19, 7], [0, 3, 1, 2], [17, 18, 19, 17]):
        q_index = jnp.array(index)[:, None] + jnp.arange(tn)
        dense = models.dense_attention(q, sm(ck), sm(cv), q_index, k_index, jnp.ones((s, m), bool))
        for block in (2, 4, 5, 256):
            assert rel_err(attend(q, ck, cv, q_index, block_size=block), dense) < 1e-6, (index, block)
    # a longer cache, blocks of 16 then tail blocks of 2; the live keys end on a tail block's end,
    # on a block boundary, inside the first block, inside a tail block
    m = 70
    ck = jax.random.normal(ks[0], (s, kh, m, d))
    cv = jax.random.normal(ks[1], (s, kh, m, d))
    k_index = jnp.broadcast_to(jnp.arange(m), (s, m))
    for index in ([0, 18, 9, 4], [30, 2, 14, 7], [5, 12, 1, 3], [30, 31, 20, 0]):
        q_index = jnp.array(index)[:, None] + jnp.arange(tn)
        dense = models.dense_attention(q, sm(ck), sm(cv), q_index, k_index, jnp.ones((s, m), bool))
        assert rel_err(attend(q, ck, cv, q_index, block_size=16), dense) < 1e-6, index
    mask = jnp.array([True, False, True, False])  # only live slots bound the blocks read
    q_index = jnp.array([[3], [60], [2], [60]])
    out = attend(q[:, :1], ck, cv, q_index, live=mask, block_size=4)
    dense = models.dense_attention(q[:, :1], sm(ck), sm(cv), q_index, k_index, jnp.ones((s, m), bool))
    assert rel_err(out[mask], dense[mask]) < 1e-6 and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("mesh_spec", [None, pytest.param("dp2,tp2,sp2", marks=pytest.mark.slow)])
def test_greedy_decode_with_cache_equals_full_recompute(tiny, mesh_spec, devices):
    graphdef, params = tiny
    mesh = None if mesh_spec is None else sh.make_mesh(mesh_spec)
    if mesh is not None:
        params = sh.reshard(params, models.param_shardings(TINY, mesh))
    lengths = [5, 1, 8, 3]
    p_max, steps, num_slots, max_len = 8, 6, 6, 16
    prompts = [tokens_for(TINY, 1, n, seed=20 + i)[0] for i, n in enumerate(lengths)]
    toks = jnp.stack([jnp.pad(p, (0, p_max - len(p))) for p in prompts])  # right-padded
    mask = jnp.arange(p_max)[None, :] < jnp.array(lengths)[:, None]
    slots = jnp.array([4, 0, 2, 5])  # prompts land in arbitrary slots; slots 1 and 3 idle

    cache = models.init_kv_cache(TINY, num_slots, max_len, mesh=mesh)
    # stale junk from a previous occupant must not leak into the new sequences
    cache = models.KVCache(k=cache.k + 3.0, v=cache.v - 2.0)
    hidden, kv = jax.jit(lambda p, t, m: models.prefill(graphdef, p, t, mask=m, mesh=mesh))(params, toks, mask)
    assert kv.k.shape == (TINY.num_layers, 4, p_max, TINY.num_kv_heads, TINY.head_dim)
    cache = jax.jit(models.insert_kv)(cache, kv, slots)
    last = hidden[jnp.arange(4), jnp.array(lengths) - 1]
    first = jnp.argmax(models.compute_logits(params, last), -1)

    step = jax.jit(lambda p, c, t, i: models.decode(graphdef, p, c, t, cache_index=i, mesh=mesh), donate_argnums=1)
    cur = jnp.zeros((num_slots,), jnp.int32).at[slots].set(first)
    index = jnp.zeros((num_slots,), jnp.int32).at[slots].set(jnp.array(lengths))
    generated = [[int(f)] for f in first]
    decode_logits = [[] for _ in lengths]
    for _ in range(steps - 1):
        h, cache = step(params, cache, cur, index)
        logits = models.compute_logits(params, h)
        nxt = jnp.argmax(logits, -1)
        for b, s in enumerate(np.asarray(slots)):
            generated[b].append(int(nxt[s]))
            decode_logits[b].append(logits[s])
        cur, index = nxt, index + 1
    if mesh is not None:
        assert cache.k.sharding.spec == sh.kv_cache_spec(cache.k.shape, mesh)

    ref_tokens, ref_logits = _greedy_reference(graphdef, params, prompts, steps)
    for b in range(len(prompts)):
        assert generated[b] == ref_tokens[b], (b, generated[b], ref_tokens[b])
        for got, want in zip(decode_logits[b], ref_logits[b][1:]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_decode_chunk_equals_prefill(tiny):
    graphdef, params = tiny
    toks = tokens_for(TINY, 2, 10, seed=3)
    full = _forward(graphdef, params, toks)
    cache = models.init_kv_cache(TINY, 2, 12)
    _, kv = jax.jit(models.prefill, static_argnums=0)(graphdef, params, toks[:, :4])
    cache = models.insert_kv(cache, kv, jnp.array([0, 1]))
    decode = jax.jit(models.decode, static_argnums=0)
    h, cache = decode(graphdef, params, cache, toks[:, 4:], cache_index=jnp.array([4, 4]))
    assert h.shape == (2, 6, TINY.hidden_size)
    np.testing.assert_allclose(h, full[:, 4:], rtol=1e-5, atol=1e-5)


def test_decode_bad_inputs(tiny):
    graphdef, params = tiny
    cache = models.init_kv_cache(TINY, 3, 8)
    with pytest.raises(ValueError, match="cache_index must have shape"):
        models.decode(graphdef, params, cache, jnp.zeros((3,), jnp.int32), cache_index=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="tokens have 2 slots but the cache has 3"):
        models.decode(graphdef, params, cache, jnp.zeros((2,), jnp.int32), cache_index=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="exceeds the cache max_len"):
        _, kv = models.prefill(graphdef, params, jnp.zeros((1, 9), jnp.int32))
        models.insert_kv(cache, kv, jnp.array([0]))
    with pytest.raises(ValueError, match="positive num_slots"):
        models.init_kv_cache(TINY, 0, 8)


def test_models_import_no_torch_or_tensorflow():
    import subprocess
    import sys

    code = "import sys, rljax.models; bad=[m for m in sys.modules if m.split('.')[0] in ('torch','transformers','tensorflow','jetstream','safetensors')]; print(bad); sys.exit(bool(bad))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
