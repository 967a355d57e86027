r"""verl's ``bypass_mode`` policy loss: the behaviour policy *is* the sampler (``old_logp`` is
the rollout log-prob, no learner old-log-prob pass), with the rollout correction applied
inside the loss against the current policy.

:func:`rljax.loss.rollout_correction` is taken with :math:`\pi_\theta` (gradient stopped) in
place of :math:`\pi_{old}`: its IS weights are :math:`\pi_\theta/\pi_{rollout}` and its
rejection drops the tokens / sequences whose divergence from the sampler is out of bounds.
Then, on the tokens kept:

* ``loss_type="ppo_clip"`` (verl's default): the ``vanilla`` dual-clip PPO loss with the
  ratio :math:`\pi_\theta/\pi_{rollout}`; the IS weights are *not* applied (the clipped ratio
  already is the correction; they are computed for their metrics only).
* ``loss_type="reinforce"``: :math:`L = -\mathrm{sg}(w)\,A\log\pi_\theta` (``w`` = 1 without
  ``rollout_is``), ``ppo_kl`` = :math:`E[\log\pi_{rollout} - \log\pi_\theta]`.

Metrics: the loss's own plus ``rollout_corr/*``. Differences from verl's
``compute_policy_loss_bypass_mode``: those of :mod:`rljax.loss._rollout_corr`; batch
normalisation is over the micro-batch the loss sees (verl: the micro-batch over the
data-parallel ranks); the ``is_weights`` argument is ignored (as verl ignores
``rollout_is_weights``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate
from rljax.loss._masked import masked_mean
from rljax.loss._policy import get_policy_loss, register_policy_loss
from rljax.loss._rollout_corr import Threshold, rollout_correction

LOSS_TYPES = ("ppo_clip", "reinforce")


@register_policy_loss("bypass_mode")
def _bypass_mode(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
                 is_weights, num_tokens, num_seqs, loss_type: str = "ppo_clip", rollout_is: Optional[str] = None,
                 rollout_is_threshold: Threshold = 2.0, rollout_is_batch_normalize: bool = False,
                 rollout_rs: Optional[str] = None, rollout_rs_threshold: Optional[Threshold] = None):
    del is_weights
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown bypass_mode loss_type {loss_type!r}; accepted: {', '.join(LOSS_TYPES)}")
    weights, kept, corr_metrics = rollout_correction(
        jax.lax.stop_gradient(logp), old_logp, mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold)
    agg = dict(loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    if loss_type == "ppo_clip":
        loss, metrics = get_policy_loss("vanilla")(
            logp, old_logp, advantages, kept, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c, is_weights=None, **agg)
    else:
        pg_losses = -advantages * logp * (1.0 if weights is None else weights)
        loss = aggregate(pg_losses, kept, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
        zero = jnp.zeros((), jnp.float32)
        metrics = {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": masked_mean(old_logp - logp, kept)}
    return loss, {**metrics, **corr_metrics}
