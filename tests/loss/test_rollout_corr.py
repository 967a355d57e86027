"""verl's rollout correction (``rollout_corr_helper.py``) against its formulas written out in
NumPy (``verl_oracle``): TIS and IcePop weights at both levels, batch normalisation, every
rejection option in every threshold form, the metrics, the off-policy diagnostics; the
edges (bounds hit exactly, one-token sequences, nothing valid) and partial rollout's
per-token versions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import verl_oracle as V
from rljax import loss as L

B, T = 6, 8


def _batch(seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, (B, T)))
    roll = old + rng.normal(0, scale, (B, T))
    mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float64)
    mask[:, 0] = 1.0
    mask[2] = 0.0
    mask[2, 0] = 1.0  # a sequence of length one
    return old, roll, mask


def _f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def _assert_metrics(got: dict, want: dict, prefix="", rtol=2e-5, atol=2e-6):
    for k, v in want.items():
        np.testing.assert_allclose(float(got[prefix + k]), v, rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("threshold,lower", [(2.0, None), (1.2, None), ("0.8_1.3", 0.8), ("0.5_5.0", 0.5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_equal_verl(level, threshold, lower, normalize):
    old, roll, mask = _batch(1, scale=0.15 if level == "sequence" else 0.3)
    upper = float(str(threshold).split("_")[-1])
    want_w, want_m = V.is_weights(old - roll, mask, level, upper, lower, normalize)
    w, m = L.rollout_is_weights(*_f32(old - roll, mask), rollout_is=level, rollout_is_threshold=threshold,
                                rollout_is_batch_normalize=normalize)
    np.testing.assert_allclose(w, want_w, rtol=2e-5, atol=1e-7)
    _assert_metrics(m, want_m)
    assert set(m) == set(want_m)


def test_icepop_bounds_are_inclusive_and_zero_outside():
    # ratios exactly 1 (log ratio 0) survive "1_1"; every other one is zeroed, the mask unchanged
    lr = np.array([[0.0, 0.1, -0.1, 0.0]])
    w, m = L.rollout_is_weights(*_f32(lr, np.ones((1, 4))), rollout_is="token", rollout_is_threshold="1_1")
    np.testing.assert_array_equal(w, [[1.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(float(m["rollout_is_oob_ratio"]), 0.5)
    w, _ = L.rollout_is_weights(*_f32(lr, np.ones((1, 4))), rollout_is="token", rollout_is_threshold=1.0)
    np.testing.assert_allclose(w, [[1.0, 1.0, math.exp(-0.1), 1.0]], rtol=1e-6)  # TIS truncates instead


RS_CASES = [
    ("token_k1", "0.8_1.25"), ("token_k1", 1.25), ("token_k2", 0.02), ("token_k3", "0.01"),
    ("seq_sum_k1", "0.5_2.0"), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
    ("seq_mean_k1", "0.95_1.05"), ("seq_mean_k2", 0.01), ("seq_mean_k3", 0.01),
    ("seq_max_k2", 0.05), ("seq_max_k3", 0.05),
    ("token_k1,seq_max_k3", "0.8_1.25,0.05"), ("seq_mean_k3,token_k2,seq_mean_k3", 0.02),
]


def _thresholds(options, spec):
    parts = str(spec).split(",")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = {}
    for o, p in zip(options, parts):
        if o.endswith("k1"):
            lo, hi = p.split("_") if "_" in p else (1.0 / float(p), p)
            out[o] = (float(lo), float(hi))
        else:
            out[o] = (None, float(p))
    return out


@pytest.mark.parametrize("rs,spec", RS_CASES)
def test_rejection_equals_verl(rs, spec):
    old, roll, mask = _batch(2)
    options = list(dict.fromkeys(rs.split(",")))
    want_mask, want_m = V.rejection(old - roll, mask, options, _thresholds(options, spec))
    kept, m = L.rollout_rejection_mask(*_f32(old - roll, mask), rollout_rs=rs, rollout_rs_threshold=spec)
    assert 0 < want_mask.sum() < mask.sum() or rs.startswith("seq_sum"), "the case should reject some, keep some"
    np.testing.assert_array_equal(np.asarray(kept), want_mask)
    _assert_metrics(m, want_m, rtol=5e-5, atol=5e-6)
    assert set(m) == set(want_m)


def test_rejection_at_the_threshold_keeps():
    # k1 = 0 with bounds "1_1" (log 1 = 0 both sides): kept; k2 = k3 = 0 <= any positive bound
    lr = np.array([[0.0, 0.0, 0.3]])
    kept, m = L.rollout_rejection_mask(*_f32(lr, np.ones((1, 3))), rollout_rs="token_k1", rollout_rs_threshold="1_1")
    np.testing.assert_array_equal(kept, [[1, 1, 0]])
    # a sequence statistic exactly at its bound: seq_sum_k2 of 0.5 * 0.3^2 = 0.045
    kept, _ = L.rollout_rejection_mask(*_f32(lr, np.ones((1, 3))), rollout_rs="seq_sum_k2",
                                       rollout_rs_threshold=float(np.float32(0.5) * np.float32(0.3) ** 2))
    np.testing.assert_array_equal(kept, [[1, 1, 1]])


def test_every_token_masked_gives_zeros_not_errors():
    old, roll, _ = _batch(3)
    mask = np.zeros((B, T))
    w, kept, m = jax.jit(lambda o, r, k: L.rollout_correction(
        o, r, k, rollout_is="sequence", rollout_is_threshold="0.5_2", rollout_rs="seq_max_k3,token_k1",
        rollout_rs_threshold="0.1,0.5_2"))(*_f32(old, roll, mask))
    assert float(jnp.abs(w).sum()) == 0.0 and float(jnp.abs(kept).sum()) == 0.0
    for k, v in m.items():
        assert np.isfinite(float(v)), k


def test_correction_combines_weights_rejection_and_diagnostics():
    old, roll, mask = _batch(4)
    w, kept, m = L.rollout_correction(*_f32(old, roll, mask), rollout_is="token", rollout_is_threshold=1.5,
                                      rollout_rs="seq_mean_k3", rollout_rs_threshold=0.02)
    want_w, want_is = V.is_weights(old - roll, mask, "token", 1.5)
    want_kept, want_rs = V.rejection(old - roll, mask, ["seq_mean_k3"], {"seq_mean_k3": (None, 0.02)})
    np.testing.assert_allclose(w, want_w, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    _assert_metrics(m, {**want_is, **want_rs, **V.offpolicy(old, roll, mask)}, prefix="rollout_corr/", rtol=5e-5,
                    atol=5e-6)
    assert all(k.startswith("rollout_corr/") for k in m)
    none_w, same, _ = L.rollout_correction(*_f32(old, roll, mask))
    assert none_w is None and np.array_equal(np.asarray(same), mask)


def test_partial_rollout_tokens_of_two_versions():
    # a response drawn by version 3 up to t=4 and version 4 after: each token's rollout_logp is its
    # own version's, so its weight is its own ratio (not one ratio per sequence)
    old, _, mask = _batch(5)
    rng = np.random.default_rng(5)
    v3, v4 = old + rng.normal(0, 0.4, (B, T)), old + rng.normal(0, 0.05, (B, T))
    roll = np.where(np.arange(T) < 4, v3, v4)
    w, _ = L.rollout_is_weights(*_f32(old - roll, mask), rollout_is="token", rollout_is_threshold="0.5_2.0")
    want, _ = V.is_weights(old - roll, mask, "token", 2.0, 0.5)
    np.testing.assert_allclose(w, want, rtol=2e-5, atol=1e-7)
    late = np.asarray(w)[:, 4:][mask[:, 4:] > 0]
    assert np.all(late > 0)  # the fresh tokens (|log r| ~ 0.05) are all inside IcePop's bounds


def test_weights_and_mask_carry_no_gradient():
    old, roll, mask = _batch(6)

    def total(o):
        w, kept, _ = L.rollout_correction(o, *_f32(roll, mask), rollout_is="token", rollout_rs="token_k3",
                                          rollout_rs_threshold=0.05)
        return jnp.sum(w * kept)

    assert float(jnp.abs(jax.grad(total)(jnp.asarray(old, jnp.float32))).sum()) == 0.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(rollout_is="batch"), "unknown rollout_is 'batch'; accepted: token, sequence"),
    (dict(rollout_is="token", rollout_is_threshold="2_1"), "lower bound must be <= the upper bound"),
    (dict(rollout_is="token", rollout_is_threshold=True), "accepted: a positive number or 'lower_upper'"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2), "unknown rollout_rs option 'seq_max_k1'"),
    (dict(rollout_rs="token_k2"), "needs rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="1_2"), "token_k2 takes one upper bound"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=-1), "must be a positive finite number"),
    (dict(rollout_rs=" , "), "names no option"),
])
def test_bad_specifications(kwargs, match):
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match=match):
        L.rollout_correction(z, z, jnp.ones((1, 2)), **kwargs)
