"""The distillation term joins the update's loss as verl's ``distillation_ppo_loss`` does
(:func:`rljax.loss.with_distillation`): the clamped per-token losses differentiated directly or
as the advantages of a PPO-clip loss, added to the task's loss with the coefficient or alone;
and the direct loss's gradient pulls the student toward the teacher."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import verl_oracle as V
from rljax import loss as L

B, T = 4, 5


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(0.05, 0.95, (B, T)))
    old = lp + rng.normal(0, 0.2, (B, T))
    teacher = np.minimum(lp + rng.normal(0, 2.0, (B, T)), -1e-3)
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
    mask[:, 0] = 1
    return lp, old, teacher, mask


@pytest.mark.parametrize("loss_mode,use_pg", [("k1", True), ("k3", True), ("k3", False), ("abs", False)])
@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_with_distillation_equals_verl(loss_mode, use_pg, use_task_rewards, agg):
    lp, old, teacher, mask = _batch(3)
    spec = L.DistillationSpec(loss_mode=loss_mode, use_task_rewards=use_task_rewards, distillation_loss_coef=0.3,
                              loss_max_clamp=1.5, use_policy_gradient=use_pg, clip_ratio_low=0.1, clip_ratio_high=0.25)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = L.with_distillation(f32(0.7), f32(lp), f32(old), f32(mask), spec, teacher_logp=f32(teacher),
                                  loss_agg_mode=agg)
    want, want_d = V.distillation_ppo_loss(0.7, old, lp, teacher, mask, agg, loss_mode=loss_mode,
                                           use_task_rewards=use_task_rewards, coef=0.3, use_policy_gradient=use_pg,
                                           clamp=1.5, low=0.1, high=0.25)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(m["distillation/loss"]), want_d, rtol=2e-5, atol=1e-6)
    raw = V.kl_penalty(lp, teacher, loss_mode)[mask > 0]  # the range is before the clamp
    np.testing.assert_allclose([float(m["distillation/loss_min"]), float(m["distillation/loss_max"])],
                               [raw.min(), raw.max()], rtol=1e-5, atol=1e-6)
    assert ("distillation/pg_clipfrac" in m) == use_pg


@pytest.mark.parametrize("use_pg", [False, True])
def test_gradient_moves_the_student_toward_the_teacher(use_pg):
    """One gradient step on the student's log-probs lowers the KL to the teacher; the teacher gets no gradient."""
    lp, old, teacher, mask = _batch(5)
    spec = L.DistillationSpec(loss_mode="k1" if use_pg else "k3", use_task_rewards=False, use_policy_gradient=use_pg,
                              loss_max_clamp=None)

    def f(logits, t):
        logp = jax.nn.log_softmax(logits)[..., 0]  # a two-way choice per token
        return L.with_distillation(0.0, logp, jax.lax.stop_gradient(logp), jnp.asarray(mask, jnp.float32), spec,
                                   teacher_logp=t)[0]

    logits = jnp.stack([jnp.asarray(lp, jnp.float32), jnp.log1p(-jnp.exp(jnp.asarray(lp, jnp.float32)))], -1)
    t = jnp.asarray(teacher, jnp.float32)
    g_student, g_teacher = jax.grad(f, argnums=(0, 1))(logits, t)
    assert float(jnp.abs(g_teacher).sum()) == 0.0
    gap = lambda x: float(jnp.sum(jnp.abs(jax.nn.log_softmax(x)[..., 0] - t) * mask))  # noqa: E731
    assert gap(logits - 0.5 * g_student) < gap(logits)
