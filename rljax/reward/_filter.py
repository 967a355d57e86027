"""DAPO's dynamic sampling, the pure part: which prompt groups carry a learning signal.

A group whose ``rollout.n`` samples all have the same value of the filter metric (all
right, all wrong) gets zero GRPO advantage everywhere: DAPO (arXiv:2503.14476, sec. 3.2)
drops it and samples more prompts until the batch is full. verl's rule
(``algorithm.filter_groups``, ``RayDAPOTrainer.fit``): keep a group when the population
standard deviation of its metric values is > 0, or when it has a single sample.

Pure NumPy; the trainer's loop (:mod:`rljax.trainer.dynamic_sampling`) draws the batches.
"""

from __future__ import annotations

import numpy as np

#: ``algorithm.filter_groups.metric`` values: ``acc`` is the task reward before shaping (the
#: overlong penalty); ``score`` / ``seq_reward`` / ``seq_final_reward`` the reward after it (with
#: no KL in the reward the three are the same number in verl too).
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def groups_to_keep(values, group_id, num_groups: int, *, real=None) -> tuple[np.ndarray, np.ndarray]:
    """``(keep [G] bool, std [G] float64)`` of the ``num_groups`` prompt groups of a batch.

    Args:
      values: ``[B]`` the filter metric of each trajectory.
      group_id: ``[B]`` the dense group index (``0 .. num_groups - 1``) of each trajectory.
      num_groups: the number of groups ``G``.
      real: ``[B]`` bool, rows that count (padding rows are ignored); default all.

    A group is kept when its values' population standard deviation is > 0 or it has exactly
    one (real) sample; a group with no real row is not kept.
    """
    values = np.asarray(values, np.float64)
    group_id = np.asarray(group_id)
    real = np.ones(values.shape, bool) if real is None else np.asarray(real, bool)
    if values.shape != group_id.shape or values.shape != real.shape or values.ndim != 1:
        raise ValueError(f"values {values.shape}, group_id {group_id.shape} and real {real.shape} must be one [B] shape")
    gid, v = group_id[real], values[real]
    if gid.size and (gid.min() < 0 or gid.max() >= num_groups):
        raise ValueError(f"group ids must be in [0, {num_groups}), got {gid.min()}..{gid.max()}")
    count = np.bincount(gid, minlength=num_groups).astype(np.float64)
    mean = np.bincount(gid, v, minlength=num_groups) / np.maximum(count, 1)
    var = np.bincount(gid, (v - mean[gid]) ** 2, minlength=num_groups) / np.maximum(count, 1)
    std = np.sqrt(var)
    return (std > 0) | (count == 1), std


def filter_values(metric: str, task, shaped, report=None) -> np.ndarray:
    """``[B]`` the values ``algorithm.filter_groups.metric`` reads: for ``acc`` the ``acc`` a reward
    returning verl's dict gave (:meth:`~rljax.reward.RewardReport.extra_values`; the task score on
    rows without one), else the shaped score."""
    if metric != "acc":
        return np.asarray(shaped)
    task = np.asarray(task, np.float64)
    acc = report.extra_values("acc", len(task)) if report is not None else None
    return task if acc is None else np.where(np.isnan(acc), task, acc)
