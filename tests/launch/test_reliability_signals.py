"""Issue 28 items 3-4 and 6 end to end: signals lose nothing, a resume under another task
needs --resume-from-weights, replayed steps are recorded once. Real launches; all slow."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from launching import REPO, launch, launch_env, train_rows

SMALL = ["--mesh=dp1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "data.embedded.num_train=64", "data.embedded.num_test=8", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trace.groups=1"]

pytestmark = pytest.mark.slow

REWARD = '''
def reward(response, answer, **kw):
    return float(response.strip() == answer)
'''


def _steps(run):
    return [r["step"] for r in train_rows(run)]


def _ckpts(run):
    d = os.path.join(run, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _descendants(pid: int) -> list[int]:
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out += kids.get(p, [])
        todo += kids.get(p, [])
    return out


def _start(run, *args):
    return subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run, *SMALL, *args], cwd=REPO,
                            env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_steps(proc, run, n, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(os.path.join(run, "metrics.jsonl")) and len(_steps(run)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {n}: {proc.communicate(timeout=60)[1][-2000:]}")


def _records_once(run):
    """Every step appears once in metrics.jsonl and rollout_uids.jsonl, and each (step, uid, stage)
    once in trace.jsonl."""
    steps = _steps(run)
    assert steps == sorted(set(steps)), steps
    with open(os.path.join(run, "rollout_uids.jsonl")) as fh:
        uid_steps = [r["step"] for r in map(json.loads, fh) if "resume" not in r]  # markers: guard.mark_resume
    assert uid_steps == sorted(set(uid_steps)) == steps, (uid_steps, steps)
    with open(os.path.join(run, "trace.jsonl")) as fh:
        keys = [(r["step"], r["uid"], r["stage"]) for r in map(json.loads, fh)]
    assert len(keys) == len(set(keys)) and sorted({k[0] for k in keys}) == steps


@pytest.mark.parametrize("mode", [
    pytest.param([], id="sync"),
    pytest.param(["trainer.mode=async"], id="async"),
    pytest.param(["--config", "tool_lookup"], id="multi-turn"),
])
def test_ctrl_c_saves_the_step_and_says_where_resume_starts(tmp_path, mode):
    """Issue 28 (6): SIGINT saved nothing and said "interrupted after step 7" when step 7 never
    finished. Now it finishes the step, saves it, and names the step the next --resume starts from;
    the resume records every step once (trace and uid records were written twice). The run stops
    within 2 minutes of the signal (an async run's producer thread too: it was
    test_async_launch.py's Ctrl-C test, a launch of its own) and its trace summary says it stopped."""
    run = str(tmp_path / "run")
    proc = _start(run, *mode, "trainer.total_steps=100", "trainer.save_freq=1")
    try:
        _wait_steps(proc, run, 2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "did not stop" not in err, err[-3000:]
    with open(os.path.join(run, "trace_summary.json")) as fh:  # before the resume completes it
        summary = json.load(fh)
    assert summary["status"] == "failed" and "StopRequested" in summary["error"], summary.get("error")
    last = _ckpts(run)[-1]
    line = [l for l in err.splitlines() if l.startswith("rljax.launch: stopped by SIGINT")]
    assert line and f"after step {last}; saved checkpoint {last}" in line[0]
    assert f"the next --resume starts from step {last + 1}" in line[0]
    assert os.path.exists(os.path.join(run, "checkpoints", str(last), "rljax_digest.json"))
    r = launch("--run-dir", run, "--resume", f"trainer.total_steps={last + 1}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"restored step {last}" in r.stdout
    assert _steps(run)[-1] == last + 1
    _records_once(run)


def test_sigterm_to_the_whole_job_leaves_reward_workers_scoring(tmp_path):
    """Issue 28 (3): a SIGTERM to the process group (SLURM, Kubernetes) killed the reward workers;
    2 of 512 samples scored 0 and that step was checkpointed. Here every process of the job gets
    SIGTERM; the saved step has no reward error and the resume continues.

    And issue 11 item 2 (SLURM, TPU maintenance): SIGTERM triggers a final save. No periodic saves
    here (the preset's save_freq, 100 steps), so the one checkpoint is the one the signal made, of
    the step it interrupted, verified; the resume restores it and trains on, every step once.
    (That was test_reliability_e2e.py's SIGTERM test, a launch pair of its own.)"""
    plugin = tmp_path / "exact.py"
    plugin.write_text(REWARD)
    run = str(tmp_path / "run")
    proc = _start(run, f"reward.function={plugin}:reward", "reward.num_workers=2", "reward.max_error_fraction=0.0",
                  "trainer.total_steps=100")
    try:
        _wait_steps(proc, run, 2)
        workers = _descendants(proc.pid)
        assert workers, "no reward worker processes"
        os.killpg(proc.pid, signal.SIGTERM)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    ckpts = _ckpts(run)
    assert len(ckpts) == 1 and ckpts[0] >= 2, ckpts  # the signal's save alone, after the 2 steps waited for
    last = ckpts[0]
    assert os.path.exists(os.path.join(run, "checkpoints", str(last), "rljax_digest.json"))  # verified
    assert f"saved checkpoint {last}" in err
    assert all(r["reward/errors"] == 0 for r in train_rows(run)), [r["reward/errors"] for r in train_rows(run)]
    assert not [p for p in workers if os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read()]
    r = launch("--run-dir", run, "--resume", f"trainer.total_steps={last + 1}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"restored step {last}" in r.stdout
    assert _steps(run)[-1] == last + 1
    _records_once(run)


def test_resume_from_weights_starts_another_task_from_the_policy(tmp_path):
    """Issue 28 (5): a resume under another task continued silently; now it refuses (exit 2, no
    file changed) unless --resume-from-weights, which says in one line what it keeps."""
    run = str(tmp_path / "run")
    r = launch("--run-dir", run, *SMALL, "trainer.total_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    refused = launch("--run-dir", run, "--resume", "data.embedded.task=reverse", "trainer.total_steps=2")
    assert refused.returncode == 2 and "--resume-from-weights" in refused.stderr
    r = launch("--run-dir", run, "--resume-from-weights", "data.embedded.task=reverse", "data.max_prompt_length=16",
               "trainer.total_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in r.stdout.splitlines() if "--resume-from-weights" in l]
    assert line and "the policy weights of checkpoint 1" in line[0] and "start fresh" in line[0]
    assert _steps(run) == [1, 2]
