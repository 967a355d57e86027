"""The producer thread of ``trainer.mode=async``: one loop over a batch source.

Each round: wait for the source's turn (admission) and while validation asks for the sampler,
then, under the sampler lock, the source's ``round()``; the batches it completed go into the
queue, in batch order. Idle (the source has nothing to do until the learner trains a batch or
pushes weights) it waits for the queue to change and counts the time in
``async/rollout_wait_s``. An exception closes the queue with it: the learner re-raises it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from rljax.rollout.queue import QueueClosed
from rljax.trainer.producers.base import Source

log = logging.getLogger("rljax")


class ProducerThread:
    """Runs ``source`` on a rollout thread (see the module docstring)."""

    def __init__(self, source: Source):
        self.source, self.queue = source, source.queue
        #: Held by the producer while it generates and scores, and by validation.
        self.sampler_lock = threading.RLock()
        #: Set while validation waits for the sampler lock: the producer stays out until it is
        #: cleared (a lock is not fair).
        self.pause_requested = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def latest_version(self) -> int:
        return self.source.latest_version()

    def install_pending(self) -> None:
        self.source.install_pending()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rljax-rollout", daemon=True)
            self._thread.start()

    def _round(self) -> tuple[list, bool]:
        """One round of the source under the sampler lock: ``(queue items, idle)``; ``None`` items
        when stopped."""
        src = self.source
        while self.pause_requested.is_set() and not self._stop.is_set():
            time.sleep(0.005)
        with self.sampler_lock:
            if self._stop.is_set():
                src.abandon()
                return None, False
            try:
                items = src.round()
            except BaseException:
                src.abandon()
                raise
            return items, src.idle(items)

    def _loop(self) -> None:
        q, src = self.queue, self.source
        try:
            with self.sampler_lock:
                src.open()
            while not self._stop.is_set():
                src.wait_turn()
                items, idle = self._round()
                if items is None:
                    return
                for item in items:
                    q.put(item)
                del items
                if idle:  # nothing to do until the learner moves (a taken batch, a push)
                    t = time.perf_counter()
                    q.wait_change(0.05)
                    q.add_rollout_wait(time.perf_counter() - t)
        except QueueClosed:
            pass
        except BaseException as e:  # noqa: BLE001 -- the learner re-raises it
            log.error("rljax: the rollout thread failed: %s: %s", type(e).__name__, e)
            q.close(e)
        finally:
            src.close()

    def close(self, timeout: float) -> None:
        """Stops the thread (it finishes at most its current round) and joins it."""
        self._stop.set()
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("rljax: the rollout thread did not stop within %.0f s", timeout)
