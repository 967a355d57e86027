"""Which prompt groups the trace follows each step (a leaf: the tracer and the fault hooks use it)."""

from __future__ import annotations

import hashlib


def choose_groups(seed: int, step: int, num_groups: int, k: int) -> list[int]:
    """The ``k`` traced groups of a step: consecutive from a start drawn from ``(seed, step)``."""
    if k <= 0 or num_groups <= 0:
        return []
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little")
    start = h % num_groups
    return sorted({(start + i) % num_groups for i in range(min(k, num_groups))})
