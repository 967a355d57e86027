r"""On-policy distillation losses (verl's ``verl/trainer/distillation/losses.py``): the student
samples, a teacher scores the sampled tokens, the student is pulled toward the teacher per token.

* Single-sample estimators of the reverse KL :math:`KL(\pi_\theta \| \pi_T)` on the sampled
  token (``loss_mode`` = ``k1`` / ``kl``, ``k2`` / ``mse``, ``k3`` / ``low_var_kl``, ``abs``):
  :func:`rljax.loss.kl_penalty` ``(logp, teacher_logp)``, verl's ``kl_penalty``; metric
  ``distillation/abs_loss`` (k1 can be negative).
* ``forward_kl_topk``: the forward KL over the teacher's top-k tokens,
  :math:`\sum_{v \in topk_T} p_T(v)(\log p_T(v) - \log p_\theta(v))` with both log-probs
  optionally clamped below at ``log_prob_min_clamp``, clamped at 0 (the truncated
  distributions do not sum to 1); metrics ``distillation/student_mass`` / ``teacher_mass``
  (the probability mass of those k tokens, mean / min / max).

:func:`distillation_loss` aggregates the per-token losses with ``loss_agg_mode`` after the
symmetric ``loss_max_clamp`` and reports ``distillation/loss_min`` / ``loss_max`` (before the
clamp, as verl). :func:`with_distillation` joins the term to the policy loss as verl's
``distillation_ppo_loss`` does (:class:`DistillationSpec`: ``distillation.distillation_loss.*``):
differentiated directly, or as the advantage ``-loss`` of a PPO-clip loss
(``use_policy_gradient``), added to the task's loss with ``distillation_loss_coef`` or alone
(``use_task_rewards``). The trainer's update calls it (``rljax.trainer.step.actor_loss``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate
from rljax.loss._kl import kl_penalty
from rljax.loss._masked import masked_mean
from rljax.loss._policy import policy_loss

ESTIMATOR_MODES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
DISTILLATION_LOSS_MODES = (*ESTIMATOR_MODES, "forward_kl_topk")


def _masked_extreme(x: jax.Array, mask: jax.Array, fn, fill: float) -> jax.Array:
    valid = jnp.asarray(mask).astype(bool)
    return jnp.where(jnp.any(valid), fn(jnp.where(valid, x, fill)), 0.0)


def estimator_distillation_losses(
    logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array, *, loss_mode: str = "k3"
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token reverse-KL estimate of the sampled tokens: ``([B, T] losses, {distillation/abs_loss})``.

    Args:
      logp: ``[B, T]`` the student's log-probs of the sampled tokens (differentiated).
      teacher_logp: ``[B, T]`` the teacher's log-probs of the same tokens (gradient stopped).
      mask: ``[B, T]`` the response tokens.
      loss_mode: one of :data:`ESTIMATOR_MODES`.
    """
    if loss_mode not in ESTIMATOR_MODES:
        raise ValueError(f"unknown distillation loss_mode {loss_mode!r}; accepted: {', '.join(DISTILLATION_LOSS_MODES)}")
    chex.assert_rank([logp, teacher_logp, mask], 2)
    chex.assert_equal_shape([logp, teacher_logp, mask])
    valid = jnp.asarray(mask).astype(bool)
    losses = kl_penalty(jnp.where(valid, logp, 0.0), jnp.where(valid, jax.lax.stop_gradient(teacher_logp), 0.0),
                        kind=loss_mode)
    return losses, {"distillation/abs_loss": masked_mean(jnp.abs(losses), mask)}


def forward_kl_topk(
    student_topk_logp: chex.Array,
    teacher_topk_logp: chex.Array,
    mask: chex.Array,
    *,
    log_prob_min_clamp: Optional[float] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Forward KL over the teacher's top-k tokens: ``([B, T] losses >= 0, mass metrics)``.

    Args:
      student_topk_logp: ``[B, T, K]`` the student's log-probs of the teacher's top-k token ids.
      teacher_topk_logp: ``[B, T, K]`` the teacher's log-probs of its top-k tokens (gradient stopped).
      mask: ``[B, T]`` the response tokens.
      log_prob_min_clamp: lower clamp of both log-probs (``None``: none).
    """
    chex.assert_rank([student_topk_logp, teacher_topk_logp], 3)
    chex.assert_equal_shape([student_topk_logp, teacher_topk_logp])
    chex.assert_equal_shape_prefix([student_topk_logp, mask], 2)
    valid = jnp.asarray(mask).astype(bool)[..., None]
    student = jnp.where(valid, student_topk_logp, 0.0).astype(jnp.float32)
    teacher = jnp.where(valid, jax.lax.stop_gradient(teacher_topk_logp), 0.0).astype(jnp.float32)
    student_mass, teacher_mass = jnp.sum(jnp.exp(student), -1), jnp.sum(jnp.exp(teacher), -1)
    if log_prob_min_clamp is not None:
        student, teacher = jnp.maximum(student, log_prob_min_clamp), jnp.maximum(teacher, log_prob_min_clamp)
    losses = jnp.maximum(jnp.sum(jnp.exp(teacher) * (teacher - student), -1), 0.0)
    metrics = {}
    for name, m in (("student_mass", student_mass), ("teacher_mass", teacher_mass)):
        metrics[f"distillation/{name}"] = masked_mean(m, mask)
        metrics[f"distillation/{name}_min"] = _masked_extreme(m, mask, jnp.min, jnp.inf)
        metrics[f"distillation/{name}_max"] = _masked_extreme(m, mask, jnp.max, -jnp.inf)
    return losses, metrics


def clamp_distillation_losses(token_losses: chex.Array, mask: chex.Array, loss_max_clamp: Optional[float] = None
                              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(token losses clamped to [-c, c], {distillation/loss_min, loss_max})``: the range metrics
    before the clamp, as verl (the lower bound is for k1, which can be negative)."""
    chex.assert_rank([token_losses, mask], 2)
    metrics = {"distillation/loss_min": _masked_extreme(token_losses, mask, jnp.min, jnp.inf),
               "distillation/loss_max": _masked_extreme(token_losses, mask, jnp.max, -jnp.inf)}
    if loss_max_clamp is not None:
        token_losses = jnp.clip(token_losses, -loss_max_clamp, loss_max_clamp)
    return token_losses, metrics


def distillation_loss(
    token_losses: chex.Array,
    mask: chex.Array,
    *,
    loss_agg_mode: str = "token-mean",
    loss_max_clamp: Optional[float] = None,
    num_tokens: Optional[chex.Numeric] = None,
    num_seqs: Optional[chex.Numeric] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The distillation loss of per-token losses: ``(scalar, {distillation/loss_min, loss_max})``.

    ``loss_max_clamp`` ``c`` clamps the token losses to ``[-c, c]`` before aggregating (verl's;
    the minimum bound is for k1, which can be negative); the range metrics are before it.
    """
    token_losses, metrics = clamp_distillation_losses(token_losses, mask, loss_max_clamp)
    loss = aggregate(token_losses, mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class DistillationSpec:
    """How the distillation term joins the update's loss (verl's ``distillation.distillation_loss``)."""

    loss_mode: str = "k3"
    topk: int = 128
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = 10.0
    log_prob_min_clamp: Optional[float] = -10.0
    use_policy_gradient: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self):
        if self.loss_mode not in DISTILLATION_LOSS_MODES:
            raise ValueError(f"unknown distillation loss_mode {self.loss_mode!r}; accepted: "
                             f"{', '.join(DISTILLATION_LOSS_MODES)}")

    @property
    def uses_topk(self) -> bool:
        """The loss reads the teacher's top-k (ids and log-probs), not its log-prob of the sampled token."""
        return self.loss_mode == "forward_kl_topk"


def with_distillation(
    task_loss: chex.Array,
    logp: chex.Array,
    old_logp: chex.Array,
    mask: chex.Array,
    spec: DistillationSpec,
    *,
    teacher_logp: Optional[chex.Array] = None,
    student_topk_logp: Optional[chex.Array] = None,
    teacher_topk_logp: Optional[chex.Array] = None,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[chex.Array] = None,
    num_tokens: Optional[chex.Numeric] = None,
    num_seqs: Optional[chex.Numeric] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The update's loss with the distillation term: ``(loss, distillation/* metrics)``.

    .. math::
       L = [\text{use\_task\_rewards}]\, L_{task} + c\, D, \quad
       c = \text{distillation\_loss\_coef if use\_task\_rewards else } 1

    where ``D`` aggregates the clamped per-token losses ``d_t`` (:func:`estimator_distillation_losses`
    of ``logp`` against ``teacher_logp``, or :func:`forward_kl_topk` of ``student_topk_logp``
    against ``teacher_topk_logp``) with ``loss_agg_mode``, or, with ``use_policy_gradient``, is
    the PPO-clip loss of advantages :math:`-\mathrm{sg}(d_t)` (``old_logp``, the spec's clip
    ratios, ``is_weights``), verl's on-policy distillation as a reward. Metrics: ``distillation/loss``
    (``D``), ``loss_min`` / ``loss_max`` (before the clamp), ``abs_loss`` (estimators) or the
    top-k masses, and with the policy gradient ``distillation/pg_clipfrac`` / ``ppo_kl``.
    """
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    if spec.uses_topk:
        losses, metrics = forward_kl_topk(student_topk_logp, teacher_topk_logp, mask,
                                          log_prob_min_clamp=spec.log_prob_min_clamp)
    else:
        losses, metrics = estimator_distillation_losses(logp, teacher_logp, mask, loss_mode=spec.loss_mode)
    losses, ranges = clamp_distillation_losses(losses, mask, spec.loss_max_clamp)
    metrics.update(ranges)
    if spec.use_policy_gradient:
        distill, pg = policy_loss(logp, old_logp, -jax.lax.stop_gradient(losses), mask, mode="vanilla",
                                  clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high,
                                  loss_agg_mode=loss_agg_mode, is_weights=is_weights, **agg)
        metrics.update({f"distillation/{k}": v for k, v in pg.items()})
    else:
        distill = aggregate(losses, mask, mode=loss_agg_mode, **agg)
    metrics["distillation/loss"] = distill
    if spec.use_task_rewards:
        return task_loss + spec.distillation_loss_coef * distill, metrics
    return distill, metrics
