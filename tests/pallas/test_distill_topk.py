"""The fused top-k passes of ``forward_kl_topk`` distillation (rljax/pallas/_topk.py) equal the plain
computation over full logits: the teacher's ids and log-probs equal ``jax.lax.top_k`` of the full
log-softmax, the student's log-probs at given ids (and their gradients) equal ``log_softmax`` taken
at those ids, with ragged token / vocabulary blocks, on one device and sharded over dp8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax.pallas._topk import (fused_logprob_at, fused_logprob_at_sharded, fused_topk_logprob,
                                fused_topk_logprob_sharded)
from rljax.sharding import make_mesh


def _inputs(n=40, h=16, v=300, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(n, h)), jnp.float32), jnp.asarray(rng.normal(size=(h, v)) * 0.5, jnp.float32))


def _full_logp(h, w, temperature):
    return jax.nn.log_softmax(jnp.dot(h, w, precision="highest") / temperature, -1)


@pytest.mark.parametrize("blocks", [dict(block_t=7, block_v=64), dict(block_t=40, block_v=13)])  # ragged tails
def test_topk_equals_lax_top_k_over_full_logits(blocks):
    h, w = _inputs()
    ids, logp = jax.jit(lambda h, w: fused_topk_logprob(h, w, 5, temperature=0.7, **blocks))(h, w)
    want_logp, want_ids = jax.lax.top_k(_full_logp(h, w, 0.7), 5)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k=301"):
        fused_topk_logprob(h, w, 301)


def test_logprob_at_ids_and_its_gradient_equal_log_softmax():
    h, w = _inputs(n=24, v=200, seed=1)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 200, (24, 6)), jnp.int32).at[:, 1].set(7)  # repeats too
    g = jnp.asarray(np.random.default_rng(3).normal(size=(24, 6)), jnp.float32)

    def fused(h, w):
        return jnp.sum(g * fused_logprob_at(h, w, ids, temperature=1.3, block_t=5, block_v=48))

    def plain(h, w):
        return jnp.sum(g * jnp.take_along_axis(_full_logp(h, w, 1.3), ids, -1))

    np.testing.assert_allclose(np.asarray(fused_logprob_at(h, w, ids, temperature=1.3, block_t=5, block_v=48)),
                               np.asarray(jnp.take_along_axis(_full_logp(h, w, 1.3), ids, -1)), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.jit(jax.grad(fused, (0, 1)))(h, w), jax.jit(jax.grad(plain, (0, 1)))(h, w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_sharded_over_dp8_equals_one_device(devices):
    mesh = make_mesh("dp8", devices)
    h, w = _inputs(n=64, v=120, seed=4)
    h3 = h.reshape(8, 8, -1)
    hs = jax.device_put(h3, NamedSharding(mesh, P("dp")))
    ids, logp = jax.jit(lambda h, w: fused_topk_logprob_sharded(h, w, 4, mesh=mesh, batch_axes=("dp",),
                                                                  seq_axis=None))(hs, w)
    want_ids, want_logp = fused_topk_logprob(h3, w, 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(want_logp), rtol=1e-6, atol=1e-6)

    def loss(logp):
        return jnp.sum(jnp.exp(logp))

    got = jax.jit(jax.grad(lambda h, w: loss(fused_logprob_at_sharded(h, w, want_ids, mesh=mesh, batch_axes=("dp",),
                                                              seq_axis=None)), (0, 1)))(hs, w)
    want = jax.grad(lambda h, w: loss(jnp.take_along_axis(_full_logp(h, w, 1.0), want_ids, -1)), (0, 1))(h3, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
