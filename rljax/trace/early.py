"""Checks started before the step's end: the tracer's work whose inputs are complete mid-step runs
in a background thread while the step's later stages run, and the step's end takes its result
(issue 35 item 6: the trace's time on the trainer's thread).

Re-scoring (:mod:`rljax.trace.rescore`) needs only the rollout, the step's prompts and what the
reward stage recorded; started at the reward stage's event, it runs while the old log-prob
pass and the update run (their XLA work releases the GIL), and the step's end finds its verdict
made. Nothing is computed differently: the job is the call the step's end would have made, on
the same objects (the step's end uses a result only when every input it read is still the
step's newest value of that field, else it computes inline).

What is not kept: a job's function and inputs are dropped before the job counts as done, and the
tracer waits for every job (:meth:`Early.wait`) at the step's end, before the runner looks for
batch arrays still alive after the step. A job's exception is raised by :meth:`Job.result`
where the inline call would have raised it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

_UNSET = object()


class Job:
    """One submitted call: :meth:`result` waits for it."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn: Optional[Callable[[], Any]] = fn
        self._done = threading.Event()
        self._value: Any = _UNSET
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        fn, self.fn = self.fn, None
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 -- raised by result(), on the caller's thread
            self._error = e
        finally:
            del fn  # the inputs are released before the job counts as done
            self._done.set()

    def result(self) -> Any:
        """The call's value (waits for it); raises its exception."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Early:
    """Runs jobs in one background thread (``rljax-trace-early``), in the order submitted.

    Args:
      background: False: every job runs in :meth:`submit` itself (as the step's end would).
    """

    def __init__(self, *, background: bool = True):
        self.background = background
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._cpu_s = [0.0]  # the thread's CPU seconds in jobs since the last take_cpu() (shared with it)
        weakref.finalize(self, self._queue.put, None)  # dropped unclosed: its thread ends

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queues ``fn()``; returns its :class:`Job`."""
        job = Job(fn)
        if not self.background:
            job.run()
            return job
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_run, args=(self._queue, self._cpu_s, self._lock),
                                                name="rljax-trace-early", daemon=True)
                self._thread.start()
        self._queue.put(job)
        return job

    def wait(self) -> None:
        """Waits until every job submitted so far is done (and holds none of its inputs)."""
        if self._thread is not None:
            self._queue.join()

    def take_cpu(self) -> float:
        """The CPU seconds the thread spent in jobs since the last call (``trace/background_s``)."""
        with self._lock:
            spent, self._cpu_s[0] = self._cpu_s[0], 0.0
        return spent

    def close(self) -> None:
        """:meth:`wait`, then the thread ends (a later :meth:`submit` starts another)."""
        self.wait()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


def _run(jobs: "queue.Queue", cpu_s: list, lock: threading.Lock) -> None:
    while True:
        job = jobs.get()
        t = time.thread_time()
        try:
            if job is None:
                return
            job.run()
        finally:
            job = None
            with lock:
                cpu_s[0] += time.thread_time() - t
            jobs.task_done()
