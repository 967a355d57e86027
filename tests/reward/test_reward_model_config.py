"""``reward.model.path`` misuse: one ConfigError line from ``rljax.reward.check`` (the launcher's
preflight, which exits 2 on it before anything is written)."""

import pytest


@pytest.mark.parametrize("overrides,match", [
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"],
     "reward.model.path with algorithm.filter_groups.metric=score is not supported yet"),
    (["reward.model.label=-1"], "label"),
])
def test_reward_model_misuse_is_one_config_error_line(overrides, match, tmp_path):
    from rljax.config import ConfigError, resolve
    from rljax.reward import check

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=match) as e:
        check(resolve("default", [f"reward.model.path={tmp_path}", *overrides])[0])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset,overrides", [("default", ["trainer.mode=async"]), ("tool_lookup", []),
                                              ("default", ["algorithm.filter_groups.enable=true"])])
def test_reward_model_runs_in_async_and_multi_turn_runs(preset, overrides, tmp_path):
    """Accepted: async runs the reward stage on the learner, multi-turn scores prompt + episode, the
    filter keeps groups by the rule's score (metric=acc, the default) and the kept rows combine."""
    from rljax.config import resolve
    from rljax.reward import check

    (tmp_path / "config.json").write_text("{}")
    check(resolve(preset, [f"reward.model.path={tmp_path}", *overrides])[0])


def test_reward_model_path_must_be_a_checkpoint_directory(tmp_path):
    from rljax.config import ConfigError, resolve
    from rljax.reward import check

    with pytest.raises(ConfigError, match="not a Hugging Face checkpoint directory"):
        check(resolve("default", [f"reward.model.path={tmp_path}"])[0])


def test_reward_model_keys_resolve(tmp_path):
    from rljax.config import resolve

    (tmp_path / "config.json").write_text("{}")
    cfg, _ = resolve("default", [f"reward.model.path={tmp_path}", "reward.combine.function_weight=0"])
    assert cfg.reward.model.path == str(tmp_path) and cfg.reward.combine.function_weight == 0.0
    assert resolve("default", [])[0].reward.model.path is None
