"""rljax.pallas on one device: the chunked path and the Pallas kernels (TPU and GPU, interpret
mode) against the naive reference, values and both gradients, for each output's cotangent
separately."""

import functools
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rljax.pallas import MASK_VALUE, fused_logprob
from rljax.pallas import _api, _gpu, _tpu

# Pallas interpret-mode grids stay small: (ceil(N/16) x ceil(V/128)) = 3 x 3 steps here.
PALLAS_BLOCKS = dict(block_t=16, block_v=128)
# GPU (Triton) blocks are powers of two >= 16; H is contracted in chunks of up to 64.
GPU_BLOCKS = dict(block_t=16, block_v=128)
CHUNKED_BLOCKS = dict(block_t=16, block_v=96)


def make_problem(n, h, v, *, dtype=jnp.float32, seed=0, lead=None, logit_scale=1.0):
    """Random hidden / unembed / targets with targets at the first and the last vocab index."""
    k = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k[0], (n, h), jnp.float32)
    unembed = jax.random.normal(k[1], (h, v), jnp.float32) * (logit_scale / np.sqrt(h)) * 2.0
    targets = jax.random.randint(k[2], (n,), 0, v).at[0].set(0).at[n - 1].set(v - 1)
    g_logp = jax.random.normal(k[3], (n,), jnp.float32)
    g_ent = jax.random.normal(k[4], (n,), jnp.float32)
    if lead is not None:
        hidden = hidden.reshape(*lead, h)
        targets, g_logp, g_ent = (x.reshape(lead) for x in (targets, g_logp, g_ent))
    return hidden.astype(dtype), unembed.astype(dtype), targets, g_logp, g_ent


@functools.partial(jax.jit, static_argnames=("kw",))
def _vjp(hidden, unembed, targets, g_logp, g_ent, kw):
    fn = lambda h, w: fused_logprob(h, w, targets, **dict(kw))
    (logp, ent), pullback = jax.vjp(fn, hidden, unembed)
    d_hidden, d_unembed = pullback((g_logp, g_ent))
    return logp, ent, d_hidden, d_unembed


def run(problem, cotangents="both", **kw):
    """(logp, entropy, d_hidden, d_unembed) for cotangents on both outputs, only logp, or only
    entropy."""
    hidden, unembed, targets, g_logp, g_ent = problem
    if cotangents == "logp":
        g_ent = jnp.zeros_like(g_ent)
    elif cotangents == "entropy":
        g_logp = jnp.zeros_like(g_logp)
    out = _vjp(hidden, unembed, targets, g_logp, g_ent, tuple(sorted(kw.items())))
    return [np.asarray(x, np.float32) for x in out]


def assert_close_abs(got, want, atol, names=("logp", "entropy", "d_hidden", "d_unembed")):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=atol, rtol=0, err_msg=name)


def assert_close_rel(got, want, rel, names=("logp", "entropy", "d_hidden", "d_unembed")):
    """max |got - want| <= rel * max |want|, per array."""
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        err, scale = np.max(np.abs(g - w)), np.max(np.abs(w))
        assert err <= rel * scale, f"{name}: max error {err} > {rel} * {scale}"


IMPLS = [
    pytest.param("chunked", CHUNKED_BLOCKS, id="chunked"),
    pytest.param("chunked", {}, id="chunked-default-blocks"),
    pytest.param("pallas", PALLAS_BLOCKS, id="pallas"),
]
GPU = pytest.param("pallas_gpu", GPU_BLOCKS, id="pallas_gpu")
# each interpret-mode compile of the GPU kernels costs ~1.5 s here: the wider cases run slow
GPU_SLOW = pytest.param("pallas_gpu", GPU_BLOCKS, id="pallas_gpu", marks=pytest.mark.slow)


# the GPU kernel at 0.7 runs in test_pallas_gpu_hidden_chunks_and_every_edge
@pytest.mark.parametrize("impl,blocks,temperature", [
    pytest.param(*p.values, t, id=f"{p.id}-{t}") for p in IMPLS for t in (1.0, 0.7)] + [
    pytest.param(*GPU.values, 1.0, id="pallas_gpu-1.0")])
@pytest.mark.parametrize("cotangents", ["both", "logp", "entropy"])
def test_float32_matches_naive(impl, blocks, cotangents, temperature):
    # N=37, V=300: neither is a multiple of any block (ragged token and vocab tails).
    problem = make_problem(37, 32, 300)
    want = run(problem, cotangents, impl="naive", temperature=temperature)
    got = run(problem, cotangents, impl=impl, temperature=temperature, **blocks)
    assert_close_abs(got, want, atol=1e-5)
    if cotangents == "entropy":  # the entropy gradient is real, not a zero that matches zero
        assert np.max(np.abs(want[2])) > 1e-2 and np.max(np.abs(want[3])) > 1e-2


@pytest.mark.parametrize("impl,blocks", IMPLS + [GPU])
@pytest.mark.parametrize("cotangents", ["both", "entropy"])
def test_bfloat16_inputs_match_naive(impl, blocks, cotangents):
    problem = make_problem(37, 32, 300, dtype=jnp.bfloat16, seed=1)
    want = run(problem, cotangents, impl="naive", temperature=0.7)
    got = run(problem, cotangents, impl=impl, temperature=0.7, **blocks)
    assert_close_rel(got, want, rel=1e-2)
    # Accumulation is float32: the forward equals float32 math on the bf16-rounded inputs.
    f32 = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in problem)
    want32 = run(f32, cotangents, impl="naive", temperature=0.7)
    assert_close_abs(got[:2], want32[:2], atol=1e-5)


@pytest.mark.parametrize("impl,blocks", IMPLS[::2] + [GPU_SLOW])
def test_mixed_input_dtypes(impl, blocks):
    """float32 hidden with a bfloat16 unembed: computed in the promoted dtype, like naive."""
    hidden, unembed, targets, g_logp, g_ent = make_problem(37, 32, 300, seed=9)
    problem = (hidden, unembed.astype(jnp.bfloat16), targets, g_logp, g_ent)
    got = run(problem, impl=impl, **blocks)
    assert_close_rel(got, run(problem, impl="naive"), rel=1e-2)


@pytest.mark.parametrize("impl,blocks", IMPLS + [GPU_SLOW])
def test_batch_time_layout_and_exact_blocks(impl, blocks):
    # [B, T, H] input; N = 2 * 24 = 48 and V = 384 are exact multiples of the pallas blocks.
    problem = make_problem(48, 16, 384, seed=2, lead=(2, 24))
    want = run(problem, impl="naive")
    got = run(problem, impl=impl, **blocks)
    assert got[0].shape == (2, 24) and got[2].shape == (2, 24, 16)
    assert_close_abs(got, want, atol=1e-5)


@pytest.mark.parametrize("impl,blocks", IMPLS + [GPU_SLOW])
def test_peaked_and_flat_distributions(impl, blocks):
    # Large logits (|z| ~ 100s) and a low temperature: entropy ~ 0, log-probs ~ -100s. The
    # running max must keep this finite and as exact as the reference.
    problem = make_problem(21, 16, 260, seed=3, logit_scale=40.0)
    want = run(problem, impl="naive", temperature=0.3)
    got = run(problem, impl=impl, temperature=0.3, **blocks)
    assert np.all(np.isfinite(np.concatenate([g.ravel() for g in got])))
    assert np.max(want[1]) < 0.05 and np.min(want[0]) < -100
    names = ("logp", "d_hidden", "d_unembed")
    assert_close_rel([got[i] for i in (0, 2, 3)], [want[i] for i in (0, 2, 3)], 1e-5, names)
    # entropy = lse - E_p[z] is a difference of two ~100s: float32 resolves it to ~1e-6 * |z|.
    np.testing.assert_allclose(got[1], want[1], atol=1e-6 * np.max(np.abs(want[0])), rtol=0)
    # Nearly uniform logits: entropy ~ log V.
    problem = make_problem(21, 16, 260, seed=4, logit_scale=1e-3)
    got = run(problem, impl=impl, **blocks)
    np.testing.assert_allclose(got[1], np.log(260), rtol=1e-5)
    assert_close_abs(got, run(problem, impl="naive"), atol=1e-5)


def test_auto_is_chunked_off_tpu():
    problem = make_problem(19, 8, 200, seed=5)
    assert jax.default_backend() != "tpu"
    got = run(problem, impl="auto", block_v=64)
    want = run(problem, impl="chunked", block_v=64)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_eager_and_jit_agree():
    hidden, unembed, targets, _, _ = make_problem(13, 8, 150, seed=6)
    eager = fused_logprob(hidden, unembed, targets, impl="chunked", block_v=64)
    jitted = jax.jit(lambda h, w, y: fused_logprob(h, w, y, impl="chunked", block_v=64))(
        hidden, unembed, targets)
    for e, j in zip(eager, jitted):
        assert e.dtype == jnp.float32
        np.testing.assert_allclose(e, j, atol=1e-6)


def _chunked_any_blocks(n, v, block_t, block_v, seed):
    """Any sizes and block sizes, including blocks larger than the dimension and V = 1."""
    problem = make_problem(n, 8, v, seed=seed)
    want = run(problem, impl="naive")
    got = run(problem, impl="chunked", block_t=block_t, block_v=block_v)
    assert_close_abs(got, want, atol=1e-5)


_ANY_BLOCKS = dict(n=st.integers(1, 40), v=st.integers(1, 200), block_t=st.integers(1, 48),
                   block_v=st.integers(1, 96), seed=st.integers(0, 2**16))
# each example compiles two programs of new shapes (~2 s): a few in the default run, a sweep in the slow one
test_chunked_any_blocks = settings(max_examples=3, deadline=None)(given(**_ANY_BLOCKS)(_chunked_any_blocks))
test_chunked_any_blocks_sweep = pytest.mark.slow(settings(max_examples=20, deadline=None)(given(**_ANY_BLOCKS)(
    _chunked_any_blocks)))


def test_pallas_single_ragged_edge_blocks():
    """N=17, V=140: one full block plus a tail of 1 token / 12 columns, two seeds."""
    for problem in (make_problem(17, 8, 140, seed=7), make_problem(17, 8, 140, seed=8)):
        assert_close_abs(run(problem, impl="pallas", **PALLAS_BLOCKS), run(problem, impl="naive"),
                         atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_pallas_gpu_hidden_chunks_and_every_edge(dtype):
    """H=80: two chunks of 64 with a ragged second one; N=37, V=300: ragged token and vocab
    blocks, targets in the last, partial vocab block. (With the last vocab block unmasked, the
    interpreter's NaN padding reaches logp and d_unembed.)"""
    problem = make_problem(37, 80, 300, dtype=dtype, seed=10)
    problem[2].block_until_ready()
    assert int(problem[2][-1]) == 299 and 300 % GPU_BLOCKS["block_v"]
    got = run(problem, impl="pallas_gpu", temperature=0.7, **GPU_BLOCKS)
    if dtype == jnp.float32:
        assert_close_abs(got, run(problem, impl="naive", temperature=0.7), atol=1e-5)
    else:
        assert_close_rel(got, run(problem, impl="naive", temperature=0.7), rel=1e-2)


@pytest.mark.slow
def test_pallas_gpu_qwen_vocabulary():
    """Qwen2.5's vocabulary, 151,936 = 128 * 1187 columns: with 4096-column blocks, 38 vocab
    blocks, the last one 384 wide and holding the last target."""
    problem = make_problem(5, 16, 151936, seed=12)
    got = run(problem, impl="pallas_gpu", block_t=16, block_v=4096)
    assert_close_abs(got, run(problem, impl="naive"), atol=1e-5)


def test_pallas_dispatch_per_backend(monkeypatch):
    """impl="pallas" is the kernel of the backend it runs on; "auto" stays chunked off TPU."""
    table = {}
    for backend in ("cpu", "gpu", "tpu"):
        monkeypatch.setattr(_api.jax, "default_backend", lambda b=backend: b)
        table[backend] = {impl: (cfg.impl, cfg.interpret) for impl in ("auto", "pallas", "pallas_gpu")
                          for cfg in [_api._resolve(impl, 1.0, None, None)]}
    assert table == {
        "cpu": {"auto": ("chunked", False), "pallas": ("pallas_tpu", True),
                "pallas_gpu": ("pallas_gpu", True)},
        "gpu": {"auto": ("chunked", False), "pallas": ("pallas_gpu", False),
                "pallas_gpu": ("pallas_gpu", False)},
        "tpu": {"auto": ("pallas_tpu", False), "pallas": ("pallas_tpu", False),
                "pallas_gpu": ("pallas_gpu", True)},
    }


def test_chunked_temporary_memory_is_tiles_not_logits():
    """Compiled fwd+bwd temporaries: chunked holds tiles, naive holds [N, V] logits."""
    n, h, v = 2048, 64, 32768
    args = (jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))

    def temp_bytes(impl):
        def loss(hidden, unembed, targets):
            logp, ent = fused_logprob(hidden, unembed, targets, impl=impl)
            return logp.sum() + 0.1 * ent.sum()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = n * v * 4
    naive, chunked = temp_bytes("naive"), temp_bytes("chunked")
    assert naive >= logits_bytes
    assert chunked * 8 < naive, (chunked, naive)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_mosaic_for_tpu(dtype):
    """Without a TPU, the kernels still go through JAX's Pallas -> Mosaic lowering for the TPU
    platform (ragged sizes, default and small blocks): catches unsupported ops and bad block
    shapes early. (Mosaic's own compile runs only on a TPU: bench/logprob_accelerator.py.)"""
    n, h, v = 1000, 256, 5000
    hs, ws = jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((h, v), dtype)
    ys, vs = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32)
    for blocks in (dict(block_t=None, block_v=None), dict(block_t=16, block_v=128)):
        fwd = functools.partial(_tpu.stats, inv_temp=1.0, interpret=False, **blocks)
        bwd = functools.partial(_tpu.grads, inv_temp=1.0, dw_dtype=dtype, interpret=False, **blocks)
        texts = [jax.jit(fwd).trace(hs, ws, ys).lower(lowering_platforms=("tpu",)).as_text(),
                 jax.jit(bwd).trace(hs, ws, ys, vs, vs, vs, vs)
                 .lower(lowering_platforms=("tpu",)).as_text()]
        assert [t.count("tpu_custom_call") for t in texts] == [1, 2]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernels_lower_to_triton(dtype):
    """Without a GPU, the GPU kernels still go through JAX's Pallas -> Triton lowering for the
    CUDA platform (H=896 as in Qwen2.5-0.5B, ragged N and V): catches ops Triton lacks and
    blocks it rejects. (Triton's own compile runs only on a GPU: bench/accelerator.py.)"""
    n, h, v = 1000, 896, 5000
    hs, ws = jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((h, v), dtype)
    ys, vs = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32)
    fwd = functools.partial(_gpu.stats, inv_temp=1.0, interpret=False, block_t=None, block_v=None)
    bwd = functools.partial(_gpu.grads, inv_temp=1.0, dw_dtype=dtype, interpret=False, block_t=None,
                            block_v=None)
    texts = [jax.jit(fwd).trace(hs, ws, ys).lower(lowering_platforms=("cuda",)).as_text(),
             jax.jit(bwd).trace(hs, ws, ys, vs, vs, vs, vs).lower(lowering_platforms=("cuda",)).as_text()]
    assert [t.count("xla.gpu.triton") for t in texts] == [1, 2]


BAD_INPUTS = [
    (dict(hidden=np.zeros((2, 3, 4, 8))), "hidden has shape"),
    (dict(unembed=np.zeros((8, 10, 1))), "unembed has shape"),
    (dict(unembed=np.zeros((7, 10))), "disagree on H"),
    (dict(targets=np.zeros((5,), np.int32)), "targets has shape"),
    (dict(targets=np.zeros((6,), np.float32)), "integer dtype"),
    (dict(hidden=np.zeros((6, 8), np.int32)), "floating dtype"),
    (dict(unembed=np.zeros((8, 0))), "empty vocabulary"),
    (dict(impl="triton"), "impl='triton'; accepted: 'auto', 'pallas', 'pallas_tpu', 'pallas_gpu', "
                          "'chunked', 'naive'"),
    (dict(temperature=0.0), "temperature=0.0; accepted: a finite number > 0"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(block_v=0), "block_v=0; accepted: None or a positive int"),
    (dict(block_t=2.5), "block_t=2.5"),
    (dict(impl="pallas", block_v=100), "block_v=100 is not a multiple of 128"),
    (dict(impl="pallas", block_t=12), "block_t=12 is not a multiple of 8"),
    (dict(impl="pallas_gpu", block_v=96), "block_v=96 is not a power of two >= 16"),
    (dict(impl="pallas_gpu", block_t=8), "block_t=8 is not a power of two >= 16"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_raises_one_clear_value_error(change, message):
    kwargs = dict(hidden=np.zeros((6, 8), np.float32), unembed=np.zeros((8, 10), np.float32),
                  targets=np.zeros((6,), np.int32))
    kwargs.update(change)
    args = [kwargs.pop(k) for k in ("hidden", "unembed", "targets")]
    with pytest.raises(ValueError, match=f"fused_logprob: .*{re.escape(message)}"):
        fused_logprob(*args, **kwargs)


def test_traced_temperature_is_rejected():
    hidden, unembed, targets, _, _ = make_problem(4, 8, 16)
    with pytest.raises(ValueError, match="temperature must be a concrete"):
        jax.jit(lambda t: fused_logprob(hidden, unembed, targets, temperature=t))(0.7)


def test_mask_value_is_finite():
    assert np.isfinite(np.float32(MASK_VALUE)) and MASK_VALUE < -1e20


def test_import_is_light():
    code = ("import json, sys; import rljax.pallas; print(json.dumps(sorted(m for m in sys.modules"
            " if m.split('.')[0] in ('flax', 'tensorflow') or (m.startswith('rljax.') and"
            " not m.startswith('rljax.pallas')))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
