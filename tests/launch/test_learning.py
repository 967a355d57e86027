"""The README's claim, end to end: the default run (`python -m rljax.launch --mesh=dp8`)
learns the embedded task to the held-out reward the README states (slow: ~1-2 minutes)."""

import json

import pytest

from launching import launch


@pytest.mark.slow
def test_default_run_reaches_the_readme_held_out_reward(tmp_path):
    run = tmp_path / "run"
    # compiled as users' runs are (300 steps: -O0's slower programs would cost more than its compile saves)
    out = launch("--mesh=dp8", "--run-dir", str(run), timeout=1800, compile_as_user=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(301))  # one record per step
    val = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    assert val[0] < 0.1 and val[-1] >= 0.9, val  # README: 0.005 -> 0.965
    check = __import__("subprocess").run([__import__("sys").executable, "-m", "rljax.trace", "check", str(run)],
                                         capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout
