"""The run-directory lock and run-directory usage errors (issue 11, defect 4 and item 6)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from launching import launch, launch_env
from rljax._rundir import LOCK_FILE, RunDirError, RunDirLock, check_run_dir

HOLD = "import sys, time; from rljax._rundir import RunDirLock; RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/run."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=launch_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_second_lock_names_the_holder_and_dead_holder_is_stale(holder):
    run_dir, proc = holder
    with pytest.raises(RunDirError) as e:
        RunDirLock(str(run_dir)).acquire()
    assert f"in use by another run: pid {proc.pid} on " in str(e.value) and "\n" not in str(e.value)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines = []
    with RunDirLock(str(run_dir), echo=lines.append) as lock:
        assert lock.held and lock.holder()["pid"] == os.getpid()
        assert len(lines) == 1 and f"stale lock of pid {proc.pid}" in lines[0]
    assert (run_dir / LOCK_FILE).read_text() == ""  # released cleanly: the next launch reports nothing
    lines = []
    with RunDirLock(str(run_dir), echo=lines.append):
        assert lines == []


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with RunDirLock(str(tmp_path)):
        with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
            RunDirLock(str(tmp_path)).acquire()
    RunDirLock(str(tmp_path)).acquire().release()


def test_release_undo_removes_only_what_acquire_created(tmp_path):
    RunDirLock(str(tmp_path / "new" / "run")).acquire().release(undo=True)  # a refused launch
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text("{}\n")
    RunDirLock(str(existing)).acquire().release(undo=True)
    assert sorted(p.name for p in existing.iterdir()) == ["metrics.jsonl"]  # the user's directory stays
    lock = RunDirLock(str(tmp_path / "made" / "run")).acquire()
    (tmp_path / "made" / "run" / "written.txt").write_text("x")  # written after acquire: the directory stays
    lock.release(undo=True)
    assert (tmp_path / "made" / "run" / "written.txt").exists()


def test_run_dir_checks(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        check_run_dir(str(f))
    with pytest.raises(RunDirError, match="cannot be created: .* is a file"):
        check_run_dir(str(f / "sub" / "run"))
    check_run_dir(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(RunDirError, match="not writable"):
            check_run_dir(str(ro / "run"))
    finally:
        ro.chmod(0o700)


def test_launch_into_a_locked_run_dir_exits_2_naming_the_holder(holder):
    """Defect 4: a second launch (or a second --resume) into a running run's directory."""
    run_dir, proc = holder
    for extra in ([], ["--resume"]):
        out = launch("--run-dir", str(run_dir), *extra)
        assert out.returncode == 2, out.stderr[-2000:]
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and f"pid {proc.pid}" in lines[0] and "in use by another run" in lines[0]
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE]


def test_launch_into_a_file_exits_2_in_one_line(tmp_path):
    f = tmp_path / "run"
    f.write_text("x")
    out = launch("--run-dir", str(f))
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "is a file, not a directory" in lines[0]
    out = launch("--run-dir", str(tmp_path / "x"), "--resume=abc")
    assert out.returncode == 2 and "trainer.resume_from" in out.stderr
