"""The Python tool: model-written code in a sandboxed, short-lived subprocess.

Every call gets a fresh interpreter in a private temporary working directory (deleted after
the call) and these limits:

* wall clock ``timeout_s``: past it the process group is killed (``SIGKILL``), and when the
  sandbox runs as root every process of the call's private user id as well (a child that
  left the group with ``setsid`` included);
* CPU time (``RLIMIT_CPU``, a backstop one second above the wall clock so a busy loop is
  reported as the wall-clock timeout, and threads that burn CPU faster are stopped too;
  ``SIGXCPU`` at the soft limit, ``SIGKILL`` one second later), address space (``RLIMIT_AS``, ``memory_mb``), file size
  (``RLIMIT_FSIZE``), open files, no core dumps, and a process count (``RLIMIT_NPROC``) so a
  fork bomb stops at a few dozen processes;
* no inherited environment (``python -I``; ``PATH``/``HOME``/``LANG`` only), so secrets in
  the trainer's environment variables are not readable;
* when run as root (the usual container): a private user id per call, leased host-wide so no
  two live calls of any process share one (no write
  access to the project, the run directory or other sandboxes), a private network
  namespace (no network: only a down loopback) and a private mount namespace in which
  ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are the call's own directory. Not as root those
  three are skipped (:attr:`PythonSandbox.isolation` says what applies);
* stdout and stderr go to a file in the working directory, cut to ``max_output_chars``.

A timeout, crash or error is returned as text (the observation the model sees) with flags;
it never raises into the trainer. Calls run concurrently (``run_many``).

Why not the reward worker pool (:mod:`rljax.reward._pool`): its workers are long-lived
interpreters that import the reward function once; a tool call needs the opposite -- a
fresh process per call, so limits, user id, namespaces and directory are per call and
nothing a call leaves behind (files, children, modified modules) reaches the next.

The process is started with ``subprocess`` (fork+exec in C, no ``preexec_fn``: the trainer
runs JAX threads); a tiny launcher (``python -S -c``) in the new process applies the limits
and namespaces, drops privileges, and ``exec``\\ s ``python -I main.py``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

_LAUNCHER = r"""
import ctypes, os, resource, sys
cpu, mem, fsize, nproc, uid, isolate = (int(x) for x in sys.argv[1:7])
base, exe = sys.argv[7], sys.argv[8]
if isolate:
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
    MS_REC, MS_PRIVATE, MS_BIND, MS_RDONLY, MS_REMOUNT = 16384, 1 << 18, 4096, 1, 32
    ok = libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    work = os.getcwd().encode()
    for d in (b"/var/tmp", b"/dev/shm", b"/tmp"):  # /tmp last: it hides the path of work
        ok = ok and (not os.path.isdir(d) or libc.mount(work, d, None, MS_BIND, None) == 0)
    if ok:  # the interpreter may live where the private uid cannot look (/root/...): mount it in /tmp
        os.chdir("/tmp")
        os.mkdir(".python", 0o755)
        ok = libc.mount(base.encode(), b"/tmp/.python", None, MS_BIND | MS_REC, None) == 0
        exe = "/tmp/.python/" + os.path.relpath(exe, base)
    if not ok:
        sys.stderr.write("sandbox: namespaces unavailable; running without a private uid\n")
        uid = -1
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
               (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (v, v))
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
os.execv(exe, [exe, "-I", "main.py"])
"""

#: First private user id of sandbox calls (when running as root) and how many there are.
UID_BASE = 61000
UID_COUNT = 4096
#: Where uid leases are held (one ``flock``'d file per uid, shared by every process on the host).
UID_LEASE_DIR = "/tmp/rljax-sandbox-uids"


class _UidLease:
    """A private uid leased host-wide: an exclusive ``flock`` on ``UID_LEASE_DIR/<uid>``.

    Every sandbox in every process on the host (two trainers, test workers, a trainer and a
    benchmark) draws from one pool, so no two live calls share a uid and one's cleanup can
    never kill the other's processes. The kernel drops the lock when its holder dies, so a
    crashed trainer leaves no stale lease. A uid that still has live processes (a leftover of
    a killed holder) is skipped. Each process starts its search at its own offset and moves
    on round-robin, so a just-released uid (whose zombies may still count against its
    ``RLIMIT_NPROC``) is reused last.
    """

    _cursor = (os.getpid() * 2654435761) % UID_COUNT
    _cursor_lock = threading.Lock()

    def __init__(self):
        os.makedirs(UID_LEASE_DIR, mode=0o700, exist_ok=True)
        with _UidLease._cursor_lock:
            start = _UidLease._cursor
            _UidLease._cursor = (start + 1) % UID_COUNT
        for k in range(UID_COUNT):
            uid = UID_BASE + (start + k) % UID_COUNT
            fd = os.open(os.path.join(UID_LEASE_DIR, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if _uid_processes(uid):
                os.close(fd)
                continue
            with _UidLease._cursor_lock:
                _UidLease._cursor = (start + k + 1) % UID_COUNT
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1} "
                           f"(every lease in {UID_LEASE_DIR} is held)")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = -1


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One tool call: the observation text and what happened."""

    output: str
    error: bool = False
    timeout: bool = False
    seconds: float = 0.0


def _base_executable() -> str:
    """The base interpreter (not the virtual environment's link), found under ``sys.base_prefix``."""
    exe = os.path.realpath(sys.executable)
    if exe.startswith(sys.base_prefix + os.sep):
        return exe
    cand = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return cand if os.path.exists(cand) else exe


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes of ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        state = uid_line = None
        for line in status.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uid_line = int(line.split()[1])
                break
        if uid_line == uid and state not in ("Z", "X"):
            pids.append(int(name))
    return pids


def _own_process_count(uid: int) -> int:
    try:
        return len(_uid_processes(uid))
    except OSError:
        return 0


class PythonSandbox:
    """Runs Python source in sandboxed subprocesses (see the module docstring).

    Args:
      timeout_s: wall-clock limit per call.
      cpu_s: CPU-time limit per call (default ``ceil(timeout_s) + 1``).
      memory_mb: address-space limit.
      max_output_chars: stdout+stderr beyond this is cut (with a marker).
      nproc: processes (threads included) a call may have.
      max_concurrent: calls run at once by :meth:`run_many`.
    """

    def __init__(self, *, timeout_s: float = 5.0, cpu_s: int | None = None, memory_mb: int = 256,
                 max_output_chars: int = 1000, nproc: int = 16, max_concurrent: int = 8):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s is {timeout_s!r}; accepted: a number > 0")
        if memory_mb < 64:
            raise ValueError(f"memory_mb is {memory_mb!r}; accepted: >= 64 (the interpreter needs ~30 MB)")
        self.timeout_s = float(timeout_s)
        self.cpu_s = int(cpu_s or int(-(-timeout_s // 1)) + 1)
        self.memory_mb = int(memory_mb)
        self.max_output_chars = int(max_output_chars)
        self.nproc = int(nproc)
        self.max_concurrent = max(1, int(max_concurrent))
        self.root = os.geteuid() == 0 and sys.platform.startswith("linux")

    @property
    def isolation(self) -> dict:
        """What applies on this machine."""
        return {"rlimits": True, "clean_environment": True, "private_uid": self.root,
                "no_network": self.root, "private_tmp": self.root}

    def run(self, code: str) -> ToolResult:
        return self.run_many([code])[0]

    def run_many(self, codes: Sequence[str]) -> list[ToolResult]:
        """Runs every source concurrently (``max_concurrent`` at a time); one result each, in order."""
        results: list[ToolResult | None] = [None] * len(codes)
        pending = list(range(len(codes)))[::-1]
        running: dict[int, tuple] = {}
        while pending or running:
            while pending and len(running) < self.max_concurrent:
                i = pending.pop()
                try:
                    running[i] = self._start(codes[i])
                except Exception as e:  # noqa: BLE001 - a start failure is an observation
                    results[i] = ToolResult(f"error: the sandbox could not start: {type(e).__name__}: {e}", error=True)
            now = time.monotonic()
            for i, call in list(running.items()):
                proc, t0 = call[0], call[1]
                timed_out = now - t0 > self.timeout_s
                if proc.poll() is None and not timed_out:
                    continue
                results[i] = self._finish(call, timed_out and proc.poll() is None)
                del running[i]
            if running:
                time.sleep(0.005)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ one call

    def _start(self, code: str):
        if not isinstance(code, str):
            raise TypeError(f"code must be a string, got {type(code).__name__}")
        work = tempfile.mkdtemp(prefix="rljax-py-")
        uid, lease = -1, None
        if self.root:
            try:
                lease = _UidLease()
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
            uid = lease.uid
            os.chown(work, uid, uid)
        os.chmod(work, 0o700)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        out = open(os.path.join(work, ".output"), "wb")
        nproc = self.nproc if self.root else _own_process_count(os.getuid()) + self.nproc
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TMPDIR": work}
        args = [sys.executable, "-S", "-c", _LAUNCHER, str(self.cpu_s), str(self.memory_mb << 20),
                str(self.max_output_chars * 4 + 4096), str(nproc), str(uid), str(int(self.root)), sys.base_prefix,
                os.path.realpath(sys.executable) if not self.root else _base_executable()]
        try:
            proc = subprocess.Popen(args, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except Exception:
            out.close()
            self._cleanup(work, uid, lease)
            raise
        return proc, time.monotonic(), work, uid, lease, out

    def _finish(self, call, timed_out: bool) -> ToolResult:
        proc, t0, work, uid, lease, out = call
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        rc = proc.wait()
        seconds = time.monotonic() - t0
        out.close()
        try:
            with open(os.path.join(work, ".output"), "rb") as f:
                text = f.read(self.max_output_chars + 1).decode("utf-8", "replace")
        except OSError:
            text = ""
        self._cleanup(work, uid, lease, pgid=proc.pid)
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "...[truncated]"
        if timed_out:
            return ToolResult(f"{text}error: timeout after {self.timeout_s:g} s", error=True, timeout=True,
                              seconds=seconds)
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            if -rc == signal.SIGXCPU:  # only RLIMIT_CPU sends it; SIGKILL may be the OOM killer too
                return ToolResult(f"{text}error: CPU time limit of {self.cpu_s} s exceeded (killed by SIGXCPU)",
                                  error=True, timeout=True, seconds=seconds)
            return ToolResult(f"{text}error: killed by {name}", error=True, seconds=seconds)
        if rc != 0:
            text += f"error: exit code {rc}"
        return ToolResult(text, error=rc != 0, seconds=seconds)

    def _cleanup(self, work: str, uid: int, lease: _UidLease | None, pgid: int | None = None) -> None:
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)  # children left in the group
            except (ProcessLookupError, PermissionError):
                pass
        if uid >= 0:
            deadline, empty = time.monotonic() + 2.0, 0
            while time.monotonic() < deadline and empty < 3:  # children that left the group: the private uid's
                pids = _uid_processes(uid)
                empty = 0 if pids else empty + 1
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                time.sleep(0.002)
        if lease is not None:
            lease.release()  # only after the uid's processes are gone
        shutil.rmtree(work, ignore_errors=True)
