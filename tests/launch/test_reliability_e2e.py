"""Issue 11 end to end: each defect of "Why", reproduced through `python -m rljax.launch`.

Every run is a real subprocess on a small embedded configuration; all are slow.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from launching import REPO, launch_env, metrics, train_rows
from launching import launch as _launch

SMALL = ["--mesh=dp2", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "data.embedded.num_train=64", "data.embedded.num_test=16", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trace.groups=0"]

pytestmark = pytest.mark.slow


def launch(*args, timeout=900):
    return _launch(*args, timeout=timeout)


def _train_steps(run_dir):
    return [r["step"] for r in train_rows(run_dir)]


def _last_line(text):
    return [l for l in text.splitlines() if l.strip()][-1]


def _ckpts(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def _verified(run_dir, step):
    return os.path.exists(os.path.join(run_dir, "checkpoints", str(step), "rljax_digest.json"))


def test_bit_flip_in_the_newest_checkpoint_is_refused_naming_the_intact_one(tmp_path):
    """Defect 1: a damaged newest checkpoint was restored silently and its intact predecessor deleted."""
    run = str(tmp_path / "run")
    base = ["--run-dir", run, *SMALL, "trainer.save_freq=1", "trainer.max_checkpoints=2"]
    out = launch(*base, "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _ckpts(run) == [1, 2] and _verified(run, 2)
    step_dir = os.path.join(run, "checkpoints", "2")
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if f != "rljax_digest.json"]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))
    out = launch(*base, "--resume", "trainer.total_steps=3")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    line = _last_line(out.stderr)
    assert "checkpoint 2" in line and "is damaged" in line and "newest intact checkpoint is 1" in line
    assert _ckpts(run) == [1, 2] and _verified(run, 1)
    out = launch(*base, "--resume=1", "trainer.total_steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restored step 1" in out.stdout
    assert _train_steps(run) == [1, 2, 3]  # every step once: the old step 2 was cut from metrics.jsonl
    assert _ckpts(run) == [2, 3] and _verified(run, 3)
    # a kill between checkpoint 3's commit and its digest: the automatic restart (a plain --resume)
    # takes checkpoint 2, says so in one line, and sets 3 aside (it is saved again)
    os.remove(os.path.join(run, "checkpoints", "3", "rljax_digest.json"))
    out = launch(*base, "--resume", "trainer.total_steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint(s) 3 have no digest" in out.stdout and "resuming from 2" in out.stdout
    assert "restored step 2" in out.stdout
    assert _train_steps(run) == [1, 2, 3, 4]
    assert _ckpts(run) == [3, 4] and _verified(run, 4)
    set_aside = sorted(n.split("-")[0] for n in os.listdir(os.path.join(run, "checkpoints.discarded")))
    assert set_aside == ["2", "3"]  # the damaged 2 (by --resume=1) and the undigested 3


def test_an_error_during_a_save_keeps_that_checkpoint(tmp_path):
    """Defect 2: a reward that fails from step 3 on stopped the run while checkpoint 2 was written.
    And reward errors over reward.max_error_fraction stop a one-process run with one line naming the
    step, the count and the first error (tests/launch/test_launch.py checks it over 2 processes
    with reward workers; this plugin scores in the trainer's process)."""
    counter = tmp_path / "calls"
    plugin = tmp_path / "late_fail.py"
    plugin.write_text(
        "import os\n"
        f"PATH = {str(counter)!r}\n"
        "def reward(response, answer, **extra):\n"
        "    with open(PATH, 'a') as fh:\n"
        "        fh.write('x')\n"
        "    if os.path.getsize(PATH) > 2 * 32:  # 32 samples a step\n"
        "        raise RuntimeError('the judge went away')\n"
        "    return float(response.strip() == answer)\n")
    run = str(tmp_path / "run")
    out = launch("--run-dir", run, *SMALL, f"reward.function={plugin}:reward", "reward.num_workers=0",
                 "reward.max_error_fraction=0.0", "trainer.save_freq=1", "trainer.total_steps=5",
                 "trace.groups=0", "trace.rescore_rows=0")  # no re-scoring: the plugin counts 32 calls a step
    assert out.returncode == 1
    stop = [line for line in out.stderr.splitlines() if "rljax.launch: error:" in line]
    assert len(stop) == 1 and "the judge went away" in stop[0], out.stderr[-3000:]  # one line, no traceback
    assert stop[0].startswith("rljax.launch: error: step 3") and "reward failed" in stop[0], stop
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert _ckpts(run)[-1] == 2 and _verified(run, 2)
    assert not [n for n in os.listdir(os.path.join(run, "checkpoints")) if "tmp" in n]


def test_nonfinite_updates_are_loud_and_stop_the_run(tmp_path):
    """Defect 3: lr=1e30 skipped every update silently and exited 0."""
    run = str(tmp_path / "run")
    out = launch("--run-dir", run, *SMALL, "actor.optim.lr=1e30", "actor.grad_clip=null",
                 "trainer.max_skipped_updates=2", "trainer.save_freq=1", "trainer.total_steps=8")
    assert out.returncode == 1, out.stderr[-3000:]
    skipped = [l for l in out.stdout.splitlines() if "update skipped" in l]
    assert skipped and "non-finite" in skipped[0]
    assert "consecutive steps" in _last_line(out.stderr) and "trainer.max_skipped_updates=2" in _last_line(out.stderr)
    rows = metrics(run)
    assert any(r.get("alerts/nonfinite_update") for r in rows)
    steps = _ckpts(run)
    assert steps and _verified(run, steps[-1])
    first_skip = min(r["step"] for r in rows if r.get("alerts/nonfinite_update"))
    assert steps[-1] < first_skip  # no checkpoint of a step whose update was skipped
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", run], cwd=REPO, env=launch_env(),
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "FAIL" in check.stdout and "updates finite" in check.stdout


def test_a_second_launch_into_a_running_run_directory_exits_2(tmp_path):
    """Defect 4: a second launch deleted the first's unfinished checkpoint and crashed."""
    run = str(tmp_path / "run")
    first = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run, *SMALL,
                              "trainer.total_steps=200"], cwd=REPO, env=launch_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        lock = os.path.join(run, "rljax.lock")
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(lock) and os.path.getsize(lock)):
            time.sleep(0.2)
        for extra in ([], ["--resume"]):
            out = launch("--run-dir", run, *SMALL, *extra, "trainer.total_steps=2", timeout=120)
            assert out.returncode == 2
            assert f"in use by another run: pid {first.pid}" in _last_line(out.stderr)
    finally:
        first.kill()
        first.wait()
    out = launch("--run-dir", run, *SMALL, "trainer.total_steps=1", "trainer.resume_mode=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stale lock of pid" in out.stdout


HOSTILE = '''
import ctypes, os, sys, time

def reward(response, answer, **extra):
    if answer == "4":
        time.sleep(60)
    if answer == "5":
        sys.exit(3)
    if answer == "6":
        ctypes.string_at(0)
    return float(response.strip() == answer)
'''


def test_hostile_rewards_are_counted_and_the_run_completes(tmp_path):
    """Defect 5: a sleeping reward hung the step; sys.exit ended the run with its code."""
    plugin = tmp_path / "hostile.py"
    plugin.write_text(HOSTILE)
    run = str(tmp_path / "run")
    out = launch("--run-dir", run, *SMALL, f"reward.function={plugin}:reward", "reward.num_workers=2",
                 "reward.timeout_s=1", "reward.max_error_fraction=1.0", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run)
    assert sum(r["reward/timeouts"] for r in rows) > 0
    assert sum(r["reward/errors"] for r in rows) > sum(r["reward/timeouts"] for r in rows)
    assert sum(r["reward/worker_restarts"] for r in rows) > 0
    assert "SystemExit: 3" in out.stderr and "SIGSEGV" in out.stderr


# Item 2 (SIGTERM triggers a final save; the resume continues from it): tests/launch/test_reliability_signals.py,
# test_sigterm_to_the_whole_job_leaves_reward_workers_scoring (the signal reaches the launcher there too).
