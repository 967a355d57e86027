"""Which prompt groups the trace follows each step, and their rows (a leaf: the tracer and the fault hooks use it)."""

from __future__ import annotations

import hashlib

import numpy as np


def choose_groups(seed: int, step: int, num_groups: int, k: int) -> list[int]:
    """The ``k`` traced groups of a step: consecutive from a start drawn from ``(seed, step)``."""
    if k <= 0 or num_groups <= 0:
        return []
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little")
    start = h % num_groups
    return sorted({(start + i) % num_groups for i in range(min(k, num_groups))})


def traced_rows(cfg, step: int, traj) -> list[int]:
    """The rows of the prompt groups the tracer follows this step."""
    traced = choose_groups(cfg.trainer.seed, step, int(traj.num_groups), int(cfg.trace.groups))
    group_id = np.asarray(traj.group_id)[:int(traj.batch_size)]
    return np.nonzero(member(group_id, np.asarray(traced, dtype=group_id.dtype)))[0].tolist()


def member(values: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """``np.isin(values, pool)`` for 1-D integer arrays, by one sort and a binary search (``np.isin``'s
    general path costs several times more on a step's few hundred rows)."""
    pool = np.sort(pool)
    if not len(pool):
        return np.zeros(values.shape, bool)
    at = np.minimum(np.searchsorted(pool, values), len(pool) - 1)
    return pool[at] == values
