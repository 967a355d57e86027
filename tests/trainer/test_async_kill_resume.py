"""Nothing lost or trained twice across ``kill -9`` (issue 23 item 5): a streaming asynchronous run
(prompts of several batches in flight at every checkpoint, a checkpoint every step) is killed with
SIGKILL at seeded random points -- mid-step, mid-save, mid-write -- and resumed each time, to the
end. Then ``python -m rljax.trace check`` passes "every prompt trained once" (rollout_uids.jsonl
with its resume markers, the data positions of the batches), the trained uids are the data
order's batches 1..N once each, and every step trained the same prompts as an uninterrupted run.
The check's rules on hand-written files are in tests/trace/test_trace_prompts_once.py. Slow: it
launches six runs."""

import collections
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


def _trained_steps(run) -> int:
    try:
        return max((r["step"] for r in metrics(run) if "actor/pg_loss" in r), default=0)
    except (OSError, ValueError):  # not written yet, or a line being written
        return 0


def _kill_at_random(run, rng, resume: bool, log) -> None:
    """Starts the run (``--resume`` after the first launch), waits until it trained a step past the
    point it started from, then SIGKILLs it after a random 0-1.5 s (anywhere in a step, a save or a
    record's write), unless it is within 4 steps of the end (a kill after the last step is another
    story: the final --resume would have nothing to train); returns whether it killed."""
    start = _trained_steps(run) if resume else 0
    args = [*BASE, "--run-dir", str(run)] + (["--resume"] if resume else [])
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", *args], cwd=REPO, env=launch_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while _trained_steps(run) <= start and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()[1][-2000:]}"
    delay = rng.uniform(0.0, 1.5)
    if _trained_steps(run) >= STEPS - 4:
        assert proc.wait(timeout=400) == 0, proc.communicate()[1][-2000:]
        return False
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.append((start, round(delay, 2), _trained_steps(run)))
    return True


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
    rng, log = random.Random(23), []
    for k in range(3):
        if not _kill_at_random(run, rng, resume=k > 0, log=log):
            break
    assert len(log) >= 2, log
    out = launch(*BASE, "--run-dir", str(run), "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resume: restored step" in out.stdout, (log, out.stdout[-2000:])

    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, (log, [x for x in chk.stdout.splitlines() if x.startswith("FAIL")])
    assert "PASS  every prompt trained once" in chk.stdout, chk.stdout
    assert "resume(s) from step(s)" in chk.stdout and "data positions of" in chk.stdout, chk.stdout

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
