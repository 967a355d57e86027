"""Sampling function, decode parameters and random streams (no model needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.rollout import DecodeParams, sample_tokens, trajectory_key, trajectory_keys, truncate_logits
from rljax.rollout.sampling import first_argmax


def _logits(seed=0, rows=4, vocab=16):
    return jax.random.normal(jax.random.PRNGKey(seed), (rows, vocab), jnp.float32) * 2.0


def test_truncate_top_k_keeps_exactly_k_largest():
    x = _logits()
    out = np.asarray(truncate_logits(x, 3, 1.0))
    for row, o in zip(np.asarray(x), out):
        kept = np.isfinite(o)
        assert kept.sum() == 3
        np.testing.assert_array_equal(np.sort(np.argsort(-row)[:3]), np.nonzero(kept)[0])
        np.testing.assert_array_equal(o[kept], row[kept])


def test_truncate_top_p_keeps_smallest_set_reaching_p():
    x = jnp.log(jnp.asarray([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda p: np.isfinite(np.asarray(truncate_logits(x, 0, p)))[0].tolist()
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.75) == [True, True, False, False]
    assert kept(0.76) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]
    # top-p runs on the distribution renormalised after top-k: {0.5, 0.25} -> {2/3, 1/3}.
    assert np.isfinite(np.asarray(truncate_logits(x, 2, 0.6)))[0].tolist() == [True, False, False, False]
    assert np.isfinite(np.asarray(truncate_logits(x, 2, 0.7)))[0].tolist() == [True, True, False, False]


def _truncate_by_sorting(scaled, top_k, top_p):
    """Naive reference: sort, cut at k, renormalise, cut where the mass before reaches top_p."""
    out = np.full_like(scaled, -np.inf)
    for r, row in enumerate(np.asarray(scaled, np.float64)):
        desc = np.sort(row)[::-1]
        k = len(row) if top_k == 0 else min(top_k, len(row))
        kept = desc[:k]
        p = np.exp(kept - kept.max())
        p /= p.sum()
        before = np.cumsum(p) - p
        n = max(1, int(np.sum(before < top_p - 1e-6)))
        out[r] = np.where(row >= kept[n - 1], row, -np.inf)
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (7, 1.0), (7, 0.5), (50, 0.3), (1, 0.99), (0, 0.999)])
def test_truncate_matches_a_sorting_reference(top_k, top_p):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(top_k), (16, 300))) * 3
    x[0, :10] = 2.5  # ties
    x[1, 100:] = -np.inf  # masked vocabulary
    x[2] = 0.0  # flat
    got = np.asarray(jax.jit(truncate_logits)(jnp.asarray(x, jnp.float32), top_k, top_p))
    want = _truncate_by_sorting(x.astype(np.float32), top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], x.astype(np.float32)[np.isfinite(got)])


def test_greedy_is_argmax_and_records_untempered_logp():
    x = _logits()
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    tok, logp = sample_tokens(x, keys, temperature=0.0, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(tok, jnp.argmax(x, -1))
    np.testing.assert_allclose(logp, jnp.max(jax.nn.log_softmax(x), -1), rtol=0, atol=1e-6)


def test_first_argmax_is_jnp_argmax_with_ties_infinities_and_nans():
    """The sampler's two-reduction argmax picks what ``jnp.argmax`` picks: the first maximum,
    the first NaN of a row holding one (also after a larger finite value), index 0 of an all
    ``-inf`` row."""
    x = np.array(_logits(rows=9, vocab=64))
    x[1, [7, 40]] = 1e9  # a tie: the first
    x[2] = -np.inf
    x[3, [5, 9]] = np.inf
    x[4, [30, 12]] = np.nan
    x[5, 3], x[5, 50] = 1e30, np.nan  # the NaN wins, as in jnp.argmax
    x[6] = np.nan
    x[7, 63] = 1e9  # the last column
    got, want = jax.jit(first_argmax)(jnp.asarray(x)), jnp.argmax(jnp.asarray(x), -1)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32 and list(np.asarray(got)[1:8]) == [7, 0, 5, 12, 50, 0, 63]


def test_samples_follow_the_tempered_truncated_distribution():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.2, 0.1]))
    n = 20000
    rows = jnp.broadcast_to(logits, (n, 4))
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    temp = 0.5
    tok, logp = jax.jit(lambda r, k: sample_tokens(r, k, temperature=temp, top_k=3, top_p=1.0))(rows, keys)
    tempered = np.asarray(jax.nn.softmax(logits / temp))
    expected = tempered[:3] / tempered[:3].sum()
    freq = np.bincount(np.asarray(tok), minlength=4) / n
    assert freq[3] == 0  # outside top-k: never drawn
    np.testing.assert_allclose(freq[:3], expected, atol=0.015)
    # default "tempered" log-probs: after temperature, before top-k truncation
    np.testing.assert_allclose(logp, np.log(tempered)[np.asarray(tok)], atol=1e-6)
    _, logp_trunc = sample_tokens(rows[:64], keys[:64], temperature=temp, top_k=3, top_p=1.0, logprobs="truncated")
    tok64 = np.asarray(tok[:64])
    np.testing.assert_allclose(logp_trunc, np.log(expected)[tok64], atol=1e-6)


def test_row_token_depends_only_on_its_logits_and_key():
    x = _logits(rows=6)
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    tok, _ = sample_tokens(x, keys, temperature=1.0, top_k=0, top_p=0.9)
    perm = np.asarray([5, 2, 0, 4, 1, 3])
    tok_p, _ = sample_tokens(x[perm], keys[perm], temperature=1.0, top_k=0, top_p=0.9)
    np.testing.assert_array_equal(np.asarray(tok)[perm], tok_p)
    sub, _ = sample_tokens(x[:2], keys[:2], temperature=1.0, top_k=0, top_p=0.9)
    np.testing.assert_array_equal(np.asarray(tok)[:2], sub)


def test_trajectory_keys_are_stable_and_distinct():
    k = trajectory_keys(0, ["a", "a", "b", 7], [0, 1, 0, 0])
    assert k.shape == (4, 2) and k.dtype == np.uint32
    assert len({tuple(r) for r in k}) == 4
    np.testing.assert_array_equal(trajectory_key(0, "a", 1), k[1])
    np.testing.assert_array_equal(trajectory_key(0, "7", 0), k[3])  # uids are keyed by str(uid)
    assert not np.array_equal(trajectory_key(1, "a", 0), k[0])


def test_trajectory_keys_compile_per_size_bucket_not_per_row_count():
    """Multi-turn rounds and async batches ask for many row counts: keys compile once per
    power-of-two bucket, and a row's key does not depend on the others or on the padding."""
    from rljax.rollout import sampling

    before = sampling._keys._cache_size()
    ks = {n: trajectory_keys(5, list(range(n)), [2] * n) for n in range(1, 34)}
    assert sampling._keys._cache_size() - before <= 4  # buckets 8, 16, 32, 64
    for n, k in ks.items():
        assert k.shape == (n, 2)
        np.testing.assert_array_equal(k, ks[33][:n])
    np.testing.assert_array_equal(ks[33][20], trajectory_key(5, 20, 2))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(logprobs="raw"), "logprobs"),
    ],
)
def test_bad_decode_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=f"DecodeParams.{field}"):
        DecodeParams(**kwargs)


def test_decode_params_normalise_eos():
    assert DecodeParams(eos_ids=5).eos_ids == (5,)
    assert DecodeParams(eos_ids=[1, 2]).eos_ids == (1, 2)
    assert DecodeParams().greedy is False and DecodeParams(temperature=0).greedy is True
