"""The versioned, bounded trajectory queue of asynchronous training (thread-safe).

The rollout side :meth:`~TrajectoryQueue.put` s complete, immutable batches of prompt
groups, each tagged with the weight versions its trajectories saw (``min_version``: the
oldest, the version of the prompt's prefill; ``max_version``: the newest, later than
``min_version`` only when a weight push landed mid-generation). The learner
:meth:`~TrajectoryQueue.get` s them at its current version ``v``:

* **staleness gate** (the seed's rule, :func:`rljax.loss.staleness_gate`): ``staleness = v -
  min_version``. A batch with staleness ``> max_staleness`` is dropped at the head of the queue and its rows are
  counted (:attr:`QueueStats.dropped_stale`); a batch with ``max_version > v`` claims a
  future version: :class:`FutureVersionError` names the first such uid and the run stops.
* **backpressure**: the queue holds at most ``max_batches`` batches. When it is full the
  producer waits (``overflow="block"``) or the stalest queued batch is dropped and its rows
  counted (``overflow="drop_stalest"``, :attr:`QueueStats.dropped_overflow`). The bound is
  never exceeded (:attr:`QueueStats.max_depth`). ``drop_stalest`` throttles: once
  ``max_batches`` batches were dropped for overflow since the learner last took one, the
  producer waits for admission until the learner takes the next (or until the queue is
  empty: when the gate drops the queued batches as stale the learner waits for data, and
  holding the producer then would stop both sides), so it runs at most
  ``max_batches`` batches beyond what τ admits and at most ``max_batches`` batches are
  dropped per trained batch (without it a fast producer would generate and drop without
  end while the learner trains).
* **version admission** (:meth:`wait_admission`): before it starts a batch, the producer
  waits until the batch can be trained within the bound: the learner version at which it
  will be consumed (``learner_version + batches ahead of it``) minus the weight version it
  will be sampled with is at most ``max_staleness``. So the rollout side never runs more
  than ``max_staleness`` versions ahead of what the learner accepts, and with
  ``max_staleness=0`` the schedule is exactly the synchronous one.
* **shutdown**: :meth:`close` wakes every waiter; after ``close(error)`` the learner's
  ``get`` raises the producer's error, and the producer's ``put`` / ``wait_admission``
  raise :class:`QueueClosed`.

Times spent waiting are accumulated: ``learner_wait_s`` (learner idle, waiting for data)
and ``rollout_wait_s`` (producer blocked by backpressure or waiting for weights).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from rljax.loss import staleness_gate

OVERFLOW_MODES = ("block", "drop_stalest")


class FutureVersionError(ValueError):
    """A trajectory claims a weight version newer than the learner's: versions got mixed up."""


class QueueClosed(RuntimeError):
    """The queue was closed (the run is stopping)."""


@dataclasses.dataclass
class QueueItem:
    """One complete batch of prompt groups, as the rollout side produced it.

    ``min_version`` / ``max_version`` are per row; ``uids`` names the prompt group of each
    row (for the error message and the trace). ``payload`` is whatever the schedule carries
    (the producer's stage outputs); the queue never looks inside it.
    """

    index: int  # the producer's batch counter
    min_version: Sequence[int]
    max_version: Sequence[int]
    uids: Sequence[str]
    payload: Any = None
    real_rows: Optional[int] = None  # rows counted when dropped (default: all)
    t_put: float = 0.0
    staleness: Optional[int] = None  # set by get()

    @property
    def rows(self) -> int:
        return len(self.min_version) if self.real_rows is None else int(self.real_rows)

    @property
    def version(self) -> int:
        """The oldest version any row saw (staleness is measured from it)."""
        return int(min(self.min_version))


@dataclasses.dataclass
class QueueStats:
    put: int = 0  # batches accepted
    put_rows: int = 0  # rows accepted (the generated rows: trained + dropped + still queued)
    got: int = 0  # batches handed to the learner
    dropped_stale: int = 0  # rows
    dropped_overflow: int = 0  # rows
    dropped_stale_batches: int = 0
    dropped_overflow_batches: int = 0
    max_depth: int = 0
    learner_wait_s: float = 0.0
    rollout_wait_s: float = 0.0
    dropped_uids: list = dataclasses.field(default_factory=list)  # (reason, uid) of every dropped group
    dropped_batches: list = dataclasses.field(default_factory=list)  # [reason, batch index] of every dropped batch

    def snapshot(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("dropped_uids")
        d.pop("dropped_batches")
        return d


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} is {value!r}; accepted: an integer >= {low}")
    return value


class TrajectoryQueue:
    """See the module docstring.

    Args:
      max_batches: the bound, in batches (``async_training.queue_size``).
      max_staleness: τ in weight versions (``async_training.max_staleness``).
      overflow: ``"block"`` or ``"drop_stalest"``.
    """

    def __init__(self, max_batches: int, max_staleness: int, overflow: str = "block", *, start_version: int = 0):
        self.max_batches = _check_int("max_batches", max_batches, 1)
        self.max_staleness = _check_int("max_staleness", max_staleness, 0)
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow is {overflow!r}; accepted: {', '.join(OVERFLOW_MODES)}")
        self.overflow = overflow
        self._items: deque[QueueItem] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: Optional[BaseException] = None
        self._learner_version = int(start_version)
        self._start_version = int(start_version)
        self._in_flight = 0  # batches admitted by the producer and not yet put
        self._overflow_since_get = 0  # batches dropped for overflow since the learner last took one
        self.stats = QueueStats()
        self._drops: list[tuple[str, int, int]] = []  # (reason, batch index, rows) of every dropped batch

    # ------------------------------------------------------------------ state

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def rows_out(self, before: Optional[int] = None) -> int:
        """The rows put and no longer queued (handed to the learner or dropped): what a checkpoint
        counts as generated (the queued rows are generated again after a resume). ``before``: the
        batch index a resume's producer starts from; the rows of the batches dropped from it on are
        not counted either (they are generated again too)."""
        with self._cond:
            later = 0 if before is None else sum(rows for _, index, rows in self._drops if index >= before)
            return self.stats.put_rows - sum(it.rows for it in self._items) - later

    def dropped_rows(self, before: Optional[int] = None) -> dict:
        """``{"stale": rows, "overflow": rows}`` dropped so far; ``before``: of the batches before that
        index only (what a checkpoint counts: a resume generates the later batches again)."""
        out = {"stale": 0, "overflow": 0}
        with self._cond:
            for reason, index, rows in self._drops:
                if before is None or index < before:
                    out[reason] += rows
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    def set_learner_version(self, version: int) -> None:
        """The learner's version after an update (wakes a producer waiting for admission)."""
        with self._cond:
            self._learner_version = int(version)
            self._cond.notify_all()

    def close(self, error: Optional[BaseException] = None) -> None:
        """Stops the queue; ``error`` (the first one wins) is what the learner's ``get`` raises."""
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._closed = True
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise QueueClosed("the trajectory queue is closed")

    # ------------------------------------------------------------------ producer side

    def wait_admission(self, weight_version: Callable[[], int], timeout: Optional[float] = None) -> None:
        """Blocks until a batch started now with ``weight_version()`` can be trained within τ.

        The batch will be consumed at learner version ``start_version + taken + ahead``
        (``taken``: batches handed to the learner so far, one update each, the one in training
        included; ``ahead``: batches queued or in flight before it), so it is admitted when
        that minus ``weight_version()`` is at most ``max_staleness``. Marks the batch in
        flight (released by :meth:`put` or :meth:`abandon`).
        """
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                if self._admits(self._in_flight, int(weight_version())):
                    break
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError("wait_admission timed out")
                self._cond.wait(left if left is not None else 0.5)
            self._in_flight += 1
            self.stats.rollout_wait_s += time.perf_counter() - t0

    def _admits(self, ahead_in_flight: int, weight_version: int) -> bool:
        # The batch is consumed at learner version start + taken (the one in training included) + the batches
        # queued or in flight before it; drop_stalest's throttle holds the producer while a queued batch waits for
        # the learner (with the queue empty -- the gate dropped what was queued as stale -- the learner waits for data).
        consumed_at = max(self._learner_version, self._start_version + self.stats.got) + len(self._items) + ahead_in_flight
        throttled = (self.overflow == "drop_stalest" and self._overflow_since_get >= self.max_batches
                     and bool(self._items))
        return not throttled and staleness_gate(consumed_at, min(weight_version, consumed_at),
                                                max_staleness=self.max_staleness)[1]

    def admits(self, ahead_in_flight: int, weight_version: int) -> bool:
        """Streaming admission (non-blocking): may a prompt of a batch with ``ahead_in_flight``
        batches in flight before it (admitted, not yet put) start now with ``weight_version``?
        The rule of :meth:`wait_admission`; the producer tracks its own batches in flight."""
        with self._cond:
            self._raise_if_closed()
            return self._admits(int(ahead_in_flight), int(weight_version))

    def wait_change(self, timeout: float) -> None:
        """Blocks until the queue's state changes (a batch taken or dropped, a learner version, a
        close) or ``timeout`` seconds pass: the streaming producer's wait while the gate refuses."""
        with self._cond:
            self._raise_if_closed()
            self._cond.wait(timeout)

    def add_rollout_wait(self, seconds: float) -> None:
        """Time the streaming producer spent with nothing to decode (every prompt refused by the gate)."""
        with self._cond:
            self.stats.rollout_wait_s += float(seconds)

    def abandon(self) -> None:
        """The admitted batch will not be put (the producer failed or stopped)."""
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            self._cond.notify_all()

    def put(self, item: QueueItem, timeout: Optional[float] = None) -> None:
        """Appends ``item``; when full, waits (``block``) or drops the stalest queued batch."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            while len(self._items) >= self.max_batches:
                self._raise_if_closed()
                if self.overflow == "drop_stalest":
                    stalest = min(self._items, key=lambda it: (it.version, it.index))
                    self._items.remove(stalest)
                    self._count_drop(stalest, "overflow")
                    continue
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError("put timed out: the queue stayed full")
                self._cond.wait(left if left is not None else 0.5)
            self._raise_if_closed()
            item.t_put = time.perf_counter()
            self._items.append(item)
            self._in_flight = max(0, self._in_flight - 1)
            self.stats.put += 1
            self.stats.put_rows += item.rows
            self.stats.max_depth = max(self.stats.max_depth, len(self._items))
            self.stats.rollout_wait_s += item.t_put - t0
            self._cond.notify_all()

    def _count_drop(self, item: QueueItem, reason: str) -> None:
        if reason == "stale":
            self.stats.dropped_stale += item.rows
            self.stats.dropped_stale_batches += 1
        else:
            self.stats.dropped_overflow += item.rows
            self.stats.dropped_overflow_batches += 1
            self._overflow_since_get += 1
        self.stats.dropped_uids.extend((reason, u) for u in dict.fromkeys(u for u in item.uids if u))
        self.stats.dropped_batches.append([reason, int(item.index)])
        self._drops.append((reason, int(item.index), int(item.rows)))

    # ------------------------------------------------------------------ learner side

    def get(self, current_version: int, timeout: Optional[float] = None) -> QueueItem:
        """The next batch trainable at ``current_version``; too-stale batches at the head are
        dropped and counted. Raises :class:`FutureVersionError` for a future version, the
        producer's error after ``close(error)``, :class:`QueueClosed` after a plain close."""
        current = int(current_version)
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            while True:
                if self._error is not None:  # the failing side's error first, queued batches or not
                    raise self._error
                while self._items:
                    item = self._items[0]
                    future = [u for u, v in zip(item.uids, item.max_version) if int(v) > current]
                    if future:
                        err = FutureVersionError(
                            f"trajectory of uid {future[0]!r} claims weight version "
                            f"{max(int(v) for v in item.max_version)}, newer than the learner's {current}: "
                            "sample cannot come from a future policy")
                        self._error = self._error or err
                        self._closed = True
                        self._cond.notify_all()
                        raise err
                    self._items.popleft()
                    self._cond.notify_all()
                    staleness, keep = staleness_gate(current, item.version, max_staleness=self.max_staleness)
                    if not keep:
                        self._count_drop(item, "stale")
                        continue
                    item.staleness = staleness
                    self.stats.got += 1
                    self._overflow_since_get = 0  # a throttled producer may go on
                    self._cond.notify_all()
                    self.stats.learner_wait_s += time.perf_counter() - t0
                    return item
                self._raise_if_closed()
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError("get timed out: no batch arrived")
                self._cond.wait(left if left is not None else 0.5)

    def drain(self) -> list[QueueItem]:
        """Removes and returns every queued batch (at shutdown / checkpoint)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items
