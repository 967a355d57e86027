"""The run directory: usable-path checks and an exclusive lock held for the run's life.

Pure standard library (the launcher uses it before JAX starts).

The lock is ``fcntl.flock`` on ``<run_dir>/rljax.lock``: exclusive, non-blocking, released
by the kernel when the process ends in any way (exception, Ctrl-C, SIGTERM, SIGKILL), so
a dead holder never blocks a new launch. The file records the holder (pid, host, start
time, command line) so a refused launch can name it; a record left by a process that is
gone (killed) is reported as stale and taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
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


def resume_checkpoint(directory: str, resume_from: Optional[int] = None, *,
                      past_undigested: bool = False) -> tuple[Optional[int], list[int]]:
    """``(the checkpoint a resume restores, the newer ones it passes over)`` in ``directory``
    (``<run_dir>/checkpoints``), from the directory alone: ``resume_from`` when given (whether
    it exists is :func:`check_resume_from`'s), else the newest committed one (None: none).

    ``past_undigested`` (a plain ``--resume``): newer checkpoints that merely lack a digest (a
    kill between a save's commit and its digest) are passed over for the newest one that has
    a digest; a checkpoint with a digest is never passed over (a damaged one is reported at
    restore, not skipped), and when none has a digest the newest is chosen."""
    if resume_from is not None:
        return resume_from, []
    steps = committed_checkpoints(directory)
    if not steps:
        return None, []
    digested = [s for s in steps if os.path.exists(os.path.join(directory, str(s), DIGEST_FILE))]
    if past_undigested and digested and digested[-1] != steps[-1]:
        return digested[-1], [s for s in steps if s > digested[-1]]
    return steps[-1], []


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
