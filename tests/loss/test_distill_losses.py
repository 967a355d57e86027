"""On-policy distillation losses equal verl's (``verl/trainer/distillation``) written out in
NumPy: every estimator mode, the top-k forward KL with and without the log-prob clamp, the
loss clamp and every aggregation mode; an all-masked batch gives 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import verl_oracle as V
from rljax import loss as L

B, T, K = 4, 6, 3


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.01, 0.99, (B, T)))
    teacher = lp + rng.normal(0, 1.0, (B, T))
    mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float64)
    mask[:, 0] = 1
    mask[1] = 0
    mask[1, 0] = 1  # one token
    return lp, np.minimum(teacher, -1e-3), mask


@pytest.mark.parametrize("mode", ["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"])
@pytest.mark.parametrize("agg", sorted(L.AGGREGATION_MODES))
def test_estimator_losses_equal_verl(mode, agg):
    lp, teacher, mask = _batch(1)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    tok, m = L.estimator_distillation_losses(f32(lp), f32(teacher), f32(mask), loss_mode=mode)
    want = V.kl_penalty(lp, teacher, mode)
    np.testing.assert_allclose(np.asarray(tok) * mask, want * mask, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m["distillation/abs_loss"]), V.masked_mean(np.abs(want), mask), rtol=1e-5)
    for clamp in (None, 0.3):
        loss, lm = L.distillation_loss(tok, f32(mask), loss_agg_mode=agg, loss_max_clamp=clamp)
        want_loss, want_m = V.distillation_loss(want, mask, agg, clamp)
        np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
        for k, v in want_m.items():
            np.testing.assert_allclose(float(lm[k]), v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clamp", [None, -2.0])
def test_forward_kl_topk_equals_verl(clamp):
    rng = np.random.default_rng(2)
    student = np.log(rng.dirichlet(np.ones(8), (B, T))[..., :K])
    teacher = np.log(rng.dirichlet(np.ones(8) * 0.3, (B, T))[..., :K])
    _, _, mask = _batch(2)
    losses, m = L.forward_kl_topk(jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32),
                                  jnp.asarray(mask, jnp.float32), log_prob_min_clamp=clamp)
    want, s_mass, t_mass = V.forward_kl_topk(student, teacher, clamp)
    np.testing.assert_allclose(np.asarray(losses) * mask, want * mask, rtol=1e-5, atol=1e-6)
    valid = mask > 0
    for name, x in (("student_mass", s_mass), ("teacher_mass", t_mass)):
        np.testing.assert_allclose(float(m[f"distillation/{name}"]), x[valid].mean(), rtol=1e-5)
        np.testing.assert_allclose(float(m[f"distillation/{name}_min"]), x[valid].min(), rtol=1e-5)
        np.testing.assert_allclose(float(m[f"distillation/{name}_max"]), x[valid].max(), rtol=1e-5)


def test_gradient_reaches_the_student_only():
    # k1: d(logp - teacher)/dlogp = 1 per token (token-sum), nothing to the teacher
    lp, teacher, mask = _batch(3)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def total(s, t):
        tok, _ = L.estimator_distillation_losses(s, t, f32(mask), loss_mode="k1")
        return L.distillation_loss(tok, f32(mask), loss_agg_mode="token-sum")[0]

    gs, gt = jax.grad(total, argnums=(0, 1))(f32(lp), f32(teacher))
    np.testing.assert_allclose(gs, mask, rtol=1e-6)
    assert float(jnp.abs(gt).sum()) == 0.0


def test_all_masked_and_bad_mode():
    lp, teacher, _ = _batch(4)
    z = jnp.zeros((B, T))
    tok, _ = L.estimator_distillation_losses(jnp.asarray(lp), jnp.asarray(teacher), z, loss_mode="k3")
    loss, m = L.distillation_loss(tok, z)
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in m.values())
    with pytest.raises(ValueError, match="unknown distillation loss_mode 'k4'; accepted: k1, kl, k2"):
        L.estimator_distillation_losses(z, z, z, loss_mode="k4")
