"""Clipped policy-gradient losses (PPO / GRPO / GSPO / CISPO), registered by name.

Every loss has the signature of :func:`policy_loss` minus ``mode`` and returns
``(loss, metrics)``. Semantics follow verl's ``core_algos.py`` (``compute_policy_loss_*``),
including the aggregation verl forces for a mode (GSPO always aggregates
``seq-mean-token-mean``). Add a mode with :func:`register_policy_loss`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import chex
import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate, check_agg_mode
from rljax.loss._masked import masked_mean
from rljax.loss._registry import Registry

PolicyLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
_POLICY_LOSSES = Registry("policy loss mode")

LOG_RATIO_CLAMP = 20.0


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name`` (usable as ``policy_loss(mode=name)``).

    The function receives ``(logp, old_logp, advantages, mask)`` with ``advantages``
    already broadcast to ``[B, T]`` and ``is_weights`` already gradient-stopped, plus the
    keyword hyper-parameters of :func:`policy_loss`; it returns ``(loss, metrics)``.
    """

    return _POLICY_LOSSES.register(name)


def registered_policy_losses() -> tuple[str, ...]:
    """The names :func:`policy_loss` accepts as ``mode``, sorted."""
    return tuple(sorted(_POLICY_LOSSES.names()))


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as ``name``; ``ValueError`` listing the known modes otherwise."""
    return _POLICY_LOSSES.get(name)


def policy_loss(
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    mode: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Optional[chex.Array] = None,
    num_tokens: Optional[chex.Numeric] = None,
    num_seqs: Optional[chex.Numeric] = None,
    **options,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Policy-gradient loss of the registered ``mode``.

    ``vanilla`` is dual-clip PPO (Schulman et al. 2017; Ye et al. 2020, arXiv:1912.09729):

    .. math::
       r = \exp(\mathrm{clip}(\log\pi - \log\pi_{old}, \pm 20)), \quad
       L_1 = \max(-A r,\; -A\,\mathrm{clip}(r, 1-\epsilon_l, 1+\epsilon_h)), \quad
       L = \begin{cases} \min(L_1, -A c) & A < 0 \\ L_1 & A \ge 0 \end{cases}

    (``clip_ratio_c=None`` turns the dual clip off), aggregated with ``loss_agg_mode``.
    ``gspo`` uses the sequence-level ratio of Zheng et al. 2025 (arXiv:2507.18071) and is
    always aggregated ``seq-mean-token-mean``; ``cispo`` is
    :math:`-\mathrm{sg}(\mathrm{clip}(r))\,A\log\pi` (MiniMax 2025, arXiv:2506.13585).

    Args:
      logp: ``[B, T]`` log-probs of the taken tokens under the current policy.
      old_logp: ``[B, T]`` log-probs under the policy that the advantages belong to.
      advantages: ``[B]`` (broadcast over the response) or ``[B, T]``.
      mask: ``[B, T]`` loss mask: 1 on tokens the policy generated; 0 on prompt, tool
        observations and padding. Masked tokens contribute no loss and no gradient.
      mode: a registered policy loss (``vanilla``, ``gspo``, ``cispo`` or your own).
      clip_ratio_low / clip_ratio_high: the PPO clip range ``[1 - low, 1 + high]``.
      clip_ratio_c: dual-clip bound (> 1) for negative advantages; ``None`` disables it.
      loss_agg_mode: see :func:`rljax.loss.aggregate`.
      is_weights: optional ``[B, T]`` importance weights (rollout correction); gradient is
        stopped; they multiply the per-token loss.
      num_tokens / num_seqs: global counts of the mini-batch (micro-batch accumulation).
      **options: the mode's own hyper-parameters (verl's names: ``tau_pos`` / ``tau_neg`` of
        ``sapo``, ``clip_cov_*`` of ``clip_cov``, ...); :func:`policy_loss_options` lists them.

    Returns:
      ``(loss, metrics)``; metrics hold ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
      (and what the mode adds, e.g. ``rollout_corr/*`` of ``bypass_mode``).
    """
    fn = get_policy_loss(mode)
    unknown = sorted(set(options) - set(policy_loss_options(mode)))
    if unknown:
        accepted = ", ".join(policy_loss_options(mode)) or "none"
        raise ValueError(f"policy loss {mode!r} takes no option {', '.join(unknown)}; its options: {accepted}")
    check_agg_mode(loss_agg_mode)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 (dual-clip lower bound) or None, got {clip_ratio_c}")
    if not (clip_ratio_low >= 0.0 and clip_ratio_high >= 0.0):
        raise ValueError(
            f"clip ratios must be >= 0, got clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}"
        )
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    chex.assert_rank(advantages, {1, 2})
    if advantages.ndim == 1:
        chex.assert_equal_shape_prefix([advantages, logp], 1)
        advantages = jnp.broadcast_to(advantages[:, None], logp.shape)
    else:
        chex.assert_equal_shape([advantages, logp])
    mask = jnp.asarray(mask)
    valid = mask.astype(bool)
    # Sanitise masked positions first (the "double where"): a -inf log-prob on a tool
    # observation or padding must not turn into NaN in a gradient that is multiplied by 0.
    logp = jnp.where(valid, logp, 0.0)
    old_logp = jnp.where(valid, old_logp, 0.0)
    advantages = jnp.where(valid, advantages, 0.0)
    if is_weights is not None:
        chex.assert_equal_shape([is_weights, logp])
        is_weights = jax.lax.stop_gradient(jnp.where(valid, is_weights, 0.0))
    return fn(
        logp,
        old_logp,
        advantages,
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        is_weights=is_weights,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        **options,
    )


#: Keywords every registered loss receives from :func:`policy_loss`; the others are its options.
COMMON_KEYWORDS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "is_weights", "num_tokens",
                   "num_seqs")


def policy_loss_options(mode: str) -> dict[str, Any]:
    """``{option: default}`` of the registered loss ``mode``: its keyword-only hyper-parameters
    beyond :data:`COMMON_KEYWORDS` (``{}`` for ``vanilla``; ``tau_pos``, ``tau_neg`` for ``sapo``)."""
    params = inspect.signature(get_policy_loss(mode)).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name not in COMMON_KEYWORDS}


def _weighted(pg_losses, is_weights):
    return pg_losses if is_weights is None else pg_losses * is_weights


def _metrics(clipfrac, clipfrac_lower, ppo_kl):
    return {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}


@register_policy_loss("vanilla")
def _vanilla(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
             loss_agg_mode, is_weights, num_tokens, num_seqs):
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)

    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = jnp.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).astype(jnp.float32), mask)

    if clip_ratio_c is None:
        pg_losses = clip_losses
        clipfrac_lower = jnp.zeros((), jnp.float32)
    else:
        dual = -advantages * clip_ratio_c
        negative = advantages < 0
        clipfrac_lower = masked_mean(((clip_losses > dual) & negative).astype(jnp.float32), mask)
        pg_losses = jnp.where(negative, jnp.minimum(dual, clip_losses), clip_losses)

    loss = aggregate(_weighted(pg_losses, is_weights), mask, mode=loss_agg_mode,
                     num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, _metrics(clipfrac, clipfrac_lower, ppo_kl)


@register_policy_loss("gspo")
def _gspo(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
          loss_agg_mode, is_weights, num_tokens, num_seqs):
    del clip_ratio_c, loss_agg_mode  # GSPO has no dual clip and always aggregates per sequence.
    log_ratio = logp - old_logp
    mask_f = mask.astype(jnp.float32)
    lengths = jnp.maximum(jnp.sum(mask_f, axis=-1), 1.0)
    seq_log_ratio = jnp.sum(jnp.where(mask, log_ratio, 0.0), axis=-1) / lengths
    # s_{i,t} = sg(s_i) * pi_t / sg(pi_t): the value of the sequence ratio, the gradient of the token.
    log_token_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(log_token_ratio, 10.0))

    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = jnp.maximum(unclipped, clipped)
    loss = aggregate(_weighted(pg_losses, is_weights), mask, mode="seq-mean-token-mean",
                     num_tokens=num_tokens, num_seqs=num_seqs)
    clipfrac = masked_mean((clipped > unclipped).astype(jnp.float32), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(clipfrac, jnp.zeros((), jnp.float32), ppo_kl)


@register_policy_loss("cispo")
def _cispo(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_ratio_c,
           loss_agg_mode, is_weights, num_tokens, num_seqs):
    del clip_ratio_c
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -jax.lax.stop_gradient(clipped_ratio) * advantages * logp
    loss = aggregate(_weighted(pg_losses, is_weights), mask, mode=loss_agg_mode,
                     num_tokens=num_tokens, num_seqs=num_seqs)
    clipfrac = masked_mean((ratio != clipped_ratio).astype(jnp.float32), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return loss, _metrics(clipfrac, jnp.zeros((), jnp.float32), ppo_kl)
