"""The Python tool's sandbox against hostile code: each attack is contained and comes back as an
observation with flags, never an exception in the trainer; nothing outlives the call."""

import os
import time

import pytest

from rljax.env import PythonSandbox


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout_s=2.0, memory_mb=256, max_output_chars=200)


def _no_sandbox_processes_left():
    from rljax.env._sandbox import UID_BASE, _uid_processes

    return not any(_uid_processes(u) for u in range(UID_BASE, UID_BASE + 32))


def test_ordinary_code_runs(sandbox):
    r = sandbox.run("print(sum(range(10)))\nprint('ok')")
    assert (r.output, r.error, r.timeout) == ("45\nok\n", False, False)


def test_infinite_loop_and_sleep_time_out(sandbox):
    t0 = time.monotonic()
    loop, sleep = sandbox.run_many(["while True:\n    pass", "import time\ntime.sleep(60)"])
    assert time.monotonic() - t0 < 6  # concurrently, killed at the wall-clock limit
    for r in (loop, sleep):
        assert r.error and r.timeout and "timeout after 2 s" in r.output
    assert _no_sandbox_processes_left()


def test_cpu_limit_is_a_backstop_reported_as_timeout():
    busy = PythonSandbox(timeout_s=30.0, cpu_s=1)  # the CPU limit comes first here
    r = busy.run("while True:\n    pass")
    assert r.error and r.timeout and "CPU time limit of 1 s exceeded" in r.output and r.seconds < 10
    assert PythonSandbox(timeout_s=2.0).cpu_s == 3  # default: above the wall clock, which fires first


def test_fork_bomb_is_contained(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = sandbox.run(bomb)
    assert r.error and r.timeout
    time.sleep(0.1)
    assert _no_sandbox_processes_left()  # the group and every process of the private uid were killed


def test_setsid_child_is_killed_with_the_call(sandbox):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    r = sandbox.run(code)
    assert r.output == "parent done\n"
    if sandbox.isolation["private_uid"]:
        assert _no_sandbox_processes_left()


def test_huge_allocation_is_refused(sandbox):
    r = sandbox.run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r.error and "MemoryError" in r.output and "allocated" not in r.output


def test_writes_outside_its_directory_fail(sandbox, tmp_path):
    target = os.path.abspath("rljax_sandbox_escape.txt")  # the project directory (cwd)
    r = sandbox.run(f"open({target!r}, 'w').write('x')\nprint('wrote')")
    assert r.error and "wrote" not in r.output and not os.path.exists(target)
    if sandbox.isolation["private_tmp"]:  # /tmp is the call's own directory, deleted after the call
        r = sandbox.run("open('/tmp/left_behind', 'w').write('x')\nimport os\nprint(sorted(os.listdir('/tmp')))")
        assert "left_behind" in r.output and not os.path.exists("/tmp/left_behind")


def test_environment_variables_are_not_inherited(sandbox, monkeypatch):
    monkeypatch.setenv("RLJAX_SECRET_TOKEN", "hunter2")
    r = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('RLJAX_SECRET_TOKEN'))")
    assert "hunter2" not in r.output and "RLJAX_SECRET_TOKEN" not in r.output


def test_no_network(sandbox):
    if not sandbox.isolation["no_network"]:
        pytest.skip("network namespaces need root here")
    r = sandbox.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('connected')")
    assert r.error and "connected" not in r.output


def test_crash_exit_and_error_are_observations(sandbox):
    seg, exit3, err = sandbox.run_many(["import ctypes\nctypes.string_at(0)", "import sys\nsys.exit(3)",
                                        "raise ValueError('bad')"])
    assert seg.error and "SIGSEGV" in seg.output
    assert exit3.error and "exit code 3" in exit3.output
    assert err.error and "ValueError: bad" in err.output


def test_output_is_truncated(sandbox):
    r = sandbox.run("print('a' * 10**6)")
    head, marker, tail = r.output.partition("...[truncated]")
    assert marker and head == "a" * 200 and len(tail) < 40  # tail: the exit status line, if any


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        PythonSandbox(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        PythonSandbox(memory_mb=8)
    r = PythonSandbox().run_many([b"print(1)"])[0]
    assert r.error and "code must be a string" in r.output


def test_uid_leases_are_host_wide(monkeypatch):
    """A uid leased by another process (another trainer, another test worker) is never handed
    out here, even when this process's round-robin cursor points at it; released leases are
    reused."""
    import subprocess
    import sys

    from rljax.env import _sandbox

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom rljax.env._sandbox import _UidLease\n"
         "lease = _UidLease()\nprint(lease.uid, flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = int(holder.stdout.readline())
        monkeypatch.setattr(_sandbox._UidLease, "_cursor", held - _sandbox.UID_BASE)
        mine = _sandbox._UidLease()
        other = _sandbox._UidLease()
        assert len({held, mine.uid, other.uid}) == 3
        after_held = _sandbox.UID_BASE + (held - _sandbox.UID_BASE + 1) % _sandbox.UID_COUNT
        assert mine.uid == after_held  # skipped the held one, took the next
        mine.release()
        monkeypatch.setattr(_sandbox._UidLease, "_cursor", held - _sandbox.UID_BASE)
        again = _sandbox._UidLease()
        assert again.uid == after_held  # released: free again
        again.release()
        other.release()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder exited without releasing: the kernel dropped its lock
    monkeypatch.setattr(_sandbox._UidLease, "_cursor", held - _sandbox.UID_BASE)
    after = _sandbox._UidLease()
    assert after.uid == held
    after.release()
