"""Streaming admission in ``trainer.mode=async`` (``async_training.streaming``, issue 23 item 2), through
``python -m rljax.launch``: with tau=0 it is the synchronous run metric for metric; with tau=1 on a
long-tail length mix the producer admits prompts of the next batch while a batch's tail decodes,
every batch is trained once and in order within tau; a clean stop mid-stream and ``--resume``
trains the same prompts as the uninterrupted run, none lost, none twice. The rollout side alone
(tokens, order, the gate) is tested in test_rollout_stream.py; the queue's rule in
test_async_queue.py. All slow (real runs)."""

import collections
import subprocess
import sys

import pytest

from rljax.trace.samples import read_samples

from launching import REPO, full_and_resumed, launch, launch_env, metrics, train_rows
from test_async_launch import _compare
from test_launch import SMALL

ASYNC = ["trainer.mode=async"]
# 8 slots for 32 trajectories a batch, responses up to 24 tokens (the untrained tiny model ends
# them with EOS anywhere): a batch's tail leaves slots free that the next batch may take
LONG_TAIL = ["rollout.max_slots=8", "data.max_response_length=24"]


def _prompts_by_step(run_dir) -> dict:
    """Per step, the multiset of prompts trained (``trace.log_train_generations`` rows)."""
    out = collections.defaultdict(collections.Counter)
    for r in read_samples(str(run_dir)):
        if r["split"] == "train":
            out[int(r["step"])][r["prompt"]] += 1
    return dict(out)


TAU0_BASE = ["--mesh=dp2", *SMALL, *LONG_TAIL, "trainer.total_steps=3"]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The synchronous run both streaming settings are compared with (launched once)."""
    run = tmp_path_factory.mktemp("sync") / "run"
    r_sync = launch(*TAU0_BASE, "--run-dir", str(run))
    assert r_sync.returncode == 0, r_sync.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("streaming", ["true", "false"])
def test_streaming_tau0_equals_sync_step_for_step(tmp_path, sync_run, streaming):
    """The queue, the gate and the weight push are right: tau=0 is the synchronous schedule, with
    either admission; the trace follows the groups through the queue and the async checks pass."""
    import json

    from rljax.trace.check import run_checks

    base = TAU0_BASE
    r_async = launch(*base, *ASYNC, "async_training.max_staleness=0", f"async_training.streaming={streaming}",
                     "--run-dir", str(tmp_path / "async"))
    assert r_async.returncode == 0, r_async.stderr[-3000:]
    s, a = train_rows(sync_run), train_rows(tmp_path / "async")
    _compare(s, a)  # rollout/slot_occupancy included: the same tokens in the same slots
    assert all(r["async/staleness_max"] == 0 and r["rollout/admitted_ahead"] == 0 for r in a)
    checks = run_checks(str(tmp_path / "async"))
    assert not [c for c in checks if c[0] == "FAIL"], checks
    passed = [name for status, name, _ in checks if status == "PASS"]
    for name in ("trained staleness within tau", "no future weight version trained", "every dropped row counted"):
        assert any(p.startswith(name) for p in passed), (name, checks)
    stages = {json.loads(x)["stage"] for x in open(tmp_path / "async" / "trace.jsonl")}
    assert {"enqueue", "dequeue", "rollout_sessions", "weight_sync"} <= stages


#: tau=1 on the long-tail mix, partial rollouts re-prefilled (recompute), validating every 2 steps, the
#: training generations logged: one uninterrupted 5-step run and one stopped after step 2 and resumed
#: (``tau1_runs``), shared by the two tests below. (partial_rollout=keep across kills and resumes:
#: tests/trainer/test_async_kill_resume.py.)
TAU1_BASE = ["--mesh=dp2", *SMALL, *LONG_TAIL, *ASYNC, "async_training.max_staleness=1",
             "async_training.partial_rollout=recompute", "trainer.test_freq=2", "trace.log_train_generations=32"]


@pytest.fixture(scope="module")
def tau1_runs(tmp_path_factory):
    """``(full, split)``: :data:`TAU1_BASE` for 5 steps in one launch, and in two (2 steps, then
    ``--resume`` to 5); launched once for this module, read-only."""
    return full_and_resumed(TAU1_BASE, tmp_path_factory.mktemp("tau1"), steps=5)


@pytest.mark.slow
def test_streaming_tau1_admits_the_next_batch_and_trains_each_once_within_tau(tau1_runs):
    run, _ = tau1_runs
    # validation pauses the streaming producer between its rounds (steps 2 and 4, and the final one)
    assert [x["step"] for x in metrics(run) if "val/score/mean" in x] == [2, 4, 5]
    rows = train_rows(run)
    assert [x["async/batch_index"] for x in rows] == [1, 2, 3, 4, 5]  # each batch once, in order
    assert max(x["rollout/admitted_ahead"] for x in rows) > 0, "no prompt of a later batch was admitted early"
    assert all(x["async/staleness_max"] <= 1 for x in rows)
    assert rows[-1]["async/dropped_stale"] == 0, "the gate admitted prompts that could not be trained within tau"
    assert all(0 < x["rollout/slot_occupancy"] <= 1 for x in rows)
    # pushes land while rows of later batches decode: their token versions step up (recompute re-prefills them)
    assert max(x["async/version_span_max"] for x in rows) >= 1, [x["async/version_span_max"] for x in rows]
    assert max(x["async/spanning_rows"] for x in rows) >= 1
    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, chk.stdout
    for name in ("trained staleness within tau", "no uid generated twice", "stage and trajectory timestamps ordered",
                 "token versions tie to min_version"):
        assert f"PASS  {name}" in chk.stdout, chk.stdout


@pytest.mark.slow
def test_streaming_resume_mid_stream_loses_and_repeats_no_prompt(tau1_runs):
    """Prompts of the next batches are in flight when the run stops after step 2; the resumed run
    starts from the data position after the last trained batch and generates them again: every
    step trains the prompts the uninterrupted run trained, none lost, none twice."""
    full, split = tau1_runs
    f, s = _prompts_by_step(full), _prompts_by_step(split)
    assert sorted(f) == sorted(s) == [1, 2, 3, 4, 5]
    for step in f:
        assert sum(f[step].values()) == 32 and f[step] == s[step], step
    split_rows = train_rows(split)
    assert sorted(r["async/batch_index"] for r in split_rows) == [1, 2, 3, 4, 5]
    # the run's counters continue from the checkpoint's (issue 39 item 6): the pushes as uninterrupted; the rows
    # generated count every batch up to the one trained (and those queued ahead), never only the resumed launch's
    full_rows = train_rows(full)
    assert [r["async/weight_pushes"] for r in split_rows] == [r["async/weight_pushes"] for r in full_rows] == [1, 2, 3, 4, 5]
    generated = [r["async/generated_rows"] for r in sorted(split_rows, key=lambda r: r["step"])]
    assert all(g >= 32 * step for step, g in enumerate(generated, 1)), generated


# Multi-turn episodes (the tool preset, env.continuation=kv): every episode calls a tool once and answers
# after the observation, so each session parks on its environment between two turns
ALWAYS_OBSERVE = '''
from rljax.env import Environment, Step

class AlwaysObserve(Environment):
    def step(self, turn):
        if turn.index == 0:
            return Step(observation="=" + self.example.answer, tool="reveal")
        return Step()
'''


def _tool_args(tmp_path):
    env_file = tmp_path / "observe_env.py"
    env_file.write_text(ALWAYS_OBSERVE)
    return ["--config", "tool_lookup", "--mesh=dp2", *SMALL, "rollout.max_slots=8", "env.max_turn_tokens=3",
            "data.max_response_length=8", f"env.function={env_file}:AlwaysObserve"]


@pytest.mark.slow
def test_streaming_multi_turn_tau0_equals_sync_step_for_step(tmp_path):
    base = [*_tool_args(tmp_path), "trainer.total_steps=2"]
    r_sync = launch(*base, "--run-dir", str(tmp_path / "sync"))
    assert r_sync.returncode == 0, r_sync.stderr[-3000:]
    r_async = launch(*base, *ASYNC, "async_training.max_staleness=0", "--run-dir", str(tmp_path / "async"))
    assert r_async.returncode == 0, r_async.stderr[-3000:]
    assert "does not apply" not in r_async.stderr  # the episodes streamed
    s, a = train_rows(tmp_path / "sync"), train_rows(tmp_path / "async")
    for r in s + a:  # when an environment's answer lands between decode chunks is a matter of wall time
        assert 0 < r.pop("rollout/slot_occupancy") <= 1
    _compare(s, a)  # env/* included: the same episodes, turns, observations and tool calls
    assert all(r["env/num_turns/mean"] == 2 for r in a)
    assert all(r["async/staleness_max"] == 0 and r["rollout/admitted_ahead"] == 0 for r in a)


@pytest.mark.slow
def test_streaming_multi_turn_tau1_admits_ahead_and_trains_each_prompt_once(tmp_path):
    run = tmp_path / "run"
    r = launch(*_tool_args(tmp_path), *ASYNC, "async_training.max_staleness=1", "async_training.partial_rollout=keep",
               "trainer.total_steps=4", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = train_rows(run)
    assert [x["async/batch_index"] for x in rows] == [1, 2, 3, 4]
    assert max(x["rollout/admitted_ahead"] for x in rows) > 0, "no episode of a later batch was admitted early"
    assert all(x["async/staleness_max"] <= 1 and 0 < x["rollout/slot_occupancy"] <= 1 for x in rows)
    assert all(x["env/num_turns/mean"] == 2 and x["env/tool_calls"] == 32 for x in rows)  # whole episodes trained
    assert rows[-1]["async/dropped_stale"] == 0
    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, chk.stdout
    for name in ("trained staleness within tau", "every prompt trained once", "token versions tie to min_version"):
        assert f"PASS  {name}" in chk.stdout, chk.stdout


@pytest.mark.slow
def test_streaming_dynamic_sampling_resume_draws_and_keeps_what_the_uninterrupted_run_does(tmp_path):
    """algorithm.filter_groups with streaming (tau=0: deterministic): the next batch's first prompt batch
    is in flight when the run stops after step 1; the resumed run restarts at the data position after
    batch 1's last draw, so every step draws, keeps and drops the uninterrupted run's uids, and the
    trace check proves every drawn prompt trained or dropped once across the resume."""
    import json

    base = ["--mesh=dp2", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "data.embedded.num_train=64", "data.embedded.num_test=16", "trainer.test_freq=-1",
            "trainer.val_before_train=false", "trace.ledgers=false", "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=0", "rollout.max_slots=8", "trainer.save_freq=1", *ASYNC,
            "async_training.max_staleness=0"]
    full, split = full_and_resumed(base, tmp_path, steps=2)  # stopped after step 1, batch 2's draw in flight

    def records(run):
        with open(run / "rollout_uids.jsonl") as fh:
            recs = [json.loads(x) for x in fh]
        return {r["step"]: {k: r[k] for k in ("by_process", "dropped", "batch_index", "data_after")}
                for r in recs if "step" in r}

    f, s = records(full), records(split)
    assert sorted(f) == [1, 2] and f == s
    assert any(r["dropped"] for r in f.values()), "the tiny random policy should fail every sample of some groups"
    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(split)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, chk.stdout
    line = next(x for x in chk.stdout.splitlines() if "every prompt trained once" in x)
    assert line.startswith("PASS") and "1 resume(s)" in line and "drawn by dynamic sampling" in line, line
