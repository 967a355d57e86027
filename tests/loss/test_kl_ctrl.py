"""The adaptive KL-in-reward controller against verl's formula (verl's AdaptiveKLController)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from rljax import loss as L


def _verl_reference(init, target, horizon, kls, batch_sizes):
    """verl's controller, written out: value *= 1 + clip(kl/target - 1, -0.2, 0.2) * n/horizon;
    each step's penalty uses the value before its update."""
    value, used = float(init), []
    for kl, n in zip(kls, batch_sizes):
        used.append(value)
        value *= 1 + float(np.clip(kl / target - 1, -0.2, 0.2)) * n / horizon
    return used, value


def test_adaptive_kl_coef_follows_verl_over_a_run():
    rng = np.random.default_rng(0)
    kls = rng.uniform(0.0, 0.5, 50)
    sizes = rng.integers(1, 512, 50)
    used_ref, final_ref = _verl_reference(0.2, 0.1, 1000, kls, sizes)
    coef, used = 0.2, []
    step = jax.jit(lambda c, kl, n: L.adaptive_kl_coef(c, kl, n, target_kl=0.1, horizon=1000))
    for kl, n in zip(kls, sizes):
        used.append(float(coef))
        coef = step(coef, kl, n)
    np.testing.assert_allclose(used, used_ref, rtol=1e-5)
    np.testing.assert_allclose(float(coef), final_ref, rtol=1e-5)


@pytest.mark.parametrize("kl, expected", [(0.1, 1.0), (0.0, 1 - 0.2 * 64 / 100), (10.0, 1 + 0.2 * 64 / 100),
                                          (0.11, 1 + 0.1 * 64 / 100)])
def test_adaptive_kl_coef_steady_at_target_and_clipped(kl, expected):
    out = L.adaptive_kl_coef(1.0, kl, 64, target_kl=0.1, horizon=100)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(float(out), expected, rtol=1e-5)


def test_adaptive_kl_coef_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="target_kl"):
        L.adaptive_kl_coef(1.0, 0.1, 8, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        L.adaptive_kl_coef(1.0, 0.1, 8, target_kl=0.1, horizon=0)


def test_mean_sequence_kl_is_the_row_mean_of_token_means():
    kl = jnp.array([[1.0, 3.0, 9.0], [2.0, 2.0, 2.0], [5.0, 5.0, 5.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], jnp.float32)
    # verl: masked_mean over tokens per row (an empty row gives 0), then the mean over rows.
    np.testing.assert_allclose(float(L.mean_sequence_kl(kl, mask)), (2.0 + 2.0 + 0.0) / 3, rtol=1e-6)
    rows = jnp.array([True, True, False])  # the third row is padding: not counted
    np.testing.assert_allclose(float(L.mean_sequence_kl(kl, mask, row_mask=rows)), 2.0, rtol=1e-6)
