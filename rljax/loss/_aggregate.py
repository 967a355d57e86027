"""Loss aggregation: turning a ``[B, T]`` loss matrix into the scalar that is differentiated.

Semantics follow verl's ``agg_loss``. The one difference is structural: verl multiplies by
``dp_size`` because DDP/FSDP *average* gradients over ranks; rljax computes one global-view
loss under ``jit`` on a sharded batch, so no such factor exists here. What carries over is
the reason for it: pass the *global* ``num_tokens`` / ``num_seqs`` of the mini-batch when
aggregating a micro-batch, and the sum of the micro-batch losses equals the loss of the
whole mini-batch (so gradient accumulation does not depend on the micro-batch size).
"""

from __future__ import annotations

from typing import Callable, Optional

import chex
import jax
import jax.numpy as jnp

from rljax.loss._masked import masked_sum

Aggregator = Callable[..., jax.Array]


def _safe_div(numerator: jax.Array, denominator) -> jax.Array:
    """``numerator / denominator``, and 0 where the denominator is 0 (no NaN in value or grad)."""
    denominator = jnp.asarray(denominator, dtype=numerator.dtype)
    ok = denominator > 0
    return jnp.where(ok, numerator / jnp.where(ok, denominator, 1.0), 0.0)


def _seq_mask(mask: jax.Array) -> jax.Array:
    """``[B]`` float: 1 for sequences with at least one valid token."""
    return (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)


def _token_mean(loss_mat, mask, *, num_tokens, num_seqs, horizon):
    del num_seqs, horizon
    total = masked_sum(loss_mat, mask)
    if num_tokens is None:
        num_tokens = jnp.sum(mask.astype(total.dtype))
    return _safe_div(total, num_tokens)


def _token_sum(loss_mat, mask, *, num_tokens, num_seqs, horizon):
    del num_tokens, num_seqs, horizon
    return masked_sum(loss_mat, mask)


def _seq_mean(seq_losses, mask, num_seqs):
    seq_mask = _seq_mask(mask)
    if num_seqs is None:
        num_seqs = jnp.sum(seq_mask)
    return _safe_div(masked_sum(seq_losses, seq_mask), num_seqs)


def _seq_mean_token_sum(loss_mat, mask, *, num_tokens, num_seqs, horizon):
    del num_tokens, horizon
    return _seq_mean(masked_sum(loss_mat, mask, axis=-1), mask, num_seqs)


def _seq_mean_token_sum_norm(loss_mat, mask, *, num_tokens, num_seqs, horizon):
    del num_tokens
    if horizon is None:
        horizon = loss_mat.shape[-1]
    return _seq_mean(masked_sum(loss_mat, mask, axis=-1), mask, num_seqs) / horizon


def _seq_mean_token_mean(loss_mat, mask, *, num_tokens, num_seqs, horizon):
    del num_tokens, horizon
    counts = jnp.sum(mask.astype(loss_mat.dtype), axis=-1)
    seq_losses = masked_sum(loss_mat, mask, axis=-1) / (counts + 1e-8)
    return _seq_mean(seq_losses, mask, num_seqs)


AGGREGATION_MODES: dict[str, Aggregator] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def check_agg_mode(mode: str) -> None:
    """Raise ``ValueError`` naming the accepted modes when ``mode`` is unknown."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {mode!r}; accepted: {', '.join(AGGREGATION_MODES)}"
        )


def aggregate(
    loss_mat: chex.Array,
    mask: chex.Array,
    *,
    mode: str,
    num_tokens: Optional[chex.Numeric] = None,
    num_seqs: Optional[chex.Numeric] = None,
    horizon: Optional[chex.Numeric] = None,
) -> jax.Array:
    r"""Aggregate a per-token loss matrix into a scalar.

    With :math:`m` the mask, :math:`\ell` the loss matrix, :math:`N` = ``num_tokens``
    (default :math:`\sum m`) and :math:`S` = ``num_seqs`` (default: sequences with at least
    one valid token):

    * ``token-mean``: :math:`\sum_{b,t} m\ell / N`
    * ``token-sum``: :math:`\sum_{b,t} m\ell`
    * ``seq-mean-token-sum``: :math:`\sum_b \sum_t m\ell / S`
    * ``seq-mean-token-mean``: :math:`\sum_b (\sum_t m\ell / (\sum_t m + 10^{-8})) / S`
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``horizon`` (default ``T``)

    Sequences with no valid token do not count towards :math:`S`. An empty batch gives 0,
    never NaN.

    Args:
      loss_mat: ``[B, T]`` float.
      mask: ``[B, T]`` bool or float (the loss mask).
      mode: one of ``AGGREGATION_MODES``.
      num_tokens: global valid-token count of the batch this slice belongs to.
      num_seqs: global valid-sequence count of the batch this slice belongs to.
      horizon: normaliser of ``seq-mean-token-sum-norm``; keep it constant across training.

    Returns:
      A float scalar.
    """
    check_agg_mode(mode)
    chex.assert_rank(loss_mat, 2)
    chex.assert_equal_shape([loss_mat, mask])
    return AGGREGATION_MODES[mode](
        loss_mat, jnp.asarray(mask), num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon
    )
