"""rljax.reward: rule-based rewards, plugins, batch error isolation."""

import logging
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from rljax.config import ConfigError
from rljax.reward import (
    RewardError,
    embedded_reward,
    exact_match_reward,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_ground_truth,
    gsm8k_reward,
    load_reward_plugin,
    normalize_number,
    score_batch,
)

# ----------------------------------------------------------------------------- rules


def test_exact_match_strips_whitespace_only():
    assert exact_match_reward("  42\n", "42") == 1.0
    assert exact_match_reward("4 2", "42") == 0.0
    assert exact_match_reward("42", " 42 ") == 1.0


@pytest.mark.parametrize(
    "text, answer",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("first #### 3 then #### 5", "5"),  # the last marker
        ("#### 18 dollars, 7 left", "18"),  # first number after the marker
        ("so the answer is 1,234.50.", "1234.5"),  # fallback: the last number
        ("x = 10-3 = 7", "7"),  # '-' after a digit is not a sign
        ("it dropped to -5", "-5"),
        ("values 3,4,5", "5"),  # commas not in groups of three separate numbers
        ("$2,500 total", "2500"),
        ("42.0", "42"),
        ("no number here", None),
    ],
)
def test_extract_gsm8k_answer(text, answer):
    assert extract_gsm8k_answer(text) == answer


def test_extract_without_fallback_needs_the_marker():
    assert extract_gsm8k_answer("the answer is 7", fallback_last_number=False) is None
    assert extract_gsm8k_answer("#### 7", fallback_last_number=False) == "7"
    assert extract_gsm8k_answer("#### none; 7 before", fallback_last_number=False) == "7"


def test_normalize_number():
    assert normalize_number("1,234.50") == "1234.5"
    assert normalize_number("+3") == "3"
    assert normalize_number("-0") == "0"
    assert normalize_number("7.") == "7"
    assert normalize_number("abc") is None
    assert normalize_number("nan") is None


def test_gsm8k_ground_truth():
    assert gsm8k_ground_truth("He has 3+4=<<3+4=7>>7.\n#### 7") == "7"
    assert gsm8k_ground_truth("#### 1,200") == "1200"
    assert gsm8k_ground_truth("seven") == "seven"


def test_gsm8k_reward():
    assert gsm8k_reward("Step... #### 72", "72") == 1.0
    assert gsm8k_reward("Step... the answer is 72.", "72") == 1.0
    assert gsm8k_reward("#### 72.00", "72") == 1.0
    assert gsm8k_reward("#### 71", "72") == 0.0
    assert gsm8k_reward("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_reward("no idea", "72", format_score=0.1) == 0.0
    assert gsm8k_reward("#### 1,000", "1000") == 1.0


def test_embedded_reward_values():
    assert embedded_reward("15", "15") == 1.0
    assert embedded_reward(" 15 ", "15") == 1.0
    assert embedded_reward("", "15") == 0.0
    assert embedded_reward("16", "15") == pytest.approx((0.1 * 2 + 0.4 * 1) / 2)
    assert embedded_reward("15x", "15") == pytest.approx((0.1 * 2 + 0.4 * 2) / 3)  # runs on past the answer
    assert embedded_reward("99", "15") == pytest.approx(0.1)  # digits, nothing matches
    assert embedded_reward("x", "15") == 0.0
    assert embedded_reward("9999", "8") == pytest.approx(0.1)
    assert embedded_reward("8x", "8") == pytest.approx((0.1 + 0.4) / 2)
    assert embedded_reward("cba", "cba") == 1.0
    assert embedded_reward("cbb", "cba") == pytest.approx((0.1 * 3 + 0.4 * 2) / 3)
    assert embedded_reward("cb1", "cba") == pytest.approx((0.1 * 2 + 0.4 * 2) / 3)


@given(st.text(alphabet="0123456789abc x", max_size=8), st.text(alphabet="0123456789", min_size=1, max_size=3))
def test_embedded_reward_is_in_unit_interval_and_exact_is_strictly_best(response, answer):
    r = embedded_reward(response, answer)
    assert 0.0 <= r <= 1.0
    if response.strip() != answer:
        assert r < 0.5


# ----------------------------------------------------------------------------- plugins


def _write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(body)
    return p


def test_plugin_loads_and_receives_extra(tmp_path):
    p = _write(tmp_path, "my_reward.py",
               "def score(response, answer, **extra):\n    return float(response == answer) + extra.get('bonus', 0)\n")
    fn = load_reward_plugin(f"{p}:score")
    assert fn("a", "a") == 1.0 and fn("a", "b", bonus=0.5) == 0.5
    assert get_reward_fn(f"{p}:score", dataset="gsm8k")("a", "a") == 1.0


def test_plugin_without_var_keyword_gets_only_named_extras(tmp_path):
    p = _write(tmp_path, "narrow.py", "def score(response, answer, uid=None):\n    return 1.0 if uid == 'u1' else 0.0\n")
    fn = load_reward_plugin(f"{p}:score")
    assert fn("x", "y", uid="u1", row=3, other="ignored") == 1.0


@pytest.mark.parametrize(
    "body, attr, fragment",
    [
        ("x = 1\n", "score", "has no attribute 'score'"),
        ("score = 3\n", "score", "is not callable (it is int)"),
        ("raise RuntimeError('boom at import')\n", "score", "importing"),
        ("def score(response):\n    return 1.0\n", "score", "must accept (response, answer"),
        ("def helper(r, a):\n    return 0\n", "scroe", "callables there: helper"),
    ],
)
def test_bad_plugins_raise_config_errors(tmp_path, body, attr, fragment):
    p = _write(tmp_path, "bad.py", body)
    with pytest.raises(ConfigError) as e:
        load_reward_plugin(f"{p}:{attr}")
    assert fragment in str(e.value) and "reward.function" in str(e.value) and "\n" not in str(e.value)


def test_missing_file_and_malformed_specs(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_reward_plugin(f"{tmp_path}/nope.py:score")
    with pytest.raises(ConfigError, match="path/to/file.py:function_name"):
        load_reward_plugin("no_colon.py")
    with pytest.raises(ConfigError, match="identifier"):
        load_reward_plugin("f.py:1abc")


def test_builtin_and_auto_rewards():
    assert get_reward_fn("auto", dataset="embedded") is embedded_reward
    assert get_reward_fn("auto", dataset="gsm8k") is gsm8k_reward
    assert get_reward_fn("exact_match") is exact_match_reward
    with pytest.raises(ConfigError, match="no default for data.dataset"):
        get_reward_fn("auto", dataset="other")


# ----------------------------------------------------------------------------- score_batch


def _flaky(response, answer, **extra):
    if response == "raise":
        raise KeyError("bad row")
    if response == "nan":
        return math.nan
    if response == "str":
        return "1.0"
    if response == "none":
        return None
    return float(response == answer)


def test_score_batch_isolates_errors_and_logs_uids(caplog):
    responses = ["a", "raise", "b", "nan", "a", "str", "none", "a", "a", "a"]
    answers = ["a"] * 10
    uids = [f"u{i}" for i in range(10)]
    with caplog.at_level(logging.WARNING, logger="rljax.reward"):
        scores, report = score_batch(_flaky, responses, answers, uids, max_error_fraction=0.5)
    assert scores.dtype == np.float32 and scores.shape == (10,)
    np.testing.assert_array_equal(scores, [1, 0, 0, 0, 1, 0, 0, 1, 1, 1])
    assert report.errors == 4 and report.error_uids == ("u1", "u3", "u5", "u6")
    assert report.num_scored == 10 and report.error_fraction == pytest.approx(0.4)
    assert report.metrics()["reward/errors"] == 4.0
    assert report.first_error.startswith("u1: KeyError")
    logged = [r.getMessage() for r in caplog.records]  # the first three by uid, then one count (issue 25)
    assert [f"uid {uid} " in m for uid, m in zip(report.error_uids[:3], logged)] == [True] * 3
    assert len(logged) == 4 and "1 more sample(s)" in logged[3]


def test_score_batch_raises_over_the_threshold():
    responses = ["raise", "raise", "a", "a", "a"]
    with pytest.raises(RewardError) as e:
        score_batch(_flaky, responses, ["a"] * 5, list("vwxyz"), max_error_fraction=0.2)
    msg = str(e.value)
    assert "2/5" in msg and "40.0%" in msg and "reward.max_error_fraction=0.2" in msg and "v: KeyError" in msg
    # exactly at the threshold passes
    _, report = score_batch(_flaky, responses[1:], ["a"] * 4, list("wxyz"), max_error_fraction=0.25)
    assert report.errors == 1


def test_padding_rows_are_never_scored_nor_counted():
    calls = []

    def fn(response, answer, **extra):
        calls.append(response)
        if response == "raise":
            raise ValueError("x")
        return 1.0

    responses = ["ok", "raise", "raise", "ok"]
    pad = np.array([False, True, False, True])
    scores, report = score_batch(fn, responses, ["a"] * 4, list("abcd"), max_error_fraction=0.5, is_padding=pad)
    assert calls == ["ok", "raise"]
    np.testing.assert_array_equal(scores, [1, 0, 0, 0])
    assert report.num_padding == 2 and report.num_scored == 2 and report.errors == 1
    assert report.error_fraction == 0.5  # of the real rows, not of the padded batch
    with pytest.raises(RewardError):
        score_batch(fn, responses, ["a"] * 4, list("abcd"), max_error_fraction=0.4, is_padding=pad)
    scores, report = score_batch(fn, ["raise"] * 2, ["a"] * 2, ["p", "q"], max_error_fraction=0.0,
                                 is_padding=[True, True])
    assert report.num_scored == 0 and report.errors == 0 and not scores.any()


def test_score_batch_passes_extras_and_accepts_numpy_and_bool_scores():
    def fn(response, answer, **extra):
        return np.float64(extra["w"]) if response == "np" else (response == answer)

    scores, report = score_batch(fn, ["np", "a", "b"], ["a", "a", "a"], [0, 1, 2], max_error_fraction=0.0,
                                 extras=[{"w": 0.25}, {"w": 0}, {"w": 0}])
    np.testing.assert_allclose(scores, [0.25, 1.0, 0.0])
    assert report.errors == 0


def test_score_batch_argument_checks():
    with pytest.raises(ValueError, match="must match"):
        score_batch(_flaky, ["a"], ["a", "b"], [0], max_error_fraction=0.1)
    with pytest.raises(ValueError, match="max_error_fraction"):
        score_batch(_flaky, ["a"], ["a"], [0], max_error_fraction=1.5)
    with pytest.raises(ValueError, match="is_padding"):
        score_batch(_flaky, ["a"], ["a"], [0], max_error_fraction=0.1, is_padding=[True, False])
