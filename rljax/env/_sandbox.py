"""The Python tool: model-written code in a sandboxed, short-lived subprocess.

Model-written code never runs as root. Every call gets a fresh interpreter and these limits:

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
* as root: a private user id per call, leased host-wide so no two live calls of any process
  share one (no access to the project, the run directory, ``/etc/shadow`` or other
  sandboxes); dropping to it needs only ``CAP_SETUID``/``CAP_SETGID``, and a launcher that
  cannot drop refuses to run the code at all (exit 126);
* a private network namespace (no network, not even localhost) and a private mount
  namespace in which ``/tmp`` is a size- and file-count-limited tmpfs (``tmp_mb``,
  ``max_files``) bound over every other world-writable directory (``/var/tmp``, ``/dev/shm``,
  ``/run/lock``, ...: :func:`world_writable_dirs`), so nothing a call writes reaches the host.
  With ``CAP_SYS_ADMIN`` directly; without it (Docker's default) through a user namespace where
  the kernel allows one (as root the launcher maps it for a child, as another user the call
  maps its own uid);
* stdout and stderr go to a file, cut to ``max_output_chars``.

What really holds is measured, not assumed: :meth:`PythonSandbox.probe` runs one call that
tries its uid, a localhost connection and a file in every world-writable directory, then
looks for those files on the host; :meth:`PythonSandbox.require` refuses (one line, what is
missing and how to get it) when a protection the run requires (``env.sandbox.require``)
does not hold. The trainer prints the probe in one line and records it in the trace summary.

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
import ctypes, os, resource, signal, sys
cpu, mem, fsize, nproc, uid, tmp_mb, max_files, userns = (int(x) for x in sys.argv[1:9])
base, exe, dirs = sys.argv[9], sys.argv[10], [d for d in sys.argv[11].split(":") if d]
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWNET, NEWUSER = 0x00020000, 0x40000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
code = open("main.py", "rb").read()
def drop():
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    except OSError as e:
        sys.stderr.write(f"sandbox: cannot drop root to the private uid {uid} ({e.strerror}; needs CAP_SETUID and "
                         "CAP_SETGID): refusing to run model-written code as root\n")
        os._exit(126)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self stays this uid's (for a user namespace's maps)
def private_tmp(owner):
    # a size- and file-count-limited tmpfs on /tmp, bound over every other world-writable directory
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    opts = f"size={tmp_mb}m,nr_inodes={max_files},mode=0700,uid={owner},gid={owner}".encode()
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts) != 0:
        return False
    for d in dirs:
        if d != "/tmp" and libc.mount(b"/tmp", d.encode(), None, MS_BIND, None) != 0:
            return False
    os.mkdir("/tmp/.python", 0o755)  # the interpreter may live where the private uid cannot look (/root/...)
    if libc.mount(base.encode(), b"/tmp/.python", None, MS_BIND | MS_REC, None) != 0:
        return False
    with open("/tmp/main.py", "wb") as f:
        f.write(code)
    os.chown("/tmp/main.py", owner, owner)
    os.chdir("/tmp")
    return True
def mapped_user_namespace():
    # Root without CAP_SYS_ADMIN: a child enters a user namespace whose map this launcher (root with
    # CAP_SETUID) writes: root, for the set-up, and the private uid, to which the child drops before
    # exec. This launcher only waits and passes the call's status on. True in a mapped child.
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = libc.unshare(NEWUSER | NEWNS | NEWNET) == 0
        os.write(w1, b"1" if ok else b"0")
        if ok and os.read(r2, 1) != b"1":
            sys.stderr.write("sandbox: the user namespace could not be mapped\n")
            os._exit(126)
        return ok
    ok = os.read(r1, 1) == b"1"
    try:
        for name in ("uid_map", "gid_map") if ok else ():
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{uid} {uid} 1\n")
    except OSError:
        ok = False
    os.write(w2, b"1" if ok else b"0")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))
private = False
if uid >= 0 and libc.unshare(NEWNS | NEWNET) == 0:  # root with CAP_SYS_ADMIN: namespaces, then the private uid
    private = private_tmp(uid)
    drop()
elif uid >= 0:  # root without CAP_SYS_ADMIN: a user namespace where allowed; CAP_SETUID alone drops the uid
    if userns and mapped_user_namespace():
        private = private_tmp(uid)
    drop()
else:  # not root: an unprivileged user namespace where allowed
    me, grp = os.getuid(), os.getgid()  # inside a new user namespace they read as unmapped until mapped
    if userns and libc.unshare(NEWUSER | NEWNS | NEWNET) == 0:  # an unprivileged user namespace, where allowed
        for name, text in (("setgroups", "deny"), ("uid_map", f"{me} {me} 1"), ("gid_map", f"{grp} {grp} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        private = private_tmp(me)
if os.getuid() == 0 or os.geteuid() == 0:
    sys.stderr.write("sandbox: refusing to run model-written code as root (cannot drop to a private uid)\n")
    os._exit(126)
if private:
    exe = "/tmp/.python/" + os.path.relpath(exe, base)
    os.environ.update(HOME="/tmp", TMPDIR="/tmp")
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
for res, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
               (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (v, v))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
try:
    os.execv(exe, [exe, "-I", "main.py"])
except OSError as e:
    sys.stderr.write(f"sandbox: uid {os.getuid()} cannot run the interpreter {exe} ({e.strerror}): install Python "
                     "where every user can read it, or give the sandbox private_tmp (the interpreter is then mounted)\n")
    os._exit(126)
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


#: The protections :meth:`PythonSandbox.probe` checks by their effect, and what gives each.
PROTECTIONS = {
    "non_root": "the code runs as a non-root user (as root: a private uid, which needs CAP_SETUID)",
    "private_uid": "the code runs as a uid of its own, neither root nor the trainer's (needs root with CAP_SETUID)",
    "private_tmp": "writes to /tmp, /var/tmp, /dev/shm, /run/lock and other world-writable directories stay in a "
                   "size- and file-limited private tmpfs (needs CAP_SYS_ADMIN, e.g. docker --cap-add SYS_ADMIN, or "
                   "unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1 and a seccomp profile "
                   "that allows unshare)",
    "no_network": "no network, not even localhost (same needs as private_tmp)",
}
#: ``env.sandbox.require``'s default: everything.
DEFAULT_REQUIRE = ("non_root", "private_uid", "private_tmp", "no_network")


class SandboxUnavailable(RuntimeError):
    """A protection the configuration requires does not hold on this machine (one line)."""


def world_writable_dirs() -> list[str]:
    """Directories any user may write (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ...),
    found one level under ``/``, ``/var``, ``/run`` and ``/dev``; ``/tmp`` first, symlinks resolved."""
    out = ["/tmp"] if os.path.isdir("/tmp") else []
    for parent in ("/", "/var", "/run", "/dev"):
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            continue
        for name in names:
            path = os.path.realpath(os.path.join(parent, name))
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (os.path.isdir(path) and st.st_mode & 0o002 and path not in out and ":" not in path
                    and not path.startswith(("/proc", "/sys"))):
                out.append(path)
    return out


class PythonSandbox:
    """Runs Python source in sandboxed subprocesses (see the module docstring).

    Args:
      timeout_s: wall-clock limit per call.
      cpu_s: CPU-time limit per call (default ``ceil(timeout_s) + 1``).
      memory_mb: address-space limit.
      max_output_chars: stdout+stderr beyond this is cut (with a marker).
      nproc: processes (threads included) a call may have.
      max_concurrent: calls run at once by :meth:`run_many`.
      tmp_mb, max_files: size and file count of the call's private tmpfs (``env.sandbox``).
      user_namespace: try an unprivileged user namespace where CAP_SYS_ADMIN is missing (False:
        never, what a container whose seccomp profile blocks them gets).
    """

    def __init__(self, *, timeout_s: float = 5.0, cpu_s: int | None = None, memory_mb: int = 256,
                 max_output_chars: int = 1000, nproc: int = 16, max_concurrent: int = 8, tmp_mb: int = 64,
                 max_files: int = 1024, user_namespace: bool = True):
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
        self.tmp_mb, self.max_files, self.user_namespace = int(tmp_mb), int(max_files), bool(user_namespace)
        self.root = os.geteuid() == 0 and sys.platform.startswith("linux")
        self.dirs = world_writable_dirs()
        self._probe: dict | None = None

    @property
    def isolation(self) -> dict:
        """What holds on this machine, by :meth:`probe` (rlimits and a clean environment always)."""
        p = self.probe()
        return {"rlimits": True, "clean_environment": True, **{k: p[k] for k in PROTECTIONS}}

    def probe(self) -> dict:
        """Runs one call that tries what model code might: its uid, a connection to a listening
        localhost port, a file in every world-writable directory; then checks the host for the
        files. Returns ``{protection: held, ..., "uid", "escaped", "dirs", "quota"}`` (cached)."""
        if self._probe is not None:
            return self._probe
        import json
        import socket
        import uuid

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        mark = f".rljax-probe-{uuid.uuid4().hex}"
        code = (f"import json, os, socket\nr = {{'uid': os.getuid()}}\n"
                f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close(); r['net'] = True\n"
                f"except OSError:\n    r['net'] = False\n"
                f"for d in {self.dirs!r}:\n"
                f"    try:\n        open(os.path.join(d, {mark!r}), 'w').write('x')\n    except OSError:\n        pass\n"
                f"print(json.dumps(r))\n")
        try:
            result = self.run(code)
        finally:
            listener.close()
        escaped = []
        for d in self.dirs:
            path = os.path.join(d, mark)
            if os.path.exists(path):
                escaped.append(d)
                os.remove(path)
        try:
            seen = json.loads(result.output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            seen = None
        if seen is None:  # the sandbox could not run at all: nothing holds that needs it to run
            self._probe = {"non_root": False, "private_uid": False, "private_tmp": False, "no_network": False,
                           "uid": None, "escaped": escaped, "dirs": self.dirs, "quota": None,
                           "error": " ".join(result.output.split())[-300:]}
            return self._probe
        uid = int(seen["uid"])
        private_tmp = not escaped
        self._probe = {"non_root": uid != 0, "private_uid": uid not in (0, os.getuid()),
                       "private_tmp": private_tmp, "no_network": not seen["net"], "uid": uid, "escaped": escaped,
                       "dirs": self.dirs,
                       "quota": f"{self.tmp_mb} MB, {self.max_files} files" if private_tmp else None}
        return self._probe

    def describe(self) -> str:
        """The probe in one line: ``sandbox: non_root yes (uid 61007), private_tmp yes (...), ...``."""
        p = self.probe()
        parts = []
        for k in PROTECTIONS:
            extra = ""
            if k in ("non_root", "private_uid") and p["uid"] is not None:
                extra = f" (uid {p['uid']})"
            elif k == "private_tmp":
                extra = (f" ({len(p['dirs'])} world-writable dirs on a private tmpfs of {p['quota']})" if p[k]
                         else f" (writes reached the host in {', '.join(p['escaped']) or 'none'})")
            parts.append(f"{k} {'yes' if p[k] else 'NO'}{extra}")
        err = f"; the probe call failed: {p['error']}" if p.get("error") else ""
        return "sandbox: " + ", ".join(parts) + err

    def require(self, names) -> None:
        """Raises :class:`SandboxUnavailable` naming each protection of ``names`` that does not
        hold, and what gives it. Model code never runs as root whatever ``names`` says."""
        p = self.probe()
        names = tuple(dict.fromkeys(("non_root", *names)))
        missing = [n for n in names if not p[n]]
        if missing:
            how = "; ".join(f"{n}: {PROTECTIONS[n]}" for n in missing)
            err = f" (the probe call failed: {p['error']})" if p.get("error") else ""
            raise SandboxUnavailable(f"the python tool's sandbox lacks {', '.join(missing)}{err}: {how}; or drop it "
                                     f"from env.sandbox.require (now {list(names)}) to run without it")

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
                str(self.max_output_chars * 4 + 4096), str(nproc), str(uid), str(self.tmp_mb), str(self.max_files),
                str(int(self.user_namespace)), sys.base_prefix, _base_executable(), ":".join(self.dirs)]
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
