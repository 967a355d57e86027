"""verl's reward signature compute_score(data_source, solution_str, ground_truth, extra_info=None)."""

import pytest

from rljax.config import ConfigError
from rljax.reward import get_reward_fn, load_reward_plugin, score_batch

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
    assert fn(" 42 ", "42") == 1.0 and fn("41", "42") == 0.0
    module = fn.__wrapped__.__globals__
    assert module["seen"][-1] == ("openai/gsm8k", {})
    assert fn("42", "42", uid="u1") == 1.0 and module["seen"][-1] == ("openai/gsm8k", {"uid": "u1"})
    scores, report = score_batch(fn, ["42", "7"], ["42", "42"], ["a", "b"], max_error_fraction=0.0)
    assert scores.tolist() == [1.0, 0.0] and report.errors == 0


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
