"""What keeps a run from losing work or failing silently, as small pieces the step loop uses:

* :class:`NonFiniteMonitor`: each step whose update was skipped as non-finite logs one
  line naming what was non-finite (the loss, which gradient groups) and raises the
  ``alerts/nonfinite_update`` alert; ``trainer.max_skipped_updates`` consecutive such
  steps stop the run with :class:`NonFiniteUpdateError`.
* :class:`StopSignals`: SIGTERM (what SLURM and TPU maintenance send before a kill) and
  SIGINT (Ctrl-C) become a request the loop honours at the next step boundary with a final
  save.
* :func:`wait_for_save`: a stop waits (bounded) for the in-flight checkpoint to commit and
  says so if it gives up.
* :func:`cut_jsonl`: on resume, ``metrics.jsonl``, ``trace.jsonl`` and
  ``rollout_uids.jsonl`` are cut back to the restored step so every step appears once;
  :func:`mark_resume`: ``rollout_uids.jsonl`` also gets a resume marker line (``trace check``:
  "every prompt trained once" reads it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from collections.abc import Mapping
from typing import Callable, Optional

NONFINITE_ALERT = "alerts/nonfinite_update"


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive steps had their update skipped as non-finite."""


class StopRequested(Exception):
    """Raised by the loop after a SIGTERM- or SIGINT-requested final save (exit status 143 or
    130, like the plain signal)."""

    def __init__(self, message: str, signal_name: str = "SIGTERM"):
        super().__init__(message)
        self.signal_name = signal_name


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def describe_nonfinite(actor: Mapping, prefix: str = "") -> str:
    """What was non-finite in a train step's metrics: ``"loss, gradients of layers.attn, lm_head"``."""
    parts = []
    if not _finite(actor.get("loss", 0.0)):
        parts.append(f"{prefix}loss")
    groups = sorted(k.split("/", 1)[1] for k, v in actor.items() if k.startswith("nonfinite_grad/") and float(v) > 0)
    if groups:
        parts.append(f"{prefix}gradients of {', '.join(groups)}")
    elif not _finite(actor.get("grad_norm", 0.0)):
        parts.append(f"{prefix}gradient norm")
    return "; ".join(parts) or f"{prefix}loss or gradients"


class NonFiniteMonitor:
    """Watches the cumulative ``skipped_updates`` counter of the train step(s).

    Args:
      max_consecutive: ``trainer.max_skipped_updates``.
      echo: where the per-step line goes.
    """

    def __init__(self, max_consecutive: int, *, echo: Callable[[str], None] = print):
        self.max_consecutive = int(max_consecutive)
        self.echo = echo
        self.consecutive = 0
        self.total = 0

    def observe(self, step: int, skipped: Mapping[str, tuple[int, Mapping]]) -> dict:
        """``skipped``: ``{"actor": (updates skipped this step, step metrics), "critic": ...}``.
        Returns the metrics to add (the alert when something was skipped); raises
        :class:`NonFiniteUpdateError` after ``max_consecutive`` consecutive steps with a skip."""
        hits = {role: (n, m) for role, (n, m) in skipped.items() if n > 0}
        if not hits:
            self.consecutive = 0
            return {}
        self.consecutive += 1
        self.total += 1
        what = "; ".join(f"{role}: {n} update(s), non-finite {describe_nonfinite(m)}" for role, (n, m) in hits.items())
        self.echo(f"step {step}: update skipped, parameters unchanged ({what}) "
                  f"[{self.consecutive}/{self.max_consecutive} consecutive]")
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteUpdateError(
                f"{self.consecutive} consecutive steps (through step {step}) skipped their update as non-finite "
                f"({what}); stopping (trainer.max_skipped_updates={self.max_consecutive}); the last checkpoint "
                "saved before is kept; lower actor.optim.lr or set actor.grad_clip")
        return {NONFINITE_ALERT: 1.0}


class StopSignals:
    """While active, SIGTERM and SIGINT (Ctrl-C) set :attr:`requested` instead of killing the
    process: the loop finishes the step, saves it and stops. A second SIGINT raises
    ``KeyboardInterrupt`` at once (the step in flight is abandoned, nothing of it is saved).
    Main thread only (elsewhere a no-op); the previous handlers come back on exit.

    The one-line notice of the first signal goes straight to stderr's descriptor (a handler
    must not re-enter a buffered ``print`` it interrupted).
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.requested: Optional[str] = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = name
            note = (f"rljax: {name}: finishing the current step, then saving it and stopping"
                    + (" (Ctrl-C again to stop at once, losing the step)" if signum == signal.SIGINT else "") + "\n")
            try:
                os.write(2, note.encode())
            except OSError:
                pass

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def wait_for_save(checkpointer, timeout_s: float, echo: Callable[[str], None] = print) -> bool:
    """Waits at most ``timeout_s`` for the in-flight save; says so when it gives up or the save failed."""
    pending = checkpointer.pending
    try:
        done = checkpointer.wait(timeout_s)
    except Exception as e:  # noqa: BLE001 - we are already stopping; report, do not mask the first error
        echo(f"checkpoint: while stopping: {e}")  # names the step (pending is None once the save has failed)
        return False
    if not done:
        echo(f"checkpoint: gave up waiting for the save of step {pending} after {timeout_s:g} s "
             "(trainer.stop_save_timeout_s); it may be incomplete and will be ignored on resume")
    elif pending is not None:
        echo(f"checkpoint: waited for the in-flight save of step {pending} before stopping")
    return done


#: The per-step records of a run directory, cut back to the restored step on resume.
RUN_RECORDS = ("metrics.jsonl", "trace.jsonl", "rollout_uids.jsonl", "generations.jsonl")
#: The record files that also get a resume marker (:func:`mark_resume`).
MARKED_RECORDS = ("rollout_uids.jsonl",)


def mark_resume(path: str, step: int, superseded: int) -> bool:
    """On resume from step ``step`` (``-1``: from scratch), after :func:`cut_jsonl` removed the
    ``superseded`` records of later steps: appends ``{"resume": {"restored_step": step,
    "superseded": superseded}}`` to ``path`` (``rollout_uids.jsonl``), so the file says where
    each launch took over; readers (``rljax.trace.check``) drop any record of a step after
    ``restored_step`` written before the marker (none after the cut). Nothing when ``path`` does
    not exist. Returns whether it wrote."""
    if not os.path.exists(path):
        return False
    line = json.dumps({"resume": {"restored_step": int(step), "superseded": int(superseded)}}, separators=(",", ":"))
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return True


def cut_jsonl(path: str, step: int) -> int:
    """Drops the records of a JSONL file (``metrics.jsonl``, ``trace.jsonl``,
    ``rollout_uids.jsonl``) whose ``step`` is after ``step`` (written by a run that went on
    past its last checkpoint) and any line cut short by a kill; returns how many were
    dropped. Atomic (write, then rename)."""
    if not os.path.exists(path):
        return 0
    keep, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec_step = json.loads(line).get("step")
            except (ValueError, AttributeError):  # a line cut short by a kill
                dropped += 1
                continue
            if isinstance(rec_step, int) and rec_step > step:
                dropped += 1
            else:
                keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(keep)
        os.replace(tmp, path)
    return dropped


def cut_metrics(run_dir: str, step: int) -> int:
    """:func:`cut_jsonl` of ``run_dir/metrics.jsonl``."""
    return cut_jsonl(os.path.join(run_dir, "metrics.jsonl"), step)
