"""``trainer.mode=async`` and ``rollout.placement=disaggregated`` through ``python -m rljax.launch``.

Usage errors are cheap (they exit before JAX starts); the runs are real subprocesses and
slow: an error on either side (the reward's error bound, a consumer-side exception) stops both
threads within seconds with the failing side's error, resume replays the in-flight prompts, and
a disaggregated async run writes both device groups and passes the checks. (Async with
max_staleness=0 gives the synchronous metrics step for step: tests/trainer/test_async_streaming.py;
Ctrl-C stops an async run: tests/launch/test_reliability_signals.py.)
"""

import json
import subprocess
import sys
import time

import pytest

from launching import REPO, full_and_resumed, launch, launch_env, train_rows
from test_launch import SMALL

ASYNC = ["trainer.mode=async"]
IGNORED = ("timing_s/", "comm_s/", "perf/", "trace/", "memory/", "async/", "alerts/")


@pytest.mark.parametrize("args, fragment", [
    (["rollout.placement=disaggregated"], "rollout.placement=disaggregated needs rollout.num_devices"),
    (["rollout.placement=disaggregated", "rollout.num_devices=3", "rollout.tp=2"],
     "rollout.num_devices=3 must be a multiple of rollout.tp=2"),
    (["rollout.num_devices=2"], "rollout.num_devices=2 is only used with rollout.placement=disaggregated"),
    (ASYNC + ["async_training.trigger_parameter_sync_step=3", "async_training.max_staleness=1"],
     "async_training.max_staleness=1 is below trigger_parameter_sync_step-1=2"),
    (["async_training.overflow=drop"], "async_training.overflow"),
    (["trainer.mode=asynchronous"], "trainer.mode"),
    (["rollout.max_staleness=1"], "it is async_training.max_staleness"),
])
def test_placement_and_async_usage_errors(tmp_path, args, fragment):
    run_dir = tmp_path / "run"
    r = launch("--mesh=dp2", *args, "--run-dir", str(run_dir), timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], r.stderr
    assert not run_dir.exists()


def _compare(sync_rows, async_rows):
    assert len(sync_rows) == len(async_rows) > 0
    for a, b in zip(sync_rows, async_rows):
        for k, v in a.items():
            if k.startswith(IGNORED) or k == "step":
                continue
            assert k in b, k
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (a["step"], k, v, b[k])
            else:
                assert b[k] == v, (a["step"], k, v, b[k])


# async at max_staleness=0 equals the synchronous run step for step, and its trace check passes:
# tests/trainer/test_async_streaming.py (test_streaming_tau0_equals_sync_step_for_step, both admissions)


@pytest.mark.slow
def test_async_reward_error_stops_both_sides(tmp_path):
    """A reward error above reward.max_error_fraction on the rollout thread stops the run with that error."""
    plugin = tmp_path / "bad_reward.py"
    plugin.write_text("def reward(response, answer):\n    raise ValueError('reward exploded')\n")
    r = launch("--mesh=dp2", *SMALL, *ASYNC, "trainer.total_steps=3", f"reward.function={plugin}:reward",
               "reward.num_workers=0", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert r.returncode == 1
    assert "reward exploded" in r.stderr and "rollout thread failed" in r.stderr, r.stderr[-3000:]
    summary = json.load(open(tmp_path / "run" / "trace_summary.json"))
    assert summary["status"] == "failed" and "reward" in summary["error"]


@pytest.mark.slow
def test_async_consumer_error_stops_the_rollout_thread(tmp_path):
    """An exception on the learner side stops the producer too; the process exits with that error."""
    est = tmp_path / "est.py"
    est.write_text("def boom(token_level_rewards, response_mask, *, group_id, num_groups, row_mask, values, config):\n"
                   "    raise RuntimeError('estimator exploded')\n")
    t0 = time.time()
    r = launch("--mesh=dp2", *SMALL, *ASYNC, "async_training.max_staleness=2", "async_training.queue_size=2",
               "trainer.total_steps=4", f"algorithm.adv_estimator={est}:boom", "--run-dir", str(tmp_path / "run"),
               timeout=600)
    assert r.returncode == 1 and "estimator exploded" in r.stderr, r.stderr[-3000:]
    assert "did not stop" not in r.stderr
    summary = json.load(open(tmp_path / "run" / "trace_summary.json"))
    assert summary["status"] == "failed" and "estimator exploded" in summary["error"]
    assert time.time() - t0 < 600


# Ctrl-C stops an async run (exit 130, one line saying where --resume starts, the trace summary
# "failed" with StopRequested): tests/launch/test_reliability_signals.py,
# test_ctrl_c_saves_the_step_and_says_where_resume_starts[async].


@pytest.mark.slow
def test_async_resume_replays_in_flight_prompts(tmp_path):
    """N steps + --resume + N more == 2N steps at tau=0 (the queue is not checkpointed; the prompts
    queued or in generation at the checkpoint are generated again after the resume)."""
    base = ["--mesh=dp2", *SMALL, *ASYNC, "async_training.max_staleness=0"]
    full, split = full_and_resumed(base, tmp_path)
    f, s = train_rows(full), train_rows(split)
    s = {r["step"]: r for r in s}  # the resumed run rewrote metrics.jsonl from step 3 on
    _compare(f, [s[r["step"]] for r in f])
    assert [r["async/batch_index"] for r in f] == [1, 2, 3, 4]
    # the run's counters continue from the checkpoint's (issue 39 item 6: they restarted from 0 after the resume)
    for key in ("async/generated_rows", "async/weight_pushes", "async/dropped_stale", "async/dropped_overflow"):
        assert [s[r["step"]][key] for r in f] == [r[key] for r in f], key
    assert [r["async/weight_pushes"] for r in f] == [1, 2, 3, 4]
    assert [r["async/generated_rows"] for r in f] == [32, 64, 96, 128]  # tau=0: each batch's 32 rows, none ahead


@pytest.mark.slow
def test_disaggregated_async_topology_and_checks(tmp_path):
    """Disjoint device groups in topology.json and the summary; pushes every 2 updates (partial rollout
    allowed); staleness within tau; the trace checks pass."""
    run_dir = tmp_path / "run"
    r = launch("--mesh=dp2", *SMALL, *ASYNC, "rollout.placement=disaggregated", "rollout.num_devices=2",
               "async_training.max_staleness=1", "async_training.trigger_parameter_sync_step=2",
               "async_training.partial_rollout=true", "trainer.total_steps=4", "--run-dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "created 4 virtual CPU devices" in r.stdout and "2 for the learner mesh + 2 for the sampler" in r.stdout
    topo = json.load(open(run_dir / "topology.json"))
    pl = topo["placement"]
    assert pl["disjoint"] and pl["learner"]["devices"] == [0, 1] and pl["rollout"]["devices"] == [2, 3]
    assert topo["world_size"] == 2 and topo["rollout_replicas"] == 2
    rows = train_rows(run_dir)
    assert max(x["async/staleness_max"] for x in rows) <= 1
    assert [x["async/weight_pushes"] for x in rows] == [0, 1, 1, 2]  # every 2 updates
    assert all(x["async/max_version"] <= x["training/weight_version"] - 1 for x in rows)
    chk = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run_dir)], cwd=REPO, env=launch_env(),
                         capture_output=True, text=True, timeout=300)
    assert chk.returncode == 0, chk.stdout
    summ = subprocess.run([sys.executable, "-m", "rljax.trace", "summary", str(run_dir)], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert "placement: disaggregated" in summ.stdout and "disjoint" in summ.stdout, summ.stdout
    assert "asynchronous training: max_staleness 1" in summ.stdout
