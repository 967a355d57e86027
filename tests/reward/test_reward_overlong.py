"""DAPO's overlong reward shaping (``reward.reward_kwargs.overlong_buffer_cfg``): the penalty equals
verl's ``DAPORewardManager`` formula on hand cases, misuse is one ConfigError line, and on a real
step the penalty is what separates the shaped scores from the task scores."""

import numpy as np
import pytest

from rljax.reward import overlong_metrics, overlong_penalty


def _verl(valid_response_length, *, max_resp_len, buffer_len, penalty_factor):
    """verl's DAPORewardManager.__call__, per sample (recipe/dapo; verl/workers/reward_manager/dapo.py)."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


# (lengths, max_resp_len, len, penalty_factor, hand-computed penalties)
CASES = [
    ([0, 1, 4, 5, 6, 7, 8], 8, 4, 1.0, [0, 0, 0, -0.25, -0.5, -0.75, -1.0]),
    ([3, 6, 8], 8, 2, 0.5, [0, 0, -0.5]),
    ([8, 1], 8, 8, 1.0, [-1.0, -0.125]),  # the whole response is the buffer
    ([10], 8, 4, 1.0, [-1.5]),  # past the limit (max_resp_len < the sampler's): not clipped, as verl's
    ([7, 8], 8, 1, 2.0, [0, -2.0]),
    ([5, 8], 8, 4, 0.0, [0, 0]),
]


@pytest.mark.parametrize("lengths,limit,buf,factor,want", CASES)
def test_overlong_penalty_equals_verls_formula_on_hand_cases(lengths, limit, buf, factor, want):
    got = overlong_penalty(np.array(lengths), max_resp_len=limit, buffer_len=buf, penalty_factor=factor)
    verl = [_verl(n, max_resp_len=limit, buffer_len=buf, penalty_factor=factor) for n in lengths]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-7)
    np.testing.assert_allclose(got, verl, atol=1e-7)


def test_overlong_metrics_count_real_rows_only():
    p = np.array([0.0, -0.5, -1.0, -1.0], np.float32)
    m = overlong_metrics(p, [True, True, True, False])
    assert m == {"reward/overlong_penalty/mean": pytest.approx(-0.5), "reward/overlong_frac": pytest.approx(2 / 3)}
    assert overlong_metrics(p, [False] * 4)["reward/overlong_frac"] == 0.0


def test_overlong_penalty_rejects_a_buffer_outside_the_limit():
    with pytest.raises(ValueError, match="len=0"):
        overlong_penalty([1], max_resp_len=8, buffer_len=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match="len=9"):
        overlong_penalty([1], max_resp_len=8, buffer_len=9, penalty_factor=1.0)


@pytest.mark.parametrize("overrides,match", [
    (["reward.reward_kwargs.overlong_buffer_cfg.enable=true"], r"overlong_buffer_cfg.len=0 must be in \[1, 8\]"),
    (["reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=9"],
     r"len=9 must be in \[1, 8\]"),
    (["reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=6",
      "reward.reward_kwargs.max_resp_len=4"], r"len=6 must be in \[1, 4\]"),
    (["reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=-1"], "penalty_factor"),
])
def test_overlong_misuse_is_one_config_error_line(overrides, match):
    from rljax.config import ConfigError, resolve
    from rljax.reward import check

    with pytest.raises(ConfigError, match=match) as e:  # the schema's range checks or rljax.reward.check
        check(resolve("default", ["data.max_response_length=8", *overrides])[0])
    assert "\n" not in str(e.value)


def test_overlong_off_by_default_and_accepted_when_it_fits():
    from rljax.config import resolve

    cfg, _ = resolve("default", [])
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.enable is False
    cfg, _ = resolve("default", ["reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                                 "reward.reward_kwargs.overlong_buffer_cfg.len=3"])
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.len == 3


@pytest.mark.slow
def test_run_scores_are_task_scores_plus_the_overlong_penalty(tmp_path):
    """Same seed with and without shaping: the first step's rollouts are the same, so the shaped
    mean score is the task mean score plus the logged mean penalty."""
    from test_rollout_mismatch import _one_step

    on = ["reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=3",
          "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"]
    _, m_off, _ = _one_step(tmp_path, "off")
    _, m_on, _ = _one_step(tmp_path, "on", *on)
    assert "reward/overlong_frac" not in m_off
    assert m_on["response_length/mean"] == m_off["response_length/mean"]
    assert 0 < m_on["reward/overlong_frac"] <= 1 and m_on["reward/overlong_penalty/mean"] < 0
    # len = the whole limit (the preset's data.max_response_length=3): a response of l tokens gets -(l / 3) * 0.5
    np.testing.assert_allclose(m_on["reward/overlong_penalty/mean"], -m_on["response_length/mean"] / 3 * 0.5, rtol=1e-5)
    np.testing.assert_allclose(m_on["critic/score/mean"], m_off["critic/score/mean"] + m_on["reward/overlong_penalty/mean"],
                               rtol=1e-5, atol=1e-6)
