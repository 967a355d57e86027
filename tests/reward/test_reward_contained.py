"""Rewards cannot take the launcher or the run down (issue 28 item 2, issue 25 item 6)."""

import logging
import time

import pytest
from launching import launch

from rljax.config import ConfigError, resolve
from rljax.reward import RewardError, RewardPool, check, make_reward, score_batch


def _cfg(*overrides):
    return resolve("default", list(overrides))[0]


@pytest.mark.parametrize("body, why, timeout", [
    ("import os\nos._exit(3)\n", "ended the process with exit code 3", 30),
    # the hang waits out the whole timeout twice (check, then the launch): 1 s, not more
    ("import time\ntime.sleep(600)\n", "did not finish within 1 s (reward.import_timeout_s)", 1),
])
def test_a_plugin_that_exits_or_hangs_at_import_is_one_line(tmp_path, body, why, timeout):
    """Issue 28 (4): os._exit(3) at import ended the launcher with exit 3 and no output; a hang
    at import hung it forever."""
    plugin = tmp_path / "bad.py"
    plugin.write_text(body + "def reward(response, answer, **kw):\n    return 1.0\n")
    cfg = _cfg(f"reward.function={plugin}:reward", f"reward.import_timeout_s={timeout}")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert why in str(e.value) and "\n" not in str(e.value) and time.monotonic() - t0 < 60
    out = launch("--run-dir", str(tmp_path / "run"), f"reward.function={plugin}:reward",
                 f"reward.import_timeout_s={timeout}", timeout=120)
    assert out.returncode == 2 and why in out.stderr and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_plugin_import_error_is_still_named(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("raise ImportError('no module named foo')\n")
    with pytest.raises(ConfigError, match=r"importing .* failed: ImportError: no module named foo"):
        check(_cfg(f"reward.function={plugin}:reward"))


def test_in_process_rewards_refuse_a_timeout_they_cannot_honour():
    """Issue 28 (4): reward.num_workers=0 with a timeout hung forever on a hanging reward."""
    with pytest.raises(ConfigError, match="reward.timeout_s=5 needs reward workers"):
        check(_cfg("reward.num_workers=0", "reward.timeout_s=5"))
    check(_cfg("reward.num_workers=0"))
    pool = make_reward(_cfg("reward.timeout_s=5").reward, dataset="embedded")  # a timeout asks for workers
    try:
        assert isinstance(pool, RewardPool) and pool.timeout_s == 5.0
    finally:
        pool.close()


def _score(fn, n=8, **kw):
    return score_batch(fn, ["r"] * n, ["a"] * n, [f"u{i}" for i in range(n)], max_error_fraction=0.5, **kw)


def test_absurd_magnitudes_stop_in_one_line_unless_clipped():
    """Issue 28 (4): a reward of 1e30 was accepted (held-out score 2.3e28)."""
    with pytest.raises(RewardError) as e:
        _score(lambda r, a: 1e30)
    assert "returned 1e+30 for uid u0 (8 sample(s) over 1e+06" in str(e.value) and "reward.clip" in str(e.value)
    scores, _ = _score(lambda r, a: -1e30, clip=5.0)
    assert (scores == -5.0).all()
    fn = make_reward(_cfg("reward.clip=2").reward, dataset="embedded")
    scores, _ = score_batch(fn, ["3"], ["3"], ["u"], max_error_fraction=0.0)
    assert fn.clip == 2.0 and scores[0] == 1.0


def test_a_reward_failing_on_every_sample_stops_with_one_line(caplog):
    """Issue 25 (6): a reward raising on every sample printed one warning per sample, then a traceback."""
    def broken(response, answer):
        raise KeyError("score")

    with caplog.at_level(logging.WARNING, logger="rljax.reward"), pytest.raises(RewardError) as e:
        _score(broken, n=64)
    assert str(e.value).startswith("reward failed on every sample of the batch (64/64)")
    assert "first error: u0: KeyError: 'score'" in str(e.value)
    assert caplog.records == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rljax.reward"):  # a few failures: the first three, then a count
        fails = iter([True] * 5 + [False] * 59)
        _, report = score_batch(lambda r, a: (1 / 0) if next(fails) else 1.0, ["r"] * 64, ["a"] * 64,
                                [f"u{i}" for i in range(64)], max_error_fraction=0.5)
    assert report.errors == 5 and len(caplog.records) == 4 and "2 more sample(s)" in caplog.records[-1].getMessage()


LEAK = '''
KEPT = []

def reward(response, answer, **kw):
    KEPT.append(bytearray(48 << 20))  # 48 MB kept per call: a leaking reward
    return 1.0
'''


def test_reward_memory_mb_bounds_a_leaking_worker(tmp_path):
    """Issue 28 (4): workers had no memory limit (1.76 GB each after 6 small steps of a leaking reward)."""
    plugin = tmp_path / "leak.py"
    plugin.write_text(LEAK)
    with RewardPool(f"{plugin}:reward", num_workers=1, timeout_s=30.0, memory_mb=256) as pool:
        scores, report = score_batch(pool, ["r"] * 16, ["a"] * 16, [f"u{i}" for i in range(16)],
                                     max_error_fraction=1.0)
        assert report.errors > 0 and report.worker_restarts > 0
        assert "MemoryError: over reward.memory_mb=256 MB" in report.first_error
        assert scores.sum() == 16 - report.errors and report.errors < 8  # fresh workers score again
