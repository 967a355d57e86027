r"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
arXiv:2505.22617): PPO variants that act on the few tokens whose advantage and log-prob
covary most, the tokens that collapse the policy's entropy.

With :math:`\log r = \log\pi - \log\pi_{old}` (not clamped, as verl) and the token
covariance over the batch's valid tokens
:math:`c_t = (A_t - \bar A)(\log\pi_t - \overline{\log\pi})`:

* ``clip_cov``: the PPO-clip loss :math:`\max(-Ar, -A\,\mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h))`
  where, among tokens not already clipped with :math:`lb < c_t < ub` (``clip_cov_lb``,
  ``clip_cov_ub``), :math:`\max(\lfloor\text{clip\_cov\_ratio}\cdot N\rfloor, 1)` drawn at
  random lose their gradient (loss 0). ``pg_clipfrac`` is the fraction detached.
* ``kl_cov``: the unclipped loss :math:`-Ar`, plus :math:`\text{ppo\_kl\_coef}\,|\log r|` on the
  :math:`\max(1, \lfloor\text{kl\_cov\_ratio}\cdot N\rfloor)` tokens of largest :math:`c_t`.
  ``ppo_kl`` is :math:`E|\log r|` (verl's).

``N`` counts the valid tokens of the micro-batch the loss sees (verl: the micro-batch on one
rank; here the global micro-batch). Deliberate differences from verl's
``compute_policy_loss_{clip,kl}_cov``: ``clip_cov`` draws its subset with a JAX key derived
from the batch (verl: torch's global generator), so it is deterministic for a given batch;
``kl_cov`` reports ``pg_clipfrac`` / ``pg_clipfrac_lower`` as 0 (verl reports only ``ppo_kl``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate
from rljax.loss._masked import masked_mean
from rljax.loss._policy import register_policy_loss

_sg = jax.lax.stop_gradient


def _ranks(score: jax.Array) -> jax.Array:
    """Rank of every entry of ``score`` (any shape) in descending order, 0 = largest."""
    flat = score.reshape(-1)
    order = jnp.argsort(-flat)
    return jnp.zeros_like(order).at[order].set(jnp.arange(flat.size)).reshape(score.shape)


def _count(fraction: float, n_valid: jax.Array) -> jax.Array:
    """``max(int(fraction * N), 1)`` (verl's)."""
    return jnp.maximum(jnp.floor(fraction * n_valid), 1.0)


def _batch_key(old_logp: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(jnp.sum(old_logp).astype(jnp.float32), jnp.int32)
    return jax.random.fold_in(jax.random.key(0), bits)


@register_policy_loss("clip_cov")
def _clip_cov(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
              is_weights, num_tokens, num_seqs, clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0,
              clip_cov_ub: float = 5.0):
    del clip_ratio_c
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov needs clip_cov_ratio > 0, got {clip_cov_ratio}")
    valid = mask.astype(bool)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    by_clip = (clipped > unclipped) & valid
    lp = _sg(logp)
    cov = (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))
    candidate = valid & ~by_clip & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    noise = jax.random.uniform(_batch_key(old_logp), cov.shape)
    detached = candidate & (_ranks(jnp.where(candidate, noise, -1.0)) < _count(clip_cov_ratio, jnp.sum(valid)))
    corr = 1.0 - detached.astype(jnp.float32)
    pg_losses = jnp.maximum(unclipped, clipped) * corr
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = aggregate(pg_losses, mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {"pg_clipfrac": masked_mean(1.0 - corr, mask), "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
               "ppo_kl": masked_mean(-log_ratio, mask)}
    return loss, metrics


@register_policy_loss("kl_cov")
def _kl_cov(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
            is_weights, num_tokens, num_seqs, kl_cov_ratio: float = 0.0002, ppo_kl_coef: float = 0.1):
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov needs kl_cov_ratio > 0, got {kl_cov_ratio}")
    valid = mask.astype(bool)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    n = jnp.sum(valid)
    lp, adv = _sg(logp), _sg(advantages)
    mean_adv = jnp.sum(jnp.where(valid, adv, 0.0)) / jnp.maximum(n, 1)
    mean_lp = jnp.sum(jnp.where(valid, lp, 0.0)) / jnp.maximum(n, 1)
    cov = jnp.where(valid, (adv - mean_adv) * (lp - mean_lp), -jnp.inf)
    penalised = valid & (_ranks(cov) < _count(kl_cov_ratio, n))
    pg_losses = -advantages * ratio + jnp.where(penalised, ppo_kl_coef * jnp.abs(log_ratio), 0.0)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    loss = aggregate(pg_losses, mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    zero = jnp.zeros((), jnp.float32)
    return loss, {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": masked_mean(jnp.abs(log_ratio), mask)}
