"""The run directory: usable-path checks and an exclusive lock held for the run's life.

Pure standard library (the launcher uses it before JAX starts).

The lock is ``fcntl.flock`` on ``<run_dir>/rljax.lock``: exclusive, non-blocking, released
by the kernel when the process ends in any way (exception, Ctrl-C, SIGTERM, SIGKILL), so
a dead holder never blocks a new launch. The file records the holder (pid, host, start
time, command line) so a refused launch can name it; a record left by a process that is
gone (killed) is reported as stale and taken over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

LOCK_FILE = "rljax.lock"


class RunDirError(Exception):
    """The run directory cannot be used: not a directory, not writable, or locked by another run."""


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_run_dir(run_dir: str) -> None:
    """Raises :class:`RunDirError` (one line) when ``run_dir`` is a file, sits under a file, or
    cannot be created or written; creates nothing."""
    run_dir = os.path.abspath(run_dir)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirError(f"run directory {run_dir} is a file, not a directory; pass --run-dir to a directory")
    base = _nearest_existing(run_dir)
    if not os.path.isdir(base):
        raise RunDirError(f"run directory {run_dir} cannot be created: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        what = "is not writable" if base == run_dir else f"cannot be created: {base} is not writable"
        raise RunDirError(f"run directory {run_dir} {what}; pass --run-dir to a writable directory")


def committed_checkpoints(directory: str) -> list[int]:
    """Steps of the committed checkpoints in ``directory`` (``<run_dir>/checkpoints``), oldest
    first: the all-digit subdirectories (orbax writes ``N.orbax-checkpoint-tmp-*`` until it commits)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


#: A verified checkpoint's digest file (written by :class:`rljax.trainer.checkpoint.Checkpointer`).
DIGEST_FILE = "rljax_digest.json"


#: The records written once per step, in step order, each line starting with its step (``{"step": N, ...}``):
#: a cut last line is the record of a step (:func:`cut_record`).
STEP_RECORDS = ("metrics.jsonl", "rollout_uids.jsonl")
_TAIL = 1 << 16  # bytes read from a record file's end: its last lines


def _last_lines(path: str) -> tuple[list[bytes], bool]:
    """``(the last lines of path, whether the last one ends with a newline)``; ``([], True)`` when absent."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _TAIL))
            tail = fh.read()
    except OSError:
        return [], True
    return [ln for ln in tail.split(b"\n") if ln.strip()], tail.endswith(b"\n") or not tail.strip()


def cut_record(run_dir: str) -> Optional[tuple[str, int]]:
    """``(file, step)`` when the last line of one of :data:`STEP_RECORDS` in ``run_dir`` is cut short (a
    kill or a full disk mid-write: no newline at its end, or not JSON), with the step it was the record
    of: read from its start (every record begins ``{"step": N``), else the step after the last whole
    record; the earliest such step over the files. None when every last line is whole."""
    cut = []
    for name in STEP_RECORDS:
        lines, ended = _last_lines(os.path.join(run_dir, name))
        if not lines:
            continue
        try:
            json.loads(lines[-1])
            if ended:
                continue
        except ValueError:
            pass
        head = re.match(rb'\{"step":\s*(\d+)', lines[-1])
        if head:
            cut.append((int(head.group(1)), name))
            continue
        steps = [_step_of(ln) for ln in lines[:-1]]
        cut.append((max([s for s in steps if s is not None], default=0) + 1, name))
    return (min(cut)[1], min(cut)[0]) if cut else None


def _step_of(line: bytes) -> Optional[int]:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def resume_checkpoint(directory: str, resume_from: Optional[int] = None, *,
                      past_undigested: bool = False) -> tuple[Optional[int], list[int]]:
    """``(the checkpoint a resume restores, the newer ones it passes over)`` in ``directory``
    (``<run_dir>/checkpoints``), from the directory alone: ``resume_from`` when given (whether
    it exists is :func:`check_resume_from`'s), else the newest committed one (None: none).

    ``past_undigested`` (a plain ``--resume``): newer checkpoints that merely lack a digest (a
    kill between a save's commit and its digest) are passed over for the newest one that has
    a digest; a checkpoint with a digest is never passed over (a damaged one is reported at
    restore, not skipped), and when none has a digest the newest is chosen.

    A step whose record was cut short (:func:`cut_record`) runs again: a checkpoint at or after
    it is passed over for the newest one before it, when there is one (:func:`passed_over_line`
    says why)."""
    if resume_from is not None:
        return resume_from, []
    steps = committed_checkpoints(directory)
    if not steps:
        return None, []
    digested = [s for s in steps if os.path.exists(os.path.join(directory, str(s), DIGEST_FILE))]
    usable = digested if past_undigested and digested else steps
    cut = cut_record(os.path.dirname(os.path.abspath(directory)))
    if cut is not None and any(s < cut[1] for s in usable) and usable[-1] >= cut[1]:
        usable = [s for s in usable if s < cut[1]]
    return usable[-1], [s for s in steps if s > usable[-1]]


def passed_over_line(directory: str, step: int, newer: list[int]) -> str:
    """The line a resume says when it restores ``step`` and passes over the ``newer`` checkpoints
    (:func:`resume_checkpoint`): a step's record cut short, or checkpoints without a digest."""
    cut = cut_record(os.path.dirname(os.path.abspath(directory)))
    if cut is not None and step < cut[1] <= newer[-1]:
        name, at = cut
        again = (f"step {at} runs again and writes its record" if at == step + 1 else
                 f"steps {step + 1}-{at} run again and write their records")
        return (f"resume: the last line of {name} (step {at}'s record) was cut short; resuming from checkpoint "
                f"{step} so that {again} (checkpoint(s) {', '.join(map(str, newer))} set aside)")
    return (f"resume: checkpoint(s) {', '.join(map(str, newer))} have no digest (the run stopped between a save's "
            f"commit and its digest); resuming from {step}, the newest with one (--resume-unverified restores "
            f"{newer[-1]} instead)")


def drop_cut_records(run_dir: str, restored: int) -> list[str]:
    """Removes the cut last line of each of :data:`STEP_RECORDS` (a resume restoring ``restored``,
    before the records after it are cut back) and returns what to say: the step runs again when it
    is after ``restored``; otherwise it is restored, not run again, and its record is lost."""
    out = []
    while (cut := cut_record(run_dir)) is not None:
        name, at = cut
        path = os.path.join(run_dir, name)
        with open(path, "rb") as fh:
            data = fh.read()
        keep = data[: data.rstrip(b"\n").rfind(b"\n") + 1]
        with open(path + ".tmp", "wb") as fh:
            fh.write(keep)
        os.replace(path + ".tmp", path)
        if at > restored:
            out.append(f"resume: the last line of {name} (step {at}'s record) was cut short: dropped; step {at} "
                       "runs again and writes it")
        else:
            out.append(f"resume: the last line of {name} (step {at}'s record) was cut short: dropped; step {at} is "
                       f"restored from checkpoint {restored}, not run again: its {name} record is lost (a resume "
                       f"from a checkpoint before step {at} would run it again)")
    return out


def check_resume_from(run_dir: str, resume_from: Optional[int]) -> None:
    """Raises :class:`RunDirError` (one line) when ``resume_from`` names no committed checkpoint
    of ``run_dir``; creates nothing. (Whether the checkpoint is intact is checked at restore.)"""
    if resume_from is None:
        return
    directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
    steps = committed_checkpoints(directory)
    if resume_from not in steps:
        raise RunDirError(f"trainer.resume_from={resume_from} (--resume={resume_from}): no checkpoint {resume_from} "
                          f"in {directory}; available: {', '.join(map(str, steps)) or 'none'}")


def last_trained_step(run_dir: str) -> Optional[int]:
    """The step of the last whole record of a trained step (1 or later) in ``run_dir/metrics.jsonl``
    (None: none)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step >= 1:
            return step
    return None


def may_run_again(run_dir: str, *, new_run: bool, records: tuple) -> Callable[[], bool]:
    """Asked after a launch failed (:func:`rljax.compilation_cache.retry_bypassed`): whether it may run
    once more as if it had not started, that is, it trained no step since this call
    (:func:`last_trained_step` unchanged). Then a new run's ``records`` (none existed before it
    started) are removed; a resume cuts its records back to the checkpoint it restores anyway."""
    before = last_trained_step(run_dir)

    def check() -> bool:
        if last_trained_step(run_dir) != before:
            return False
        if new_run:
            for name in records:
                try:
                    os.remove(os.path.join(run_dir, name))
                except FileNotFoundError:
                    pass
        return True

    return check


#: One line per resume: from which step which settings changed (:func:`rljax._resume.record_changes`).
CHANGES = "config_changes.jsonl"


def read_changes(run_dir: str) -> list[dict]:
    """The lines of ``run_dir/config_changes.jsonl`` in order (a line cut short is left out)."""
    out = []
    try:
        with open(os.path.join(run_dir, CHANGES), encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("from_step"), int):
                    out.append(rec)
    except OSError:
        pass
    return out


def standing(changes: list[dict]) -> list[dict]:
    """The changes that stand: a resume from step ``s`` supersedes the earlier lines from step ``s``
    or later (the steps they applied to were cut back and run again under the newer settings)."""
    out: list[dict] = []
    for c in changes:
        out = [x for x in out if x["from_step"] < c["from_step"]] + [c]
    return out


def values_at(final: dict, changes: list[dict], step: int) -> dict:
    """The settings (flat, ``{dotted key: value}``) step ``step`` ran with: ``final`` (the newest
    launch's, ``config.resolved.yaml``) with the standing changes that took effect after ``step``
    undone, newest first."""
    out = dict(final)
    for c in reversed(standing(changes)):
        if step < c["from_step"]:
            for key, (was, _now) in c.get("changed", {}).items():
                out[key] = was
    return out


class StartupStop(BaseException):
    """SIGTERM or SIGINT while a launch is outside its step loop (starting up: resolving, compiling,
    restoring), which takes the signals over to save the step in flight. A BaseException, as
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)  # 143 SIGTERM, 130 SIGINT: what the default handlers' exits report
        super().__init__(self.signal_name)


@contextlib.contextmanager
def startup_signals():
    """While the block runs, SIGTERM and SIGINT raise :class:`StartupStop` in the main thread (SIGTERM
    ended a starting launch with status -15 and no word; Ctrl-C printed a KeyboardInterrupt traceback)."""
    def stop(signum, _frame):
        raise StartupStop(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def startup_stop_line(stop: StartupStop, run_dir: Optional[str]) -> str:
    """The one line of a launch stopped by :class:`StartupStop`: no step was in flight, and where the
    next ``--resume`` of ``run_dir`` starts."""
    where = ""
    if run_dir is not None:
        step, _ = resume_checkpoint(os.path.join(os.path.abspath(run_dir), "checkpoints"), past_undigested=True)
        where = (f"; the newest checkpoint is step {step}: --resume starts from step {step + 1}" if step is not None
                 else f"; {run_dir} holds no checkpoint: --resume starts from step 1")
    return f"stopped by {stop.signal_name} outside the step loop (starting up): no step was in flight{where}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (started {when})"


def _ancestors(path: str) -> list[str]:
    """``path`` and its parents, outermost first."""
    out = []
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out[::-1]
        path = parent


class RunDirLock:
    """Exclusive lock on a run directory for this process's life. Use as a context manager, or
    :meth:`acquire` / :meth:`release`.

    Args:
      run_dir: the run directory (created if missing).
      echo: where the one-line stale-lock notice goes.
    """

    def __init__(self, run_dir: str, *, echo: Callable[[str], None] = print):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self.echo = echo
        self._fd: Optional[int] = None
        self._created: list[str] = []  # what acquire() created, newest last (undone by release(undo=True))

    def holder(self) -> dict:
        """The record of the last holder (empty when none or unreadable)."""
        try:
            with open(self.path) as fh:
                text = fh.read().strip()
            return json.loads(text) if text else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunDirLock":
        """Takes the lock or raises :class:`RunDirError` naming the process that holds it."""
        check_run_dir(self.run_dir)
        missing = [d for d in _ancestors(self.run_dir) if not os.path.exists(d)]
        lock_existed = os.path.exists(self.path)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._created = missing + ([] if lock_existed else [self.path])
        except OSError as e:
            raise RunDirError(f"run directory {self.run_dir} is not usable: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise RunDirError(f"cannot lock run directory {self.run_dir}: {e.strerror}") from None
            raise RunDirError(f"run directory {self.run_dir} is in use by another run: {_describe(self.holder())}; "
                              "wait for it to finish or pass another --run-dir") from None
        previous = self.holder()
        if previous.get("pid") and previous.get("host") == socket.gethostname() and not _alive(int(previous["pid"])):
            self.echo(f"rljax: stale lock of {_describe(previous)}, a process that no longer runs; taking it over")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "argv": sys.argv[:8]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self, undo: bool = False) -> None:
        """Clears the record and drops the lock (the kernel drops it anyway when the process ends).

        ``undo``: also removes what :meth:`acquire` created (the lock file, and the run directory
        and its parents when they were made for it and are still empty), for a launch refused
        before it wrote anything."""
        if self._fd is None:
            return
        if undo:
            for path in reversed(self._created):
                try:
                    os.unlink(path) if path == self.path else os.rmdir(path)
                except OSError:
                    break  # not empty: something else was written there
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
