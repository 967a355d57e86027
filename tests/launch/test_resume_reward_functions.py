"""A resume that changes ``reward.functions`` (several rewards, issue 38 item 4) changes the run's
task as ``reward.function`` does: refused without ``--resume-from-weights``; their weights are a
setting a resume may change (recorded in config_changes.jsonl like any other)."""

import pytest

from test_resume_run import _run_dir

from rljax._resume import ResumeRefused, TASK_PREFIXES, plan

FUNCTIONS = ("reward.functions=[exact_match,fmt.py:tags]", "reward.weights=[1.0,0.5]")


def test_reward_functions_is_a_task_key_by_name():
    assert "reward.functions" in TASK_PREFIXES and "reward.function" in TASK_PREFIXES


@pytest.mark.parametrize("override, names", [
    ("reward.functions=[exact_match,fmt.py:length]", "reward.functions: ['exact_match', 'fmt.py:tags'] in the run, "
                                                  "['exact_match', 'fmt.py:length'] now"),
    ("reward.functions=[exact_match]", "reward.functions: ['exact_match', 'fmt.py:tags'] in the run, "
                                       "['exact_match'] now"),
])
def test_changing_the_reward_functions_is_another_task(tmp_path, override, names):
    run = _run_dir(tmp_path, overrides=("trainer.total_steps=60", "rollout.n=4", *FUNCTIONS))
    weights = "reward.weights=[1.0,0.2]" if override.count(",") else "reward.weights=[1.0]"
    with pytest.raises(ResumeRefused, match="^resume under another task") as e:
        plan(None, [override, weights], str(run))
    assert names in str(e.value) and "--resume-from-weights" in str(e.value)
    cfg, _, _ = plan(None, [override, weights], str(run), from_weights=True)
    assert cfg.reward.functions == tuple(override.split("=[")[1].rstrip("]").split(","))


def test_the_weights_alone_may_change(tmp_path):
    run = _run_dir(tmp_path, overrides=("trainer.total_steps=60", "rollout.n=4", *FUNCTIONS))
    cfg, _, lines = plan(None, ["reward.weights=[1.0,0.2]"], str(run))
    assert cfg.reward.weights == (1.0, 0.2) and "reward.weights=[1.0, 0.2] (was [1.0, 0.5])" in lines[0]
