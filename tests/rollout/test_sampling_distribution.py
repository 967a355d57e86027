"""The sampler's draw at a vocabulary of several blocks: the exact softmax distribution (also
after top-k / top-p and temperature), excluded tokens never drawn, log-probs, and a token that
depends only on its row's logits and key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.rollout import sample_tokens, truncate_logits
from rljax.rollout.sampling import BLOCK, categorical

VOCAB = 3 * BLOCK + 37  # blocks of BLOCK columns plus a padded partial one
DRAWS = 40000


def _structured_logits():
    """A row whose mass sits on block edges and in the partial last block, with excluded tokens
    (``-inf``) right after heavy ones and one block excluded whole."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=VOCAB).astype(np.float32)
    x[[0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, VOCAB - 1]] += 4.0  # heavy tokens at the block edges, the last column
    x[[1, BLOCK + 1, VOCAB - 2]] = -np.inf  # excluded beside heavy ones
    x[2 * BLOCK : 3 * BLOCK] = -np.inf  # a whole block excluded
    return x


def _draw(row, **kw):
    rows = jnp.broadcast_to(jnp.asarray(row), (DRAWS, row.size))
    keys = jax.random.split(jax.random.PRNGKey(11), DRAWS)
    fn = jax.jit(lambda r, k: sample_tokens(r, k, **kw))
    tok, logp = fn(rows, keys)
    return np.asarray(tok), np.asarray(logp)


def _check_frequencies(tok, probs):
    """Every token's count within 5 binomial standard deviations (+1) of ``DRAWS * p``; never a
    token of probability 0."""
    counts = np.bincount(tok, minlength=probs.size)
    assert counts[probs == 0].sum() == 0, np.flatnonzero((probs == 0) & (counts > 0))
    expect = DRAWS * probs
    bound = 5 * np.sqrt(expect * (1 - probs)) + 1
    bad = np.flatnonzero(np.abs(counts - expect) > bound)
    assert bad.size == 0, [(int(i), int(counts[i]), round(float(expect[i]), 1)) for i in bad[:8]]
    # and the total-variation distance is that of sampling noise
    assert 0.5 * np.abs(counts / DRAWS - probs).sum() < 0.5 * np.sqrt(probs.size / DRAWS)


def _softmax(x):
    p = np.exp(x.astype(np.float64) - np.max(x))
    return p / p.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_tempered_softmax_across_blocks(temperature):
    x = _structured_logits()
    tok, logp = _draw(x, temperature=temperature, top_k=0, top_p=1.0)
    probs = _softmax(x / temperature)
    _check_frequencies(tok, probs)
    np.testing.assert_allclose(logp, np.log(probs[tok]), rtol=0, atol=2e-5)


@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (0, 0.8), (200, 0.9)])
def test_draws_follow_the_truncated_distribution(top_k, top_p):
    """Frequencies: the draw on the truncated row (``truncate_logits`` itself is checked against a
    sorting reference in test_rollout_sampling.py); ``sample_tokens`` with the truncation, on
    fewer rows: only kept tokens, and both log-prob modes."""
    x = _structured_logits()
    kept = np.asarray(truncate_logits(jnp.asarray(x)[None], top_k, top_p))[0]
    rows = jnp.broadcast_to(jnp.asarray(kept), (DRAWS, x.size))
    tok, _ = jax.jit(categorical)(rows, jax.random.split(jax.random.PRNGKey(11), DRAWS))
    _check_frequencies(np.asarray(tok), _softmax(kept))
    few = jnp.broadcast_to(jnp.asarray(x), (256, x.size))
    keys = jax.random.split(jax.random.PRNGKey(12), 256)
    tok, logp = sample_tokens(few, keys, temperature=1.0, top_k=top_k, top_p=top_p)
    tok = np.asarray(tok)
    assert np.isfinite(kept[tok]).all()
    np.testing.assert_allclose(logp, np.log(_softmax(x)[tok]), rtol=0, atol=2e-5)  # "tempered": before truncation
    tok_t, logp_t = sample_tokens(few, keys, temperature=1.0, top_k=top_k, top_p=top_p, logprobs="truncated")
    np.testing.assert_array_equal(tok_t, tok)
    np.testing.assert_allclose(logp_t, np.log(_softmax(kept)[tok]), rtol=0, atol=2e-5)


def test_a_point_mass_and_a_single_kept_token_in_the_partial_block():
    x = np.full((2, VOCAB), -np.inf, np.float32)
    x[0, VOCAB - 1] = 3.0  # the only token: the last column, in the padded block
    x[1, [5, BLOCK + 7]] = [0.0, np.log(3.0)]  # 1 : 3
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    tok, norm = categorical(jnp.asarray(x), keys)
    assert int(tok[0]) == VOCAB - 1 and abs(float(norm[0]) - 3.0) < 1e-6
    rows = jnp.broadcast_to(jnp.asarray(x[1]), (DRAWS, VOCAB))
    tok, _ = jax.jit(categorical)(rows, jax.random.split(jax.random.PRNGKey(3), DRAWS))
    counts = np.bincount(np.asarray(tok), minlength=VOCAB)
    assert counts.sum() == counts[5] + counts[BLOCK + 7]
    assert abs(counts[BLOCK + 7] / DRAWS - 0.75) < 5 * np.sqrt(0.75 * 0.25 / DRAWS)


def test_a_row_token_depends_only_on_its_logits_and_key_at_large_vocab():
    """Determinism per (seed, uid, session): a row's token is a function of its logits and key
    only: not of the other rows, their order or count, nor of jit."""
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 4 * BLOCK + 3), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    for kw in (dict(top_k=0, top_p=1.0), dict(top_k=50, top_p=0.9)):
        tok, logp = sample_tokens(x, keys, temperature=1.0, **kw)
        again, _ = jax.jit(lambda a, k, kw=kw: sample_tokens(a, k, temperature=1.0, **kw))(x, keys)
        np.testing.assert_array_equal(tok, again)
        perm = np.asarray([5, 2, 0, 4, 1, 3])
        tok_p, logp_p = sample_tokens(x[perm], keys[perm], temperature=1.0, **kw)
        np.testing.assert_array_equal(np.asarray(tok)[perm], tok_p)
        np.testing.assert_allclose(np.asarray(logp)[perm], logp_p, rtol=0, atol=1e-6)
        sub, _ = sample_tokens(x[:1], keys[:1], temperature=1.0, **kw)
        assert int(sub[0]) == int(tok[0])
        other, _ = sample_tokens(x, jax.random.split(jax.random.PRNGKey(4), 6), temperature=1.0, **kw)
        assert not np.array_equal(np.asarray(other), np.asarray(tok))  # the key matters
