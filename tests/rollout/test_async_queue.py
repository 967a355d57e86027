"""The versioned trajectory queue: staleness gate, future versions, backpressure, shutdown (pure Python)."""

import threading
import time

import pytest

from rljax.rollout.queue import FutureVersionError, QueueClosed, QueueItem, TrajectoryQueue


def item(index, version, rows=2, max_version=None, uid=None):
    uid = uid or f"{index}-0"
    return QueueItem(index=index, min_version=[version] * rows,
                     max_version=[version if max_version is None else max_version] * rows, uids=[uid] * rows)


def test_fifo_and_staleness_reported():
    q = TrajectoryQueue(max_batches=3, max_staleness=2)
    q.put(item(1, 0))
    q.put(item(2, 1))
    a, b = q.get(current_version=2), q.get(current_version=2)
    assert (a.index, a.staleness, b.index, b.staleness) == (1, 2, 2, 1)
    assert q.stats.got == 2 and q.stats.dropped_stale == 0


def test_stale_rows_dropped_at_head_and_counted():
    q = TrajectoryQueue(max_batches=4, max_staleness=1)
    q.put(item(1, 0, rows=3, uid="1-0"))
    q.put(item(2, 1, rows=2, uid="2-0"))
    q.put(item(3, 3, rows=2, uid="3-0"))
    got = q.get(current_version=3)  # staleness 3 and 2 > 1: both dropped, 5 rows
    assert got.index == 3 and got.staleness == 0
    assert q.stats.dropped_stale == 5 and q.stats.dropped_stale_batches == 2
    assert q.stats.dropped_uids == [("stale", "1-0"), ("stale", "2-0")]
    assert q.stats.dropped_batches == [["stale", 1], ["stale", 2]]  # rollout_uids.jsonl's dropped_batches
    assert "dropped_batches" not in q.stats.snapshot()


def test_future_version_is_an_error_naming_the_uid():
    q = TrajectoryQueue(max_batches=2, max_staleness=1)
    q.put(item(1, 2, uid="7-3"))
    with pytest.raises(FutureVersionError, match="'7-3'.*version 2.*learner's 1"):
        q.get(current_version=1)
    # a weight push that landed mid-generation (max_version) counts too
    q = TrajectoryQueue(max_batches=2, max_staleness=1)
    q.put(item(1, 0, max_version=3, uid="9-1"))
    with pytest.raises(FutureVersionError, match="'9-1'"):
        q.get(current_version=2)
    assert q.closed


def test_block_waits_until_the_learner_takes_and_bound_holds():
    q = TrajectoryQueue(max_batches=2, max_staleness=5, overflow="block")
    q.put(item(1, 0))
    q.put(item(2, 0))
    done = threading.Event()

    def producer():
        q.put(item(3, 0))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.3)
    assert not done.is_set() and len(q) == 2  # backpressure: the producer waits
    q.get(current_version=0)
    t.join(timeout=5)
    assert done.is_set() and q.stats.max_depth == 2
    assert q.stats.rollout_wait_s >= 0.25


def test_drop_stalest_drops_the_oldest_queued_batch():
    q = TrajectoryQueue(max_batches=2, max_staleness=5, overflow="drop_stalest")
    q.put(item(1, 1, rows=4, uid="a"))
    q.put(item(2, 0, rows=3, uid="b"))  # the stalest
    q.put(item(3, 2, rows=2, uid="c"))
    assert len(q) == 2 and q.stats.max_depth == 2
    assert q.stats.dropped_overflow == 3 and q.stats.dropped_uids == [("overflow", "b")]
    assert q.stats.dropped_batches == [["overflow", 2]]
    assert [q.get(2).index, q.get(2).index] == [1, 3]


def test_drop_stalest_throttles_the_producer():
    """queue_size=1, tau=3 (the issue's case): a producer that never waits on a full queue still
    waits once queue_size batches were dropped since the learner last took one, so at most
    queue_size batches are dropped per trained batch."""
    q = TrajectoryQueue(max_batches=1, max_staleness=3, overflow="drop_stalest")
    version = [0]  # the learner's version, pushed to the producer after every update

    def producer():
        try:
            for i in range(10_000):
                q.wait_admission(lambda: version[0], timeout=10)
                q.put(item(i, version[0], rows=32))
        except QueueClosed:
            pass

    t = threading.Thread(target=producer)
    t.start()
    for _ in range(6):
        q.get(version[0], timeout=10)
        time.sleep(0.05)  # the learner trains
        version[0] += 1
        q.set_learner_version(version[0])
    time.sleep(0.05)
    q.close()
    t.join(timeout=5)
    st = q.stats
    assert st.got == 6 and st.dropped_overflow_batches <= 6 + 1, st
    assert st.put <= st.got + st.dropped_overflow_batches + 1 and st.put_rows == 32 * st.put
    assert st.dropped_overflow == 32 * st.dropped_overflow_batches


def test_bound_never_exceeded_under_concurrency():
    q = TrajectoryQueue(max_batches=3, max_staleness=100)
    depths = []

    def producer():
        for i in range(50):
            q.put(item(i, 0))

    t = threading.Thread(target=producer)
    t.start()
    for _ in range(50):
        depths.append(len(q))
        q.get(0)
    t.join(timeout=5)
    assert max(depths) <= 3 and q.stats.max_depth <= 3 and q.stats.got == 50


def test_admission_keeps_the_producer_within_tau():
    q = TrajectoryQueue(max_batches=4, max_staleness=1)
    sampler_version = [0]
    q.wait_admission(lambda: sampler_version[0], timeout=1)  # batch 1, consumed at version 0
    q.put(item(1, 0))
    q.wait_admission(lambda: sampler_version[0], timeout=1)  # batch 2, consumed at version 1: staleness 1
    q.put(item(2, 0))
    with pytest.raises(TimeoutError):  # batch 3 would be consumed at version 2 with weights 0
        q.wait_admission(lambda: sampler_version[0], timeout=0.2)
    q.get(0)
    q.set_learner_version(1)
    sampler_version[0] = 1  # the learner pushed version 1
    q.wait_admission(lambda: sampler_version[0], timeout=1)
    # tau = 0: strictly alternating, the synchronous schedule
    q0 = TrajectoryQueue(max_batches=2, max_staleness=0)
    q0.wait_admission(lambda: 0, timeout=1)
    with pytest.raises(TimeoutError):
        q0.wait_admission(lambda: 0, timeout=0.1)
    q0.put(item(1, 0))
    q0.get(0)  # the learner trains batch 1: batch 2 waits for its weights (version 1), not for the queue
    with pytest.raises(TimeoutError):
        q0.wait_admission(lambda: 0, timeout=0.1)
    q0.set_learner_version(1)
    q0.wait_admission(lambda: 1, timeout=1)


def test_close_wakes_both_sides_and_learner_gets_the_producer_error():
    q = TrajectoryQueue(max_batches=1, max_staleness=0)
    errors = []

    def learner():
        try:
            q.get(0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=learner)
    t.start()
    time.sleep(0.1)
    q.close(RuntimeError("reward failed on 3 of 8 samples"))
    t.join(timeout=2)
    assert not t.is_alive() and str(errors[0]) == "reward failed on 3 of 8 samples"
    with pytest.raises(QueueClosed):
        q.put(item(1, 0))
    # queued batches do not hide the error
    q = TrajectoryQueue(max_batches=2, max_staleness=0)
    q.put(item(1, 0))
    q.close(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        q.get(0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="overflow is 'drop'; accepted: block, drop_stalest"):
        TrajectoryQueue(1, 0, "drop")
    with pytest.raises(ValueError, match="max_batches is 0"):
        TrajectoryQueue(0, 0)
    with pytest.raises(ValueError, match="max_staleness is -1"):
        TrajectoryQueue(1, -1)


def test_drop_stalest_throttle_does_not_deadlock_when_the_gate_empties_the_queue():
    """tau=0, queue_size=1: an overflow drop throttles the producer until the learner takes a batch;
    when the learner's gate then drops the queued batch as stale, nothing is left to take. The
    throttle must let the producer go on (before the fix both sides waited for the other)."""
    q = TrajectoryQueue(max_batches=1, max_staleness=0, overflow="drop_stalest")
    q.put(item(1, 0, uid="a"))
    q.put(item(2, 0, uid="b"))  # full: "a" dropped for overflow; the producer is now throttled
    assert q.stats.dropped_overflow_batches == 1
    q.set_learner_version(1)  # the learner has trained once more and pushed version 1
    got, errors = [], []

    def learner():  # at version 1, "b" (version 0) is too stale: dropped, then the learner waits for data
        try:
            got.append(q.get(current_version=1, timeout=5))
        except BaseException as e:  # noqa: BLE001 -- reported by the assertions below
            errors.append(e)

    t = threading.Thread(target=learner)
    t.start()
    time.sleep(0.2)  # the learner has dropped "b" and waits on an empty queue
    q.wait_admission(lambda: 1, timeout=5)  # the producer, with the version-1 weights, starts the next batch
    q.put(item(3, 1, uid="c"))
    t.join(timeout=10)
    assert not t.is_alive() and not errors, errors
    assert got[0].index == 3 and got[0].staleness == 0
    assert q.stats.dropped_uids == [("overflow", "a"), ("stale", "b")]


def test_streaming_admission_is_the_same_rule_per_prompt():
    """``admits(ahead, version)`` (the streaming producer's non-blocking gate) answers as
    ``wait_admission`` would for a batch with ``ahead`` batches in flight before it."""
    q = TrajectoryQueue(max_batches=4, max_staleness=1)
    assert q.admits(0, 0) and q.admits(1, 0)  # batches 1 and 2 with weights 0: consumed at versions 0 and 1
    assert not q.admits(2, 0)  # batch 3 would be consumed at version 2: staleness 2 > tau
    q.put(item(1, 0))  # batch 1 queued: batch 2 has none in flight before it, batch 3 has batch 2
    assert q.admits(0, 0) and not q.admits(1, 0)
    q.get(0)  # the learner trains batch 1: the consumed-at versions stay; the push of version 1 admits batch 3
    assert not q.admits(1, 0) and q.admits(1, 1)
    q0 = TrajectoryQueue(max_batches=2, max_staleness=0)
    assert q0.admits(0, 0) and not q0.admits(1, 0)  # tau=0: batch 2 waits for the weights batch 1 trains
    q0.close()
    with pytest.raises(QueueClosed):
        q0.admits(0, 0)
