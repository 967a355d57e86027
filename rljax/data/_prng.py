"""A small counter-based PRNG (splitmix64) for data order and synthetic examples.

Python's and NumPy's generators do not promise the same stream across releases; a
checkpointed data position must replay the same prompts after an upgrade, so the data
path hashes ``(seed, epoch, index)`` with splitmix64 instead. The scalar (Python int) and
vector (NumPy uint64) versions give identical values.
"""

from __future__ import annotations

import numpy as np

_M = (1 << 64) - 1


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def hash_ints(*values: int) -> int:
    """A 64-bit hash of a tuple of integers (negative values wrap modulo 2**64)."""
    h = 0
    for v in values:
        h = splitmix64(h ^ (int(v) & _M))
    return h


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permutation(n: int, *key: int) -> np.ndarray:
    """A permutation of ``range(n)`` determined by the integers ``key`` (int64 array)."""
    h = np.uint64(hash_ints(*key))
    with np.errstate(over="ignore"):
        keys = splitmix64_np(np.arange(n, dtype=np.uint64) ^ h)
    return np.argsort(keys, kind="stable").astype(np.int64)


def uniform_int(bound: int, *key: int) -> int:
    """An integer in ``[0, bound)`` determined by ``key``."""
    return (hash_ints(*key) * bound) >> 64
