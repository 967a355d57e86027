"""Issue 28 (1-2): the python tool's sandbox never runs model code as root, keeps every write to a
world-writable directory private (with a quota), and refuses rather than pretends.

The dropped-capability cases run the sandbox under ``capsh --drop=...`` (root with the named
capabilities removed from the bounding set: what Docker's default gives a root container); they
need a root test process and capsh, and say so when skipped.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from rljax.env import PythonSandbox, SandboxUnavailable
from rljax.env._sandbox import world_writable_dirs

ROOT = os.geteuid() == 0
needs_capsh = pytest.mark.skipif(not (ROOT and shutil.which("capsh")),
                                 reason="needs a root test process and capsh to drop capabilities")

# What the fault campaign's hostile tool code did as root without CAP_SYS_ADMIN.
HOSTILE = r"""
import json, os, socket, subprocess
r = {"uid": os.getuid()}
try:
    r["shadow"] = open("/etc/shadow").read(8)
except OSError as e:
    r["shadow"] = None
r["env_secret"] = os.environ.get("RLJAX_SECRET")
try:
    open("/opt/rljax_sandbox_owned", "w").write("x"); r["opt"] = True
except OSError:
    r["opt"] = False
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=1).close(); r["localhost"] = True
except OSError:
    r["localhost"] = False
try:
    os.kill(TRAINER, 0); r["signal_trainer"] = True
except OSError:
    r["signal_trainer"] = False
n = 0
try:
    for i in range(3000):
        with open(f"/run/lock/rljax_escape_MARK_{i}", "w") as f:
            f.write("x" * 8000)
        n += 1
except OSError:
    pass
r["files_written"] = n
if os.fork() == 0:
    os.setsid()
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    os._exit(0)
print(json.dumps(r))
"""

SCRIPT = r"""
import json, os, socket, sys
from rljax.env import PythonSandbox, SandboxUnavailable
sandbox = PythonSandbox(timeout_s=10.0, user_namespace=sys.argv[1] == "1", max_files=1024)
out = {"probe": sandbox.probe(), "line": sandbox.describe()}
try:
    sandbox.require(("non_root", "private_uid", "private_tmp", "no_network"))
    out["refused"] = None
except SandboxUnavailable as e:
    out["refused"] = str(e)
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(1)
code = sys.argv[2].replace("PORT", str(listener.getsockname()[1])).replace("TRAINER", str(os.getpid()))
out["result"] = sandbox.run(code).output
print(json.dumps(out))
"""


def _run(code, *, userns=True, drop=None):
    env = dict(os.environ, RLJAX_SECRET="hunter2")
    cmd = [sys.executable, "-c", SCRIPT, "1" if userns else "0", code]
    if drop:
        cmd = ["capsh", f"--drop={drop}", "--", "-c", 'exec "$0" "$@"', *[sys.executable, "-c", SCRIPT,
                                                                          "1" if userns else "0", code]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _leftovers(mark):
    return [f for f in os.listdir("/run/lock") if mark in f] + (["/opt"] if os.path.exists("/opt/rljax_sandbox_owned")
                                                                 else [])


@pytest.mark.parametrize("drop", [pytest.param(None, id="all-capabilities"),
                                  pytest.param("cap_sys_admin", id="no-CAP_SYS_ADMIN")])
def test_hostile_code_is_contained_with_or_without_cap_sys_admin(drop):
    """Without CAP_SYS_ADMIN the code ran as root: it read /etc/shadow and a secret of the trainer's
    environment, wrote to /opt, connected to localhost, could signal the trainer, and left a daemon
    behind, while the sandbox reported a private uid. Now it is a private uid in a user namespace."""
    if not ROOT or (drop and not shutil.which("capsh")):
        pytest.skip("needs a root test process (and capsh for the dropped-capability case)")
    mark = uuid.uuid4().hex[:8]
    out = _run(HOSTILE.replace("MARK", mark), drop=drop)
    p = out["probe"]
    assert p["non_root"] and p["private_uid"] and p["private_tmp"] and p["no_network"], out["line"]
    assert out["refused"] is None
    r = json.loads(out["result"].strip().splitlines()[-1])
    assert r["uid"] != 0 and r["shadow"] is None and r["env_secret"] is None and not r["opt"]
    assert not r["localhost"] and not r["signal_trainer"]
    assert 0 < r["files_written"] < 1024  # the private tmpfs's file count stops it
    assert _leftovers(mark) == []
    from rljax.env._sandbox import UID_BASE, UID_COUNT, _uid_processes

    assert not any(_uid_processes(u) for u in range(UID_BASE, UID_BASE + UID_COUNT) if u == p["uid"])


@needs_capsh
def test_without_namespaces_the_sandbox_refuses_rather_than_pretends():
    """No CAP_SYS_ADMIN and no user namespace (a seccomp profile that blocks them): the probe
    says what does not hold and require() refuses in one line naming it and how to get it; the
    code still never runs as root, and nothing it wrote stays on the host."""
    mark = uuid.uuid4().hex[:8]
    out = _run(HOSTILE.replace("MARK", mark), userns=False, drop="cap_sys_admin")
    p = out["probe"]
    assert not p["private_tmp"] and not p["no_network"]
    msg = out["refused"]
    assert msg and "\n" not in msg and "private_tmp" in msg and "no_network" in msg
    assert "--cap-add SYS_ADMIN" in msg and "user namespaces" in msg and "env.sandbox.require" in msg
    assert "sandbox: " in out["line"] and "private_tmp NO" in out["line"]
    assert '"uid": 0' not in out["result"] and "root:" not in out["result"]
    for f in _leftovers(mark):  # the probe cleans its own files; the hostile call's, if it ran, are ours to remove
        os.remove(os.path.join("/run/lock", f))


@needs_capsh
def test_a_launch_whose_sandbox_cannot_drop_root_exits_2():
    """Root without CAP_SETUID cannot drop to a private uid: the run refuses to start (exit 2, one
    line, naming what is missing) instead of running model code as root."""
    from launching import REPO, launch_env

    cmd = [sys.executable, "-m", "rljax.launch", "env.function=tools", "--run-dir", "/nonexistent-rljax/run"]
    out = subprocess.run(["capsh", "--drop=cap_sys_admin,cap_setuid,cap_setgid", "--", "-c", 'exec "$0" "$@"', *cmd],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "sandbox lacks non_root" in out.stderr
    assert not os.path.exists("/nonexistent-rljax")


def test_world_writable_dirs_are_found():
    dirs = world_writable_dirs()
    assert dirs[0] == "/tmp" and all(os.stat(d).st_mode & 0o002 for d in dirs)
    assert {d for d in ("/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)} <= set(dirs)


def test_the_quota_holds_in_size_too():
    sandbox = PythonSandbox(timeout_s=10.0, tmp_mb=4)
    if not sandbox.probe()["private_tmp"]:
        pytest.skip(f"no private tmpfs here: {sandbox.describe()}")
    r = sandbox.run("n = 0\ntry:\n    while True:\n        open(f'/dev/shm/f{n}', 'wb').write(b'x' * 8000); n += 1\n"
                    "except OSError as e:\n    print(n, e.errno)")  # RLIMIT_FSIZE caps one file; the tmpfs, all
    n, errno = map(int, r.output.split())
    assert errno == 28 and 400 < n and n * 8000 <= 4 << 20  # ENOSPC at 4 MB, before the 1024-file limit
