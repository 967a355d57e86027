"""Per-data_source validation metrics with verl's names (issue 38 item 3)."""

import pytest

from rljax.reward._val_metrics import validation_metrics


def test_one_sample_per_prompt_is_mean_at_1_per_source():
    m = validation_metrics(["gsm8k", "gsm8k", "math"], ["a", "b", "c"], [1.0, 0.0, 0.5], [None, None, None])
    assert m == {"val-core/gsm8k/reward/mean@1": 0.5, "val-core/math/reward/mean@1": 0.5}


def test_n_samples_best_worst_maj_and_acc_as_the_core_variable():
    scores = [0.0, 0.0, 0.0, 1.0] * 2
    extras = [{"acc": s, "pred": p} for s, p in zip(scores, ["x", "x", "x", "y", "x", "y", "y", "x"])]
    m = validation_metrics(["s"] * 8, ["a"] * 4 + ["b"] * 4, scores, extras)
    assert m["val-core/s/acc/mean@4"] == 0.25 and m["val-aux/s/reward/mean@4"] == 0.25
    assert m["val-core/s/acc/best@4/mean"] == pytest.approx(1 - 0.75 ** 4, abs=0.04)  # P(a 1 among 4 draws)
    assert m["val-aux/s/acc/worst@2/mean"] == pytest.approx(0.25 ** 2, abs=0.03)
    # prompt a's majority pred is x (value 0) almost always; b's is y (0) or x (0/1): under 0.5 on average
    assert m["val-core/s/acc/maj@4/mean"] < 0.3 and "val-aux/s/acc/maj@2/mean" in m
    assert "val-aux/s/acc/std@4" in m and not any(k.startswith("val-core/s/reward") for k in m)
    assert m == validation_metrics(["s"] * 8, ["a"] * 4 + ["b"] * 4, scores, extras)  # a fixed seed


def test_validation_by_source_collects_batches_and_skips_padding():
    from types import SimpleNamespace

    from rljax.reward import RewardReport, ValidationBySource

    prompts = [SimpleNamespace(data_source="openai/gsm8k"), SimpleNamespace(data_source="")]
    traj = SimpleNamespace(is_padding=[False, False, False, False, True], group_id=[0, 0, 1, 1, 1],
                           uid=["v-0", "v-0", "v-1", "v-1", "pad"])
    report = RewardReport(4, 1, 0, (), None, row_extras=({"acc": 1.0}, {"acc": 0.0}, None, None, None))
    by = ValidationBySource("rljax/embedded")
    by.add(traj, prompts, [1.0, 0.0, 0.5, 0.5, 9.0], report)
    m = by.metrics()
    assert m["val-core/openai/gsm8k/acc/mean@2"] == 0.5 and m["val-aux/openai/gsm8k/reward/mean@2"] == 0.5
    assert m["val-core/rljax/embedded/reward/mean@2"] == 0.5  # the padding row's 9.0 is not counted
