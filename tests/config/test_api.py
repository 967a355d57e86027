"""rljax.train: a GRPOTrainer-like Python entry point over the launcher's configuration (issue 38 item 5)."""

import json
import os
import re
from pathlib import Path

import pytest

import rljax
from rljax.errors import UsageError
from rljax.reward import get_reward_fn, score_batch
from rljax.reward._plugin import register_callable

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "own-model-and-data.md"


def _guide_example() -> str:
    text = GUIDE.read_text()
    block = re.search(r"<!-- tests/config/test_api.py runs this block -->\n```python\n(.*?)```", text, re.S)
    assert block, "the guide's rljax.train example is gone"
    return block.group(1)


def test_callables_of_each_signature_score_as_rewards():
    def trl(completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]

    def ours(response, answer):
        return 0.5 * float(response == answer)

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 2.0 * float(solution_str == ground_truth), "acc": 1.0}

    for fn, want in ((trl, [1.0, 0.0]), (ours, [0.5, 0.0]), (verl, [2.0, 0.0])):
        spec = register_callable(fn)
        assert spec.startswith("callable:") and register_callable(fn) == spec  # once per function
        scores, _ = score_batch(get_reward_fn(spec), ["2", "3"], ["2", "2"], ["a", "b"], max_error_fraction=0.0)
        assert scores.tolist() == want, fn.__name__


def test_mistakes_raise_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(UsageError, match="non-empty list of dicts"):
        rljax.train("tiny", [], run_dir=str(run))
    with pytest.raises(UsageError, match="reward_weights needs reward_funcs"):
        rljax.train("tiny", reward_weights=[1.0], run_dir=str(run))
    with pytest.raises(UsageError, match="unknown config key 'rollout.nn'"):
        rljax.train("tiny", overrides={"rollout.nn": 4}, run_dir=str(run))
    with pytest.raises(UsageError, match="launcher refused"):  # the launcher's line: a callable in workers
        rljax.train("tiny", reward_funcs=lambda response, answer: 0.0, overrides={"reward.num_workers": 2},
                    run_dir=str(run))
    assert "a Python callable given to rljax.train runs in the trainer's process" in capsys.readouterr().err
    assert not run.exists()


@pytest.mark.slow  # trains the guide's example in a fresh process, as a user runs it: 2 steps, ~40 s
def test_the_guides_example_runs(tmp_path):
    import subprocess
    import sys

    from launching import launch_env

    (tmp_path / "example.py").write_text(_guide_example())
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=launch_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "rljax" / "tiny-rows"
    printed = [l for l in out.stdout.splitlines() if l.endswith("tiny-rows")]
    assert printed and Path(printed[-1]).resolve() == run.resolve(), out.stdout[-2000:]  # the example prints it
    assert (run / "dataset" / "train.jsonl").read_text().count("\n") == 25
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/fn/correct/mean", "reward/fn/exact_match/mean"} <= set(records[-1])
    assert max(r["step"] for r in records) == 2 and os.path.isdir(run / "checkpoints")
    assert any("val-core/local/reward/mean@1" in r for r in records)  # verl's validation names, per data source
