"""Reward isolation in worker processes (issue 11, defect 5): a reward that hangs, exits or
segfaults scores 0, is counted, its worker is replaced, and scoring goes on."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rljax.reward import RewardError, RewardPool, RewardWorkerError, default_num_workers, make_reward, score_batch

HOSTILE = '''
import os, sys, time, ctypes

def reward(response, answer, **extra):
    if response == "sleep":
        time.sleep(60)
    if response == "exit":
        sys.exit(3)
    if response == "_exit":
        os._exit(7)
    if response == "segv":
        ctypes.string_at(0)
    if response == "raise":
        raise ValueError("no score for you")
    if response == "pid":
        return float(os.getpid())
    if response == "heavy":
        return float(any(m in sys.modules for m in ("jax", "tensorflow", "torch")))
    if response.startswith("meet"):  # rendezvous: every sample waits for all the others
        d, n = extra["dir"], extra["n"]
        open(os.path.join(d, response), "w").close()
        deadline = time.time() + 20
        while len(os.listdir(d)) < n and time.time() < deadline:
            time.sleep(0.01)
        return float(len(os.listdir(d)) >= n)
    return float(response == answer)
'''


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "hostile.py"
    path.write_text(HOSTILE)
    return f"{path}:reward"


@pytest.fixture(scope="module")
def pool(spec):
    with RewardPool(spec, num_workers=2, timeout_s=2.0) as p:
        yield p


def test_hostile_samples_score_zero_are_counted_and_the_pool_goes_on(pool):
    responses = ["a", "sleep", "exit", "a", "segv", "_exit", "raise", "b", "a"]
    uids = [f"u{i}" for i in range(len(responses))]
    scores, report = score_batch(pool, responses, ["a"] * len(responses), uids, max_error_fraction=1.0)
    np.testing.assert_array_equal(scores, [1, 0, 0, 1, 0, 0, 0, 0, 1])
    assert report.errors == 5 and report.error_uids == ("u1", "u2", "u4", "u5", "u6")
    assert report.timeouts == 1
    assert report.worker_restarts == 3  # the sleeping, the segfaulting and the os._exit workers
    m = report.metrics()
    assert m["reward/timeouts"] == 1.0 and m["reward/errors"] == 5.0 and m["reward/worker_restarts"] == 3.0
    assert "u1: timeout after 2 s" in report.first_error
    # every worker answers again
    scores, report = score_batch(pool, ["a"] * 6, ["a"] * 6, list(range(6)), max_error_fraction=0.0)
    assert scores.tolist() == [1.0] * 6 and report.errors == 0 and pool.num_workers == 2


def test_error_messages_name_what_happened(pool):
    outcomes = pool.map([("exit", "a", {}), ("segv", "a", {}), ("_exit", "a", {}), ("raise", "a", {})])
    assert outcomes[0].error == "SystemExit: 3"
    assert outcomes[1].error == "worker killed by SIGSEGV"
    assert outcomes[2].error == "worker exited with code 7"
    assert outcomes[3].error == "ValueError: no score for you"
    assert not any(o.timeout for o in outcomes)


def test_error_bound_still_stops_the_step(pool):
    with pytest.raises(RewardError, match=r"50.0% of the batch \(2/4\)"):
        score_batch(pool, ["exit", "raise", "a", "a"], ["a"] * 4, list("wxyz"), max_error_fraction=0.25)


def test_samples_run_in_parallel_and_workers_import_nothing_heavy(spec, tmp_path):
    n = 4
    with RewardPool(spec, num_workers=n, timeout_s=30.0) as p:
        outcomes = p.map([(f"meet{i}", "", {"dir": str(tmp_path), "n": n}) for i in range(n)])
        assert [o.score for o in outcomes] == [1.0] * n  # all n were running at the same time
        pids = {o.score for o in p.map([("pid", "", {})] * 8)}
        assert len(pids) >= 2 and os.getpid() not in pids
        assert [o.score for o in p.map([("heavy", "", {})] * n)] == [0.0] * n


def test_a_reward_that_cannot_load_in_a_worker_is_one_error(tmp_path):
    with pytest.raises(RewardWorkerError, match="cannot load reward.function=.*nope.py"):
        with RewardPool(f"{tmp_path}/nope.py:reward", num_workers=1, timeout_s=1.0) as p:
            p.map([("a", "a", {})])


def test_workers_die_with_the_trainer(spec):
    code = (f"import sys, threading; from rljax.reward import RewardPool; p = RewardPool({spec!r}, num_workers=2, "
            "timeout_s=600); threading.Thread(target=p.map, args=([('sleep', '', {{}})] * 2,), daemon=True).start(); "
            "import time; time.sleep(2); print(' '.join(str(w.proc.pid) for w in p._workers), flush=True); "
            "time.sleep(600)").replace("{{}}", "{}")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_default_workers_and_make_reward(spec):
    from rljax.config import resolve

    assert default_num_workers("auto") == 0 and default_num_workers("gsm8k") == 0
    assert default_num_workers(spec) == max(1, min(8, os.cpu_count()))
    cfg, _ = resolve("default", [])
    assert callable(make_reward(cfg.reward, dataset="embedded")) and not isinstance(
        make_reward(cfg.reward, dataset="embedded"), RewardPool)
    cfg, _ = resolve("default", [f"reward.function={spec}", "reward.num_workers=1", "reward.timeout_s=5"])
    p = make_reward(cfg.reward, dataset="embedded")
    try:
        assert isinstance(p, RewardPool) and p.num_workers == 1 and p.timeout_s == 5.0
    finally:
        p.close()
