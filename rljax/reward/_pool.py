"""Reward isolation: a supervised pool of worker processes (``reward.num_workers``).

Each sample of a batch is scored in a worker (:mod:`rljax.reward._worker`), one sample per
worker at a time, all workers in parallel. A sample whose reward

* raises (``sys.exit`` included) scores 0 and counts as an error;
* runs past ``reward.timeout_s`` scores 0 and counts as an error and a timeout: its worker
  is killed and replaced;
* crashes its worker (segfault, ``os._exit``, out of memory) scores 0 and counts as an
  error: the worker is replaced.

Workers are fresh interpreters started with ``subprocess`` (``python -m
rljax.reward._worker``), not forks of the trainer: the trainer has JAX's threads running,
which ``fork`` would copy in an undefined state, and a fresh interpreter imports only the
reward code (never JAX or TensorFlow; ~0.3 s to start). Messages travel as pickles over
two pipes per worker; a worker dies with the trainer (``PR_SET_PDEATHSIG`` on Linux, and
end-of-file on its pipe elsewhere). Workers run in their own session and ignore SIGINT,
SIGTERM and SIGHUP: a Ctrl-C or a scheduler's SIGTERM to the job's process group reaches
the trainer, which finishes the step with every sample scored, saves, and closes the pool
(SIGKILL for a worker that does not exit).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Optional

import rljax
from rljax.reward._plugin import BUILTIN_REWARDS, builtin_only

_START_TIMEOUT_S = 120.0
_MAX_START_FAILURES = 3
#: ``reward.timeout_s: null`` in workers.
DEFAULT_TIMEOUT_S = 30.0


class RewardWorkerError(RuntimeError):
    """The reward workers cannot run (the function fails to load in a worker, or workers keep
    dying at start-up)."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The result of one sample: ``score`` (0.0 on failure), ``error`` (``"<Type>: <message>"``,
    ``"timeout after 2.0 s"``, ``"worker killed by SIGSEGV"``), whether it timed out, and
    ``extra``: what a function returning a dict gave beside ``"score"`` (verl's ``acc``,
    ``pred``, ...; numbers and short strings), None otherwise."""

    score: float
    error: Optional[str] = None
    timeout: bool = False
    extra: Optional[dict] = None


class _Worker:
    def __init__(self, spec: str, dataset: Optional[str], memory_mb: Optional[int] = None):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()

        root = os.path.dirname(os.path.dirname(os.path.abspath(rljax.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rljax.reward._worker", str(to_child_r), str(from_child_w), spec,
                 dataset or "", str(os.getpid()), str(memory_mb or 0)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)  # out of the terminal's / scheduler's process group
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.inbox = Connection(to_child_w, readable=False)
        self.outbox = Connection(from_child_r, writable=False)
        self.ready = False
        self.started = time.monotonic()
        self.task: Optional[int] = None
        self.deadline = 0.0

    def send(self, task: int, item: tuple, timeout_s: float) -> None:
        self.task, self.deadline = task, time.monotonic() + timeout_s
        self.inbox.send((task, *item))

    def how_it_died(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if code < 0:
            try:
                return f"worker killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"worker killed by signal {-code}"
        return f"worker exited with code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for c in (self.inbox, self.outbox):
            try:
                c.close()
            except OSError:
                pass


class RewardPool:
    """``num_workers`` worker processes that score samples with ``reward.function``.

    Args:
      spec: ``reward.function`` (a built-in name or ``path/to/file.py:function_name``).
      dataset: ``data.dataset`` (what ``auto`` resolves against).
      num_workers: worker processes (>= 1).
      timeout_s: per-sample time limit.
      memory_mb: memory (data-segment) limit of each worker (``reward.memory_mb``; None: none). A
        sample that runs out of it scores 0 and its worker is replaced (what it leaked goes).
      clip: ``reward.clip``, read by :func:`rljax.reward.score_batch`.

    The workers start in the background at construction; :meth:`map` waits for them.
    Call :meth:`close` when done (a context manager does it).
    """

    def __init__(self, spec: str, *, dataset: Optional[str] = None, num_workers: int, timeout_s: float,
                 memory_mb: Optional[int] = None, clip: Optional[float] = None):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers}: a pool needs at least 1 worker")
        if not timeout_s > 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be > 0")
        self.spec, self.dataset, self.timeout_s = spec, dataset, float(timeout_s)
        self.memory_mb, self.clip = memory_mb, clip
        self.restarts = 0
        self._start_failures = 0
        self._workers = [_Worker(spec, dataset, memory_mb) for _ in range(num_workers)]

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ supervision

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.spec, self.dataset, self.memory_mb)
        self.restarts += 1

    def _on_message(self, w: _Worker, results: list) -> None:
        try:
            msg = w.outbox.recv()
        except (EOFError, OSError):  # the worker died: a crash, os._exit, a signal
            why = w.how_it_died()
            if not w.ready:
                self._start_failures += 1
                if self._start_failures >= _MAX_START_FAILURES:
                    raise RewardWorkerError(f"reward workers for reward.function={self.spec!r} keep dying at start-up "
                                            f"({why})") from None
            elif w.task is not None:
                results[w.task] = Outcome(0.0, why)
            self._replace(w)
            return
        task, score, error, *retire = msg
        if task == "init":
            if error is not None:
                raise RewardWorkerError(f"a reward worker cannot load reward.function={self.spec!r}: {error}")
            w.ready, self._start_failures = True, 0
            return
        if task == w.task:
            results[task] = Outcome(0.0, error) if error is not None else Outcome(float(score[0]), extra=score[1])
            w.task = None
            if retire:  # out of reward.memory_mb: a fresh worker takes its place
                self._replace(w)

    def map(self, items: Sequence[tuple[str, str, Mapping]]) -> list[Outcome]:
        """Scores ``(response, answer, extra)`` items in parallel; one :class:`Outcome` each, in order."""
        results: list[Optional[Outcome]] = [None] * len(items)
        todo = deque(range(len(items)))
        while todo or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and todo:
                    i = todo.popleft()
                    try:
                        w.send(i, items[i], self.timeout_s)
                    except (BrokenPipeError, OSError):
                        results[i] = Outcome(0.0, w.how_it_died())
                        w.task = None
                        self._replace(w)
            now = time.monotonic()
            limits = [w.deadline for w in self._workers if w.task is not None]
            limits += [w.started + _START_TIMEOUT_S for w in self._workers if not w.ready]
            timeout = max(0.0, min(limits) - now) if limits else None
            for conn in wait([w.outbox for w in self._workers], timeout):
                w = next((w for w in self._workers if w.outbox is conn), None)
                if w is not None:
                    self._on_message(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    results[w.task] = Outcome(0.0, f"timeout after {self.timeout_s:g} s (reward.timeout_s)", True)
                    w.task = None
                    self._replace(w)
                elif not w.ready and now >= w.started + _START_TIMEOUT_S:
                    raise RewardWorkerError(f"a reward worker for reward.function={self.spec!r} did not start "
                                            f"within {_START_TIMEOUT_S:g} s")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stops every worker (a hung one is killed)."""
        for w in self._workers:
            try:
                w.inbox.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers = []


def default_num_workers(spec: str) -> int:
    """``reward.num_workers: null``: 0 (in-process) for the built-in rule rewards, which are
    fast and trusted; ``min(8, CPUs)`` workers for a ``path:function`` plugin."""
    if spec == "auto" or spec in BUILTIN_REWARDS or builtin_only(spec):
        return 0
    return max(1, min(8, os.cpu_count() or 1))
