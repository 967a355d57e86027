"""One background thread of the tracer: items taken from a queue in the order they were put,
each handled by the subclass's :meth:`Background.handle` (the host copies' prefetch,
:mod:`rljax.trace.prefetch`; the checks started mid-step, :mod:`rljax.trace.early`).

What is not kept: an item is dropped before it counts as done, so :meth:`Background.wait`
returning means the thread holds none of them (the runner's leak check follows the tracer's
wait). The thread's CPU seconds in items are counted for ``trace/background_s``. The thread
holds no reference to its owner: an owner dropped unclosed ends it."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Optional


class Background:
    """A queue and the daemon thread (``name``) that takes its items (see the module docstring)."""

    name = "rljax-trace-background"

    def __init__(self):
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._cpu_s = [0.0]  # the thread's CPU seconds in items since the last take_cpu() (shared with it)
        weakref.finalize(self, self._queue.put, None)  # dropped unclosed: its thread ends

    @staticmethod
    def handle(item) -> None:
        """Processes one item, in the thread (a static method: the thread keeps no reference to its owner)."""
        raise NotImplementedError

    def _put(self, item) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_run, args=(self._queue, self._cpu_s, self._lock,
                                                                   type(self).handle),
                                                name=self.name, daemon=True)
                self._thread.start()
        self._queue.put(item)

    def wait(self) -> None:
        """Waits until every item put so far is handled and no longer referenced by the thread."""
        if self._thread is not None:
            self._queue.join()

    def take_cpu(self) -> float:
        """The CPU seconds the thread spent on items since the last call (``trace/background_s``)."""
        with self._lock:
            spent, self._cpu_s[0] = self._cpu_s[0], 0.0
        return spent

    def close(self) -> None:
        """:meth:`wait`, then the thread ends (a later item starts another)."""
        self.wait()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


def _run(items: "queue.Queue", cpu_s: list, lock: threading.Lock, handle) -> None:
    while True:
        item = items.get()
        t = time.thread_time()
        try:
            if item is None:
                return
            handle(item)
        finally:
            item = None  # no reference outlives the item: the runner's leak check follows the wait
            with lock:
                cpu_s[0] += time.thread_time() - t
            items.task_done()
