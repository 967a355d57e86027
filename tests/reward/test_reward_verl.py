"""verl's reward signature compute_score(data_source, solution_str, ground_truth, extra_info=None)."""

import pytest

from rljax.config import ConfigError
from rljax.reward import as_result, get_reward_fn, load_reward_plugin, score_batch

VERL_FILE = '''
seen = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, extra_info))
    if data_source != "openai/gsm8k":
        return 0.0
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1.0}


def no_extra(data_source, solution_str, ground_truth):
    return 1.0 if solution_str == ground_truth else 0.5
'''


@pytest.fixture
def verl_file(tmp_path):
    p = tmp_path / "verl_reward.py"
    p.write_text(VERL_FILE)
    return p


def test_verl_signature_gets_the_data_source_and_a_dict_result_gives_its_score(verl_file):
    fn = get_reward_fn(f"{verl_file}:compute_score", dataset="gsm8k")
    assert as_result(fn(" 42 ", "42")) == (1.0, {"acc": 1.0}) and as_result(fn("41", "42"))[0] == 0.0
    module = fn.__wrapped__.__globals__
    assert module["seen"][-1] == ("openai/gsm8k", {})
    assert as_result(fn("42", "42", uid="u1"))[0] == 1.0 and module["seen"][-1] == ("openai/gsm8k", {"uid": "u1"})
    scores, report = score_batch(fn, ["42", "7"], ["42", "42"], ["a", "b"], max_error_fraction=0.0)
    assert scores.tolist() == [1.0, 0.0] and report.errors == 0


PRED_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = solution_str.strip() == ground_truth
    return {"score": float(ok), "acc": ok, "pred": solution_str.strip(), "format": 0.5, "note": None}
'''


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dict_returns_extra_keys_logged_as_reward_extra(tmp_path, workers):
    """verl logs a compute_score dict's other keys (issue 38: all but the score were lost); in-process and in a worker."""
    from types import SimpleNamespace

    from rljax.reward import make_reward

    (tmp_path / "r.py").write_text(PRED_FILE)
    cfg = SimpleNamespace(function=f"{tmp_path / 'r.py'}:compute_score", functions=(), weights=(), num_workers=workers,
                          timeout_s=None, memory_mb=None, clip=None, import_timeout_s=30.0)
    fn = make_reward(cfg, dataset="gsm8k")
    try:
        scores, report = score_batch(fn, ["42", "7", "42", "x"], ["42", "42", "42", "42"], list("abcd"),
                                     max_error_fraction=0.0, is_padding=[False, False, False, True])
    finally:
        getattr(fn, "close", lambda: None)()
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    metrics = report.metrics()
    assert metrics["reward/extra/acc"] == pytest.approx(2 / 3) and metrics["reward/extra/format"] == 0.5
    assert not any("pred" in k or "note" in k for k in metrics)  # text is no metric
    assert [e and e["pred"] for e in report.row_extras] == ["42", "7", "42", None]
    assert report.extra_values("acc", 4)[:3].tolist() == [1.0, 0.0, 1.0]


def test_verl_signature_without_extra_info(verl_file):
    fn = load_reward_plugin(f"{verl_file}:no_extra", data_source="rljax/embedded")
    assert fn("a", "a", uid="x") == 1.0 and fn("a", "b") == 0.5


def test_neither_signature_names_both(tmp_path):
    p = tmp_path / "bad.py"
    p.write_text("def score(a, b, c):\n    return 0.0\n")
    with pytest.raises(ConfigError) as e:
        load_reward_plugin(f"{p}:score")
    msg = str(e.value)
    assert "(response, answer, **extra)" in msg and "(data_source, solution_str, ground_truth" in msg


def test_the_filters_acc_is_the_dicts_acc():
    """algorithm.filter_groups.metric=acc reads a compute_score dict's acc (verl's DAPO), the task score elsewhere."""
    from rljax.reward import RewardReport, filter_values

    report = RewardReport(3, 0, 0, (), None, row_extras=({"acc": 1.0}, None, {"acc": 0.0}))
    assert filter_values("acc", [0.5, 0.7, 0.9], [9, 9, 9], report).tolist() == [1.0, 0.7, 0.0]
    assert filter_values("score", [0.5, 0.7, 0.9], [9, 9, 9], report).tolist() == [9, 9, 9]
    assert filter_values("acc", [0.5], [9], RewardReport(1, 0, 0, (), None)).tolist() == [0.5]
