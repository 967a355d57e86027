"""Staleness rules for asynchronous / off-policy RL.

A trajectory sampled with weight version ``v`` and trained at learner version ``c`` has
staleness ``c - v``. A sample can never come from a future version (that means weight
versions got mixed up); samples staler than ``max_staleness`` are dropped and counted.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp


def policy_staleness(current_version: int, sample_version: int) -> int:
    """``current_version - sample_version``; ``ValueError`` if the sample is from a future version."""
    current, sample = int(current_version), int(sample_version)
    if sample > current:
        raise ValueError(
            "sample cannot come from a future policy "
            f"(sample version {sample} > current version {current})"
        )
    return current - sample


def staleness_gate(current_version: int, sample_version: int, *, max_staleness: int) -> tuple[int, bool]:
    """Host-side rule for one batch: ``(staleness, keep)``, ``keep`` when ``staleness <= max_staleness``.

    ``staleness = current_version - sample_version`` (:func:`policy_staleness`: a
    ``ValueError`` for a future version). The asynchronous queue's gate
    (:meth:`rljax.rollout.queue.TrajectoryQueue.get`) drops a batch that is not kept;
    :func:`staleness_filter` is the same rule per row, jitted.
    """
    staleness = policy_staleness(current_version, sample_version)
    return staleness, staleness <= int(max_staleness)


class StalenessReport(NamedTuple):
    """Result of :func:`staleness_filter` (a pytree; every field is an array)."""

    keep: jax.Array  # [B] bool: rows to train on
    staleness: jax.Array  # [B] int32: current - sample
    future: jax.Array  # [B] bool: rows from a future version (a bug upstream: raise)
    num_dropped: jax.Array  # int32: rows dropped for being too stale
    num_future: jax.Array  # int32: rows from a future version


def staleness_filter(sample_versions: chex.Array, *, current_version, max_staleness: int) -> StalenessReport:
    """Vectorised staleness gate, jittable.

    A row is kept when ``0 <= current_version - sample_version <= max_staleness``. Rows from
    a future version are reported in ``future`` / ``num_future`` (a jitted function cannot
    raise; the caller must, see :func:`raise_on_future`) and are never kept.

    Args:
      sample_versions: ``[B]`` int, the (oldest) weight version each trajectory saw.
      current_version: the learner's version (int or int scalar array).
      max_staleness: the largest accepted staleness (>= 0).

    Returns:
      A :class:`StalenessReport`.
    """
    if int(max_staleness) < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    chex.assert_rank(sample_versions, 1)
    chex.assert_type(sample_versions, int)
    staleness = (jnp.asarray(current_version) - jnp.asarray(sample_versions)).astype(jnp.int32)
    future = staleness < 0
    too_stale = staleness > max_staleness
    return StalenessReport(
        keep=~future & ~too_stale,
        staleness=staleness,
        future=future,
        num_dropped=jnp.sum(too_stale).astype(jnp.int32),
        num_future=jnp.sum(future).astype(jnp.int32),
    )


def raise_on_future(report: StalenessReport) -> None:
    """Host-side: raise the staleness ``ValueError`` if any row came from a future version."""
    n = int(report.num_future)
    if n:
        raise ValueError(f"sample cannot come from a future policy ({n} rows newer than the learner)")
