"""Several weighted reward functions (TRL's reward_funcs / reward_weights; issue 38 item 4)."""

import json
from types import SimpleNamespace

import pytest

from rljax.config import ConfigError, resolve
from rljax.reward import RewardError, make_reward, merge_extras, score_batch

FILE = '''
def correct(response, answer, **extra):
    return float(response.strip() == answer)


def short(response, answer):
    if response == "boom":
        raise ValueError("no length for boom")
    return 1.0 / len(response)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 2.0, "acc": 1.0}
'''


def _reward(tmp_path, functions, weights=(), workers=0):
    (tmp_path / "r.py").write_text(FILE)
    cfg = SimpleNamespace(function="auto", functions=tuple(f"{tmp_path / 'r.py'}:{f}" if ":" not in f and
                                                           f not in ("gsm8k", "exact_match") else f
                                                           for f in functions),
                          weights=tuple(weights), num_workers=workers, timeout_s=None, memory_mb=None, clip=None,
                          import_timeout_s=30.0)
    return make_reward(cfg, dataset="gsm8k")


@pytest.mark.parametrize("workers", [0, 1])
def test_weighted_sum_each_function_logged(tmp_path, workers):
    fn = _reward(tmp_path, ["correct", "short", "exact_match"], [1.0, 0.5, 2.0], workers)
    try:
        scores, report = score_batch(fn, ["7", "12"], ["7", "7"], ["a", "b"], max_error_fraction=0.0)
    finally:
        getattr(fn, "close", lambda: None)()
    assert scores.tolist() == pytest.approx([1.0 + 0.5 * 1.0 + 2.0, 0.0 + 0.5 * 0.5 + 0.0])
    m = report.metrics()
    assert m["reward/fn/correct/mean"] == 0.5 and m["reward/fn/short/mean"] == 0.75
    assert m["reward/fn/exact_match/mean"] == 0.5 and m["reward/fn/short/errors"] == 0.0


def test_the_error_bound_holds_per_function(tmp_path):
    fn = _reward(tmp_path, ["correct", "short"])
    scores, report = score_batch(fn, ["7", "boom", "9", "8"], ["7"] * 4, list("abcd"), max_error_fraction=0.25)
    assert scores.tolist() == pytest.approx([2.0, 0.0, 1.0, 1.0])  # short's part of the failed row scores 0
    assert report.errors == 0 and report.metrics()["reward/fn/short/errors"] == 1.0
    with pytest.raises(RewardError, match=r"reward function short failed on 50.0% of the batch \(2/4\).*no length"):
        score_batch(fn, ["7", "boom", "boom", "8"], ["7"] * 4, list("abcd"), max_error_fraction=0.25)


def test_a_verl_dict_among_them_keeps_its_extras(tmp_path):
    fn = _reward(tmp_path, ["correct", "compute_score"], [1.0, 0.25])
    scores, report = score_batch(fn, ["7"], ["7"], ["a"], max_error_fraction=0.0)
    assert scores.tolist() == [1.5] and report.metrics()["reward/extra/acc"] == 1.0


def test_config_keys():
    cfg, _ = resolve(None, ["reward.functions=[a.py:f,gsm8k]", "reward.weights=[1,0.5]"], validate=True)
    assert cfg.reward.functions == ("a.py:f", "gsm8k") and cfg.reward.weights == (1.0, 0.5)
    for bad, says in ((["reward.functions=[a.py:f]", "reward.weights=[1,2]"], "2 weights for 1"),
                      (["reward.weights=[1]"], "reward.functions, which is empty"),
                      (["reward.functions=[a.py:f]", "reward.function=gsm8k"], "both set"),
                      (["reward.functions=[nope]"], "not a built-in reward")):
        with pytest.raises(ConfigError, match=says):
            resolve(None, bad)


def test_reports_of_parts_merge_to_the_whole_batchs(tmp_path):
    """Two processes each score their own rows; before, the merged report dropped every extra
    (reward/extra/<key>, reward/fn/<name>/mean and /errors were missing over 2 processes)."""
    fn = _reward(tmp_path, ["correct", "short", "compute_score"], [1.0, 0.5, 0.25])
    responses, answers, uids = ["7", "boom", "9", "8", "7", "77"], ["7"] * 6, list("abcdef")
    whole = score_batch(fn, responses, answers, uids, max_error_fraction=0.5)[1]
    parts = [score_batch(fn, responses[lo:hi], answers[lo:hi], uids[lo:hi], max_error_fraction=0.5)[1]
             for lo, hi in ((0, 1), (1, 6))]  # shares of different sizes: a mean of means would differ
    merged = merge_extras([p.extras_record() for p in parts])
    assert merged["extra_means"] == pytest.approx(whole.extra_means) and merged["extra_means"]
    assert merged["function_errors"] == whole.function_errors == {"short": (1, "ValueError: no length for boom")}
    assert merged["extra_totals"] == whole.extra_totals  # sums of halves, 0.5 and 1: exact
    assert json.loads(json.dumps(parts[1].extras_record())) == parts[1].extras_record()  # what processes exchange
    assert whole.metrics()["reward/fn/short/mean"] == 4.5 / 6  # the failed row's part scored 0
