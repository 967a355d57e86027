r"""Rollout correction: truncated importance sampling for the sampler/learner mismatch.

The sampler (bf16 KV cache, another kernel, a stale weight version) does not compute the
same distribution as the learner. With

.. math:: \frac{\pi_\theta}{\pi_{rollout}} =
          \underbrace{\frac{\pi_\theta}{\pi_{old}}}_{\text{update ratio (PPO clip)}} \cdot
          \underbrace{\frac{\pi_{old}}{\pi_{rollout}}}_{\text{backend ratio (this weight)}}

the PPO loss handles the first factor and :func:`rollout_correction_weights` the second.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.loss._masked import masked_sum

CORRECTION_LEVELS = ("token", "sequence")


def rollout_correction_weights(
    old_logp: chex.Array,
    rollout_logp: chex.Array,
    mask: chex.Array,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> jax.Array:
    r"""Truncated importance weights :math:`\min(\pi_{old}/\pi_{rollout}, C)`, gradient stopped.

    * ``level="token"``: :math:`w_t = \min(\exp(\mathrm{clip}(\log\pi_{old,t} - \log\pi_{roll,t}, \pm 20)), C)`
    * ``level="sequence"``: :math:`w = \min(\exp(\mathrm{clip}(\sum_t m_t(\log\pi_{old,t} - \log\pi_{roll,t}), \pm 20)), C)`
      broadcast over the sequence.

    Args:
      old_logp: ``[B, T]`` learner log-probs before the update.
      rollout_logp: ``[B, T]`` sampler log-probs recorded at sampling time.
      mask: ``[B, T]`` loss mask; weights are 0 outside it.
      level: ``"token"`` or ``"sequence"``.
      threshold: truncation ``C`` (> 0).

    Returns:
      ``[B, T]`` float32 weights, multiply the per-token policy loss with them.
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; accepted: {', '.join(CORRECTION_LEVELS)}")
    if not threshold > 0:
        raise ValueError(f"rollout correction threshold must be > 0, got {threshold}")
    chex.assert_rank([old_logp, rollout_logp, mask], 2)
    chex.assert_equal_shape([old_logp, rollout_logp, mask])
    mask = jnp.asarray(mask)
    valid = mask.astype(bool)
    log_ratio = jnp.where(valid, old_logp - rollout_logp, 0.0).astype(jnp.float32)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(masked_sum(log_ratio, mask, axis=-1)[:, None], log_ratio.shape)
    weights = jnp.minimum(jnp.exp(jnp.clip(log_ratio, -20.0, 20.0)), threshold)
    return jax.lax.stop_gradient(jnp.where(valid, weights, 0.0))
