"""The update's own report of what it did (issue 35 item 2): auxiliary outputs of the jitted
update (:func:`rljax.trainer.step.make_train_step`), computed in the same program, no second pass.
``trace check`` compares them with the config and the batch (:mod:`rljax.trace.rederive`)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax import loss as rl

#: A loss function's aux metric: its aggregation applied to :func:`first_token` (summed over the
#: micro-batches of a mini-batch into the update's report, not averaged into the metrics).
AGG_PROBE = "agg_probe"


def first_token(mask: jax.Array) -> jax.Array:
    """1.0 on each row's first position with ``mask`` > 0, else 0 (``[B, T]``)."""
    on = mask > 0
    return (on & (jnp.cumsum(on, axis=-1) == 1)).astype(jnp.float32)


#: The key of the update's report in its metrics (:func:`update_report`).
REPORT = "update_report"


def micro_report(loss_mask: jax.Array, agg_probe: Optional[jax.Array]) -> dict:
    """What one micro-batch's loss consumed: rows with a loss token, loss tokens, each row's
    tokens (``[micro]``), and the loss's aggregation probe (:data:`AGG_PROBE`; 0 without one)."""
    per_row = jnp.sum(loss_mask, axis=-1).astype(jnp.float32)
    return {"rows": jnp.sum(per_row > 0).astype(jnp.float32), "tokens": jnp.sum(per_row),
            "inverse_lengths": jnp.sum(jnp.where(per_row > 0, 1.0 / jnp.maximum(per_row, 1.0), 0.0)),
            "row_tokens": per_row,
            "agg_probe": jnp.zeros((), jnp.float32) if agg_probe is None else agg_probe.astype(jnp.float32)}


def update_report(reports: list, row_tokens: jax.Array, cfg, before: jax.Array, after: jax.Array) -> dict:
    """The update's own account of what it did (aux outputs of the jitted step, no second pass):

    * ``micro_rows`` / ``micro_tokens`` ``[passes, n_micro]``: rows with a loss token and loss
      tokens of every micro-batch the loss consumed (``passes`` = epochs x mini-batches);
      ``micro_inverse_lengths``: the sum of 1 / tokens over its rows;
    * ``denominators`` ``[passes, 2]``: the mini-batch's token and row counts the loss divided by;
    * ``agg_probe`` ``[passes]``: the loss's aggregation of 1 on each row's first loss token,
      summed over the mini-batch (``token-mean``: rows / tokens; ``seq-mean-token-mean``:
      sum of 1 / length / rows; ... : which mode really ran, :func:`rljax.trace.rederive.agg_probe_expected`);
    * ``agg_mode``: the index of the update's ``loss_agg_mode`` in :data:`rljax.loss.AGGREGATION_MODES`;
    * ``row_tokens`` ``[B]``: each trajectory's loss tokens summed over the epochs, in batch order;
    * ``param_digest_before`` / ``param_digest_after`` ``[2]`` uint32: :func:`rljax._digest.param_digest`
      of the parameters the update started from (the old policy of an on-policy update) and produced.
    """
    cat = lambda k: jnp.concatenate([r[k] for r in reports])  # noqa: E731  [passes, ...]
    mode = getattr(cfg, "loss_agg_mode", None)
    return {"micro_rows": cat("rows"), "micro_tokens": cat("tokens"), "micro_inverse_lengths": cat("inverse_lengths"),
            "denominators": cat("denominators"), "agg_probe": jnp.sum(cat("agg_probe"), axis=-1),
            "agg_mode": jnp.int32(list(rl.AGGREGATION_MODES).index(mode) if mode in rl.AGGREGATION_MODES else -1),
            "row_tokens": row_tokens, "param_digest_before": before, "param_digest_after": after}
