"""The trace's file writes off the step's critical path: one background thread per tracer takes
the jobs (``trace.jsonl``'s records, ``rollout_uids.jsonl``'s line, ``trace_summary.json``'s
rewrite) in the order they were put, so each file sees its writes in step order.

What is not lost:

* :meth:`Writer.flush` waits until every job put before it is done. The trainer flushes before
  each checkpoint save (a kill after a saved step finds that step's records and summary on
  disk, as when the writes were synchronous), the tracer at :meth:`~rljax.trace.tracer.Tracer.close`
  (every end of a run, an error's included), and the interpreter at exit (``atexit``: a library
  user who never closes the tracer).
* A job's ``OSError`` (a full disk, a read-only directory) is kept and raised, with the file it
  names, by the next :meth:`Writer.put` or :meth:`Writer.flush` on the trainer's thread: the run
  stops one step later than with synchronous writes, naming the same file; the jobs after the
  failed one are not run (no record is written after a missing one).

A SIGKILL loses the jobs still queued: at most the records of the steps since the last flush,
which a resume from the last checkpoint runs again (their lines are cut back anyway).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from typing import Callable, Optional

_LIVE: "weakref.WeakSet[Writer]" = weakref.WeakSet()


def _flush_all() -> None:  # at interpreter exit: what was put is written (errors are the run's to report)
    for w in list(_LIVE):
        try:
            w.flush()
        except Exception:  # noqa: BLE001 -- nothing is left to report it to
            pass


atexit.register(_flush_all)


class Writer:
    """Runs file-writing jobs in a background thread, in order (see the module docstring).

    Args:
      background: False: every job runs in :meth:`put` itself (synchronous writes).
    """

    def __init__(self, *, background: bool = True):
        self.background = background
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None  # a job's, not yet raised
        self._failed = False  # a job failed: the later ones are not run
        self._lock = threading.Lock()
        self._cpu_s = 0.0  # the thread's CPU seconds in jobs since the last take_cpu()
        _LIVE.add(self)
        weakref.finalize(self, self._queue.put, None)  # a writer dropped unclosed: its thread ends

    def put(self, job: Callable[[], None]) -> None:
        """Queues ``job`` (run now when not in the background); raises an earlier job's error first."""
        self._raise()
        if not self.background:
            job()
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._queue),
                                                name="rljax-trace-writer", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def flush(self) -> None:
        """Waits until every job put so far is done; raises a job's error (once)."""
        if self._thread is not None:
            self._queue.join()
        self._raise()

    def close(self) -> None:
        """:meth:`flush`, then the thread ends (a later :meth:`put` starts another)."""
        try:
            self.flush()
        finally:
            with self._lock:
                thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
                thread.join()

    def take_cpu(self) -> float:
        """The CPU seconds the thread spent in jobs since the last call (the trace's ``trace/background_s``)."""
        with self._lock:
            spent, self._cpu_s = self._cpu_s, 0.0
        return spent

    def _raise(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def run_job(self, job: Callable[[], None]) -> None:
        """The thread's: runs ``job`` unless an earlier one failed; keeps its error for the trainer's thread."""
        if self._failed:
            return
        t = time.thread_time()
        try:
            job()
        except BaseException as e:  # noqa: BLE001 -- raised on the trainer's thread (put / flush)
            self._failed, self._error = True, e
        finally:
            spent = time.thread_time() - t
            with self._lock:
                self._cpu_s += spent


def _run(ref: "weakref.ref[Writer]", jobs: "queue.Queue") -> None:
    """The thread: each job in turn until ``None`` (or the writer is gone)."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            w = ref()
            if w is None:
                return
            w.run_job(job)
            del w
        finally:
            jobs.task_done()
