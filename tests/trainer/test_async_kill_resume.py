"""Nothing lost or trained twice across ``kill -9`` (issue 23 item 5): a run (streaming
asynchronous: prompts of several batches in flight at every checkpoint; and synchronous) with a
checkpoint every step is killed with SIGKILL at seeded random points -- mid-step, mid-save,
mid-write, after the last step -- and resumed each time; then stopped with SIGTERM in its last
step (saved, the trace summary closed as failed). The resume after it has nothing to train: it says
so in one line and completes the summary of every step; one more resume writes nothing (the run
directory hashed). Then ``python -m rljax.trace check`` passes "every prompt trained once"
(rollout_uids.jsonl with its resume markers, the data positions of the batches), the trained uids
are the data order's batches 1..N once each, and every step trained the same prompts as an
uninterrupted run. The check's rules on hand-written files are in
tests/trace/test_trace_prompts_once.py. Slow: it launches about six runs (the synchronous case four)."""

import collections
import hashlib
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from rljax.trace.samples import read_samples

from launching import REPO, launch, launch_env, metrics

from test_launch import SMALL

STEPS, BATCH = 16, 8  # SMALL's data.train_batch_size; a step takes about a second here
BASE = ["--mesh=dp2", *SMALL, "rollout.max_slots=8", "data.max_response_length=24", "trainer.mode=async",
        "async_training.max_staleness=1", "async_training.partial_rollout=keep", "trainer.save_freq=1",
        "trace.log_train_generations=32", f"trainer.total_steps={STEPS}"]
SYNC_STEPS = 6
SYNC = ["--mesh=dp2", *SMALL, "trainer.save_freq=1", "trace.log_train_generations=32",
        f"trainer.total_steps={SYNC_STEPS}"]


def _trained_steps(run) -> int:
    try:
        return max((r["step"] for r in metrics(run) if "actor/pg_loss" in r), default=0)
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


def _start(run, base, resume: bool):
    args = [*base, "--run-dir", str(run)] + (["--resume"] if resume else [])
    return subprocess.Popen([sys.executable, "-m", "rljax.launch", *args], cwd=REPO, env=launch_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run, proc, step: int) -> None:
    deadline = time.time() + 400
    while _trained_steps(run) < step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def _kill_at_random(run, base, rng, resume: bool, log) -> bool:
    """Starts the run (``--resume`` after the first launch), waits until it trained a step past the
    point it started from, then SIGKILLs it after a random 0-1.5 s: anywhere in a step, a save, a
    record's write, or after the last step while the launch closes. Returns whether it killed (a
    launch that ended first did not)."""
    start = _trained_steps(run) if resume else 0
    proc = _start(run, base, resume)
    _wait_for_step(run, proc, start + 1)
    assert proc.poll() in (None, 0), f"the run failed: {proc.communicate()[1][-2000:]}"
    delay = rng.uniform(0.0, 1.5)
    time.sleep(delay)
    if proc.poll() is not None:
        assert proc.returncode == 0, proc.communicate()[1][-2000:]
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.append((start, round(delay, 2), _trained_steps(run)))
    return True


def _stop_in_the_last_step(run, base, steps: int, log) -> None:
    """A ``--resume`` launch SIGTERMed while its last step runs: it ends that step, saves it and stops
    (exit 143) with its trace summary closed as failed; a launch that reached its end first exits 0."""
    proc = _start(run, base, True)
    _wait_for_step(run, proc, steps - 1)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=400)
    assert rc in (0, 143), proc.communicate()[1][-2000:]
    log.append(("SIGTERM", rc, _trained_steps(run)))


def _tree(run) -> dict:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _kill_resume_and_finish(run, base, steps: int, seed: int, launches: int = 3) -> list:
    """SIGKILLs at random points (up to ``launches`` launches, each killed unless it ended first), a
    SIGTERM in the last step, the resumes after them; then the run is complete: a --resume has
    nothing to train and writes nothing. Returns the log of kills."""
    rng, log = random.Random(seed), []
    for k in range(launches):
        if not _kill_at_random(run, base, rng, resume=k > 0, log=log):
            break
    assert len(log) >= launches - 1, log
    if _trained_steps(run) < steps - 1:  # this launch trains the step before the last: then it is signalled
        _stop_in_the_last_step(run, base, steps, log)
    out = launch(*base, "--run-dir", str(run), "--resume")
    assert out.returncode == 0, (log, out.stderr[-3000:])
    if "nothing to train" not in out.stdout:  # a kill left the last step's checkpoint without its digest
        assert "resume: restored step" in out.stdout, (log, out.stdout[-2000:])
        log.append(("trained to the end", _trained_steps(run)))
        out = launch(*base, "--run-dir", str(run), "--resume")
        assert out.returncode == 0, (log, out.stderr[-3000:])
    # a run that trained every step: one line (beside a stale lock's, after a kill)
    lines = [x for x in out.stdout.splitlines() if x.startswith("rljax: ") and not x.startswith("rljax: stale lock")]
    assert len(lines) == 1 and f"checkpoint {steps} is at trainer.total_steps={steps}" in lines[0], (log, out.stdout)
    assert "complete, nothing to train" in lines[0], lines
    log.append(("resumed complete", lines[0].split("; ", 1)[1]))
    before = _tree(run)
    again = launch(*base, "--run-dir", str(run), "--resume")
    assert again.returncode == 0 and again.stdout.strip().count("\n") == 0, again.stdout
    assert "nothing to train" in again.stdout and "completed" not in again.stdout, again.stdout
    assert _tree(run) == before, log
    print("kills and resumes:", log)  # with -s: where the kills landed
    return log


def _check(run, log) -> str:
    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, (log, [x for x in chk.stdout.splitlines() if x.startswith("FAIL")])
    assert "PASS  every prompt trained once" in chk.stdout and "resume(s) from step(s)" in chk.stdout, chk.stdout
    return chk.stdout


def _prompts_by_step(run) -> dict:
    out = collections.defaultdict(collections.Counter)
    for r in read_samples(str(run)):
        if r["split"] == "train":
            out[int(r["step"])][r["prompt"]] += 1
    return dict(out)


def _standing_records(run) -> list:
    """rollout_uids.jsonl's step records with the resume markers applied (read here on its own, not
    with the check's reader)."""
    standing = []
    for line in (run / "rollout_uids.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "resume" in rec:
            standing = [r for r in standing if r["step"] <= rec["resume"]["restored_step"]]
        else:
            standing.append(rec)
    return standing


@pytest.mark.slow
def test_streaming_run_killed_at_random_points_trains_every_prompt_once(tmp_path):
    full, run = tmp_path / "full", tmp_path / "killed"
    out = launch(*BASE, "--run-dir", str(full))
    assert out.returncode == 0, out.stderr[-3000:]
    log = _kill_resume_and_finish(run, BASE, STEPS, seed=23)
    assert "data positions of" in _check(run, log)

    recs = _standing_records(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)), (log, [r["step"] for r in recs])
    trained = [u for r in recs for us in r["by_process"].values() for u in us]
    dropped = {int(i) for r in recs for _, i in r.get("dropped_batches", [])}
    batches = sorted(int(r["batch_index"]) for r in recs)
    assert len(trained) == len(set(trained)) == STEPS * BATCH, log
    assert set(trained) == {f"{b}-{i}" for b in batches for i in range(BATCH)}
    assert sorted(set(batches) | dropped) == list(range(1, max(batches + list(dropped)) + 1)), (batches, dropped)
    if not dropped:  # the data order's batches 1..N, each trained at its step as in the uninterrupted run
        f, k = _prompts_by_step(full), _prompts_by_step(run)
        assert sorted(f) == sorted(k) == list(range(1, STEPS + 1))
        for step in f:
            assert sum(k[step].values()) == BATCH * 4 and f[step] == k[step], (step, log)


@pytest.mark.slow
def test_sync_run_killed_at_random_points_trains_every_prompt_once(tmp_path):
    run = tmp_path / "killed"
    log = _kill_resume_and_finish(run, SYNC, SYNC_STEPS, seed=5, launches=2)
    _check(run, log)
    recs = _standing_records(run)
    assert [r["step"] for r in recs] == list(range(1, SYNC_STEPS + 1)), log
    trained = [u for r in recs for us in r["by_process"].values() for u in us]
    assert sorted(trained) == sorted(f"{s}-{i}" for s in range(1, SYNC_STEPS + 1) for i in range(BATCH)), log
