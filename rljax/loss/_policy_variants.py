r"""verl's other policy losses: DPPO (TV / KL), SAPO, GPG, GMPO (``geo_mean``) and DRO.

Registered under verl's ``policy_loss.loss_mode`` names; called as
``policy_loss(..., mode=name, **options)``, which checks shapes, broadcasts ``[B]``
advantages and zeroes masked positions first (see :func:`rljax.loss.policy_loss`). Each
follows ``compute_policy_loss_<name>`` of verl's ``core_algos.py``; with
:math:`\log r = \log\pi - \log\pi_{old}`, :math:`A` the advantage, :math:`\mathrm{sg}` stop-gradient:

* ``dppo_tv`` / ``dppo_kl`` (Divergence PPO, arXiv:2602.04879; prime-rl's default): instead
  of clipping the ratio, a token whose probability moved too far leaves the gradient:
  :math:`L = -A\,\mathrm{sg}(\min(r, c))\,\log\pi\,v`, with ``c`` = ``clip_ratio_c`` and
  :math:`v \in \{0, 1\}` (no gradient). ``dppo_tv``: :math:`v = [\pi - \pi_{old} \le \epsilon_h]`
  for :math:`A > 0`, :math:`[\pi - \pi_{old} \ge -\epsilon_l]` otherwise. ``dppo_kl``: with the
  binary KL :math:`D = p_o(\log p_o - \log p) + (1-p_o)\log\frac{1-p_o+10^{-8}}{1-p+10^{-8}}`,
  :math:`v = [D \le \epsilon_h] \lor [p \le p_o]` for :math:`A > 0`,
  :math:`[D \le \epsilon_l] \lor [p \ge p_o]` otherwise. ``clip_ratio_low`` / ``_high`` are the
  divergence thresholds here. ``pg_clipfrac`` is the fraction of tokens with :math:`v = 0`,
  ``pg_clipfrac_lower`` that of kept tokens whose ratio was truncated.
* ``sapo`` (Soft Adaptive Policy Optimisation, arXiv:2511.20347): a smooth gate instead of
  the clip, :math:`L = -\frac{4}{\tau}\sigma(\tau(r-1))\,A`, :math:`\tau` = ``tau_pos`` for
  :math:`A > 0`, ``tau_neg`` otherwise; always aggregated ``seq-mean-token-mean`` (as verl).
* ``gpg`` (Group Policy Gradient, arXiv:2504.02546): plain REINFORCE, :math:`L = -A\log\pi`.
* ``geo_mean`` (GMPO, arXiv:2507.20673): the geometric mean of token ratios clipped in log
  space, per sequence: :math:`\ell_t = \mathrm{sgn}(A)\min(\mathrm{sgn}(A)\log r_t,
  \mathrm{sgn}(A)\,\mathrm{clip}(\log r_t, -\epsilon_l, \epsilon_h))`,
  :math:`L_i = -\bar A_i \exp(\sum_t m_t\ell_t / (|y_i| + 10^{-8}))` with :math:`\bar A_i` the
  sequence's mean advantage; IS weights enter as their per-sequence geometric mean;
  ``loss_agg_mode`` is not read (as verl).
* ``dro`` (Direct Reward Optimisation): :math:`L = -(A\log\pi - \tfrac{\beta}{2}(\log r)^2)`,
  :math:`\beta` = ``dro_beta`` (required, > 0).

Deliberate differences from verl:

* Every loss reports ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` (the trainer logs
  the three): where verl's function returns fewer (``gpg`` none, ``dro`` only ``ppo_kl``), a
  clip fraction of a loss that does not clip is 0 and ``ppo_kl`` is
  :math:`E[-\log r]` as everywhere.
* ``geo_mean`` averages over the sequences with at least one valid token, normalised by the
  mini-batch's global sequence count (``num_seqs``) so micro-batches add up; verl's
  ``torch.mean`` also counts padding rows.
* ``dppo_*`` with ``clip_ratio_c=None`` does not truncate the ratio (verl always does, 3.0
  by default from the actor config).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate
from rljax.loss._masked import masked_mean, masked_sum
from rljax.loss._policy import LOG_RATIO_CLAMP, register_policy_loss

_sg = jax.lax.stop_gradient


def _zero():
    return jnp.zeros((), jnp.float32)


def _metrics(clipfrac, clipfrac_lower, ppo_kl):
    return {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}


def _agg(pg_losses, mask, is_weights, *, loss_agg_mode, num_tokens, num_seqs):
    weighted = pg_losses if is_weights is None else pg_losses * is_weights
    return aggregate(weighted, mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)


def _dppo(logp, old_logp, advantages, mask, valid, *, clip_ratio_c, loss_agg_mode, is_weights, num_tokens, num_seqs):
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    cap = jnp.inf if clip_ratio_c is None else clip_ratio_c
    valid = _sg(valid.astype(jnp.float32))
    pg_losses = -advantages * _sg(jnp.minimum(ratio, cap)) * logp * valid
    loss = _agg(pg_losses, mask, is_weights, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    clipfrac = masked_mean(1.0 - valid, mask)
    clipfrac_lower = masked_mean((ratio > cap).astype(jnp.float32) * valid, mask)
    return loss, _metrics(clipfrac, clipfrac_lower, masked_mean(-log_ratio, mask))


@register_policy_loss("dppo_tv")
def _dppo_tv(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
             is_weights, num_tokens, num_seqs):
    moved = jnp.exp(logp) - jnp.exp(old_logp)
    valid = jnp.where(advantages > 0, moved <= clip_ratio_high, moved >= -clip_ratio_low)
    return _dppo(logp, old_logp, advantages, mask, valid, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                 is_weights=is_weights, num_tokens=num_tokens, num_seqs=num_seqs)


@register_policy_loss("dppo_kl")
def _dppo_kl(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
             is_weights, num_tokens, num_seqs):
    p, p_old = jnp.exp(logp), jnp.exp(old_logp)
    binary_kl = p_old * (old_logp - logp) + (1.0 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = jnp.where(advantages > 0, (binary_kl <= clip_ratio_high) | (p <= p_old),
                      (binary_kl <= clip_ratio_low) | (p >= p_old))
    return _dppo(logp, old_logp, advantages, mask, valid, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                 is_weights=is_weights, num_tokens=num_tokens, num_seqs=num_seqs)


@register_policy_loss("sapo")
def _sapo(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
          is_weights, num_tokens, num_seqs, tau_pos: float = 1.0, tau_neg: float = 1.05):
    del clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode  # SAPO gates instead and aggregates per sequence
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo needs tau_pos > 0 and tau_neg > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gates = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss = _agg(-gates * advantages, mask, is_weights, loss_agg_mode="seq-mean-token-mean", num_tokens=num_tokens,
                num_seqs=num_seqs)
    return loss, _metrics(_zero(), _zero(), masked_mean(-log_ratio, mask))


@register_policy_loss("gpg")
def _gpg(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
         is_weights, num_tokens, num_seqs):
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    loss = _agg(-logp * advantages, mask, is_weights, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
                num_seqs=num_seqs)
    return loss, _metrics(_zero(), _zero(), masked_mean(old_logp - logp, mask))


@register_policy_loss("geo_mean")
def _geo_mean(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
              is_weights, num_tokens, num_seqs):
    del clip_ratio_c, loss_agg_mode, num_tokens  # GMPO is a mean over sequences whatever the mode
    maskf = mask.astype(jnp.float32)
    log_ratio = logp - old_logp
    sign = jnp.sign(advantages)
    clamped = jnp.clip(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * clamped)
    lengths = jnp.sum(maskf, axis=-1) + 1e-8
    ratio = jnp.exp(masked_sum(pessimistic, maskf, axis=-1) / lengths)
    seq_losses = -(masked_sum(advantages, maskf, axis=-1) / lengths) * ratio
    if is_weights is not None:
        seq_losses = seq_losses * jnp.exp(masked_sum(jnp.log(is_weights + 1e-10), maskf, axis=-1) / lengths)
    rows = (jnp.sum(maskf, axis=-1) > 0).astype(jnp.float32)
    count = jnp.sum(rows) if num_seqs is None else jnp.asarray(num_seqs, jnp.float32)
    loss = jnp.where(count > 0, jnp.sum(seq_losses * rows) / jnp.maximum(count, 1e-8), 0.0)
    clipped = (log_ratio != clamped).astype(jnp.float32)
    clipfrac = masked_mean(clipped * (advantages > 0), mask)
    clipfrac_lower = masked_mean(clipped * (advantages < 0), mask)
    return loss, _metrics(clipfrac, clipfrac_lower, masked_mean(-log_ratio, mask))


@register_policy_loss("dro")
def _dro(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode,
         is_weights, num_tokens, num_seqs, dro_beta: Optional[float] = None):
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(f"policy loss 'dro' needs dro_beta > 0 (actor.dro_beta), got {dro_beta}")
    log_ratio = logp - old_logp
    pg_losses = -(logp * advantages - 0.5 * dro_beta * jnp.square(log_ratio))
    loss = _agg(pg_losses, mask, is_weights, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, _metrics(_zero(), _zero(), masked_mean(-log_ratio, mask))
