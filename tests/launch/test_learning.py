"""The README's claim, end to end: the default run (`python -m rljax.launch --mesh=dp8`)
learns the embedded task to the held-out reward the README states (slow: ~1-2 minutes)."""

import json

import pytest


@pytest.mark.slow
def test_default_run_reaches_the_readme_held_out_reward(default_run):
    run, _ = default_run  # tests/conftest.py: launched once, compiled as users' runs are (its policy is also
    # the distillation learning test's teacher)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(301))  # one record per step
    val = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    assert val[0] < 0.1 and val[-1] >= 0.9, val  # README: 0.005 -> 0.965
    check = __import__("subprocess").run([__import__("sys").executable, "-m", "rljax.trace", "check", str(run)],
                                         capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout
