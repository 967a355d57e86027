"""Clipped value-function loss for PPO's critic."""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

from rljax.loss._aggregate import aggregate, check_agg_mode
from rljax.loss._masked import masked_mean


def value_loss(
    values: chex.Array,
    old_values: chex.Array,
    returns: chex.Array,
    mask: chex.Array,
    *,
    clip_range: float = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[chex.Numeric] = None,
    num_seqs: Optional[chex.Numeric] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""PPO clipped value loss (verl's ``compute_value_loss``).

    .. math::
       L = \tfrac12\,\mathrm{agg}\Big(\max\big((v - R)^2,\;
           (\mathrm{clip}(v, v_{old} - c, v_{old} + c) - R)^2\big)\Big)

    Args:
      values: ``[B, T]`` current value predictions.
      old_values: ``[B, T]`` value predictions at rollout time.
      returns: ``[B, T]`` targets.
      mask: ``[B, T]`` loss mask.
      clip_range: ``c``.
      loss_agg_mode: see :func:`rljax.loss.aggregate`.
      num_tokens / num_seqs: global counts for micro-batch accumulation.

    Returns:
      ``(loss, {"vf_clipfrac": ...})``.
    """
    check_agg_mode(loss_agg_mode)
    if not clip_range >= 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    chex.assert_rank([values, old_values, returns, mask], 2)
    chex.assert_equal_shape([values, old_values, returns, mask])
    clipped_values = jnp.clip(values, old_values - clip_range, old_values + clip_range)
    unclipped_loss = jnp.square(values - returns)
    clipped_loss = jnp.square(clipped_values - returns)
    loss = 0.5 * aggregate(jnp.maximum(unclipped_loss, clipped_loss), mask, mode=loss_agg_mode,
                           num_tokens=num_tokens, num_seqs=num_seqs)
    clipfrac = masked_mean((clipped_loss > unclipped_loss).astype(jnp.float32), jnp.asarray(mask))
    return loss, {"vf_clipfrac": clipfrac}
