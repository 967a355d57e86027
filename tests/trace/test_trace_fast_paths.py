"""The tracer's vectorised fast paths give what their plain definitions give (issue 35 item 6:
the trace's time per step; a fast path that disagrees would change what a check sees)."""

import types

import numpy as np

from rljax.trace.groups import choose_groups
from rljax.trace.invariants import member
from rljax.trace.observers.whole_batch import traced_rows


def testmember_is_isin():
    rng = np.random.default_rng(0)
    for _ in range(500):
        values = rng.integers(0, 40, rng.integers(0, 30)).astype(np.uint64)
        pool = rng.integers(0, 40, rng.integers(0, 30)).astype(np.uint64)
        np.testing.assert_array_equal(member(values, pool), np.isin(values, pool))
    big = np.array([2 ** 63 + 5, 7], np.uint64)  # the (digest << 32 | score bits) keys use the top bit
    np.testing.assert_array_equal(member(big, np.array([2 ** 63 + 5], np.uint64)), [True, False])


def test_traced_rows_are_the_rows_of_the_chosen_groups():
    rng = np.random.default_rng(1)
    for step in range(40):
        num_groups, n = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        group_id = rng.permutation(np.repeat(np.arange(num_groups, dtype=np.int32), n))
        traj = types.SimpleNamespace(num_groups=num_groups, batch_size=len(group_id), group_id=group_id)
        cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(seed=3), trace=types.SimpleNamespace(groups=2))
        chosen = set(choose_groups(3, step, num_groups, 2))
        want = [i for i in range(len(group_id)) if int(group_id[i]) in chosen]
        got = traced_rows(cfg, step, traj)
        assert got == want and all(type(i) is int for i in got)
