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

import threading
from typing import Any, Callable, Optional

from rljax.trace.background import Background

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


class Early(Background):
    """Runs jobs in one background thread (``rljax-trace-early``), in the order submitted.

    Args:
      background: False: every job runs in :meth:`submit` itself (as the step's end would).
    """

    name = "rljax-trace-early"

    def __init__(self, *, background: bool = True):
        super().__init__()
        self.background = background

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queues ``fn()``; returns its :class:`Job`."""
        job = Job(fn)
        if self.background:
            self._put(job)
        else:
            job.run()
        return job

    @staticmethod
    def handle(job: Job) -> None:
        job.run()
