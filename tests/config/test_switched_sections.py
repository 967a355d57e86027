"""A section whose feature is off keeps its other keys at their defaults (and a key that needs
another, ``reward.combine.model_weight`` without ``reward.model.path``, its default): ``reward.judge.*`` set
without ``reward.judge.path`` (and the same for every section the schema gives a switch:
``_section(..., switch=(key, what))``) is one ConfigError line from ``resolve``, naming the keys
set and the switch, where before the run ignored them and trained (exit 0). The launcher's exit 2
with nothing written: ``tests/launch/test_launch.py``'s "judge key without a judge"."""

import dataclasses
import typing

import pytest

from rljax.config import ConfigError, Config, resolve
from rljax.config._validate import switched_sections

#: The sections with a switch: a section given one later is listed here too (the test below
#: fails until it is), so its off-state is exercised for every key.
EXPECTED = {"algorithm.filter_groups": "algorithm.filter_groups.enable", "actor.lora": "actor.lora.rank",
            "reward.reward_kwargs.overlong_buffer_cfg": "reward.reward_kwargs.overlong_buffer_cfg.enable",
            "reward.model": "reward.model.path", "reward.judge": "reward.judge.path",
            "algorithm.kl_ctrl": "algorithm.use_kl_in_reward", "critic": "algorithm.adv_estimator",
            "distillation": "distillation.enabled"}
#: What turns each switch on at resolve time (the packages' own checks of the value come later).
ON = {"enable": "true", "rank": "4", "path": "ref", "use_kl_in_reward": "true", "adv_estimator": "gae",
      "enabled": "true"}
DL = "distillation.distillation_loss"
#: What a switch needs beside itself to resolve (distillation: a teacher).
WITH = {"distillation.enabled": ["distillation.teacher_model.model_path=ref"]}
#: The keys read only by one loss mode: their on-state also names that mode.
MODE_KEYS = {f"{DL}.topk": f"{DL}.loss_mode=forward_kl_topk", f"{DL}.log_prob_min_clamp": f"{DL}.loss_mode=forward_kl_topk"}


def _other_value(tp, default):
    """A value of type ``tp`` other than ``default``, as a command-line string."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return next(str(a) for a in args if a != default)
    if origin is tuple and float in args:  # a pair of numbers (critic.optim.betas)
        return "[" + ",".join(str(x / 2) for x in default) + "]"
    if origin is tuple:  # a list of names: the first one alone (the defaults hold more, or none)
        first = typing.get_args(args[0])[0]
        return f"[{first}]" if default != (first,) else f"[{typing.get_args(args[0])[1]}]"
    if tp is bool:
        return str(not default).lower()
    if tp is int:
        return str((default or 0) + 1)
    if tp is float:
        return str((default or 0.0) + 0.5)
    return "x{response}:y" if default is None else default + "{response}!"


def _leaves(section, value):
    """``(dotted name within the section, type, default)`` of every leaf, nested sections walked
    (``critic.optim.lr``)."""
    hints = typing.get_type_hints(type(value))
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(v):
            yield from ((f"{f.name}.{n}", tp, d) for n, tp, d in _leaves(section, v))
        else:
            yield f.name, hints[f.name], v


def _cases():
    for section, switch, _, value, _ in switched_sections(Config()):
        for name, tp, default in _leaves(section, value):
            if f"{section}.{name}" != switch:
                yield pytest.param(section, switch, name, _other_value(tp, default), id=f"{section}.{name}")


def test_the_switched_sections_are_the_listed_ones():
    assert {s: k for s, k, _, _, _ in switched_sections(Config())} == EXPECTED


def test_a_section_switched_on_by_one_value_is_off_for_the_others():
    """``critic`` is on only with ``algorithm.adv_estimator=gae``: with grpo (the default) or rloo
    its keys, nested ``critic.optim.*`` included, are a usage error naming the value that turns it on."""
    for estimator in ("grpo", "rloo"):
        with pytest.raises(ConfigError) as e:
            resolve("default", [f"algorithm.adv_estimator={estimator}", "critic.optim.lr=0.0001"])
        assert str(e.value).startswith(f"critic.optim.lr=0.0001 is set, but algorithm.adv_estimator='{estimator}' "
                                       "turns the value model (critic) off"), e.value
        assert "set algorithm.adv_estimator='gae' as well" in str(e.value), e.value
    cfg, _ = resolve("default", ["algorithm.adv_estimator=gae", "critic.optim.lr=0.0001"])
    assert cfg.critic.optim.lr == 0.0001


@pytest.mark.parametrize("section,switch,name,value", list(_cases()))
def test_a_key_of_a_switched_off_section_is_a_usage_error(section, switch, name, value):
    key = f"{section}.{name}"
    if name == "parse":  # a path:function, checked by rljax.reward.check only when the judge is on
        value = "judge.py:verdict"
    with pytest.raises(ConfigError) as e:
        resolve("default", [f"{key}={value}"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key}=") and f"{switch}=" in msg, msg
    # the same key with the feature on passes resolve and is applied (the package checks its value later)
    on = [f"{switch}={ON[switch.rsplit('.', 1)[1]]}"] + [w for w in WITH.get(switch, []) if not w.startswith(f"{key}=")]
    cfg, _ = resolve("default", [f"{key}={value}", *on, *([MODE_KEYS[key]] if key in MODE_KEYS else [])])
    default, _ = resolve("default", [])
    for part in key.split("."):
        cfg, default = getattr(cfg, part), getattr(default, part)
    assert cfg != default, (key, cfg)


def test_every_key_set_is_named_in_one_line():
    with pytest.raises(ConfigError) as e:
        resolve("default", ["reward.judge.temperature=0.5", "reward.judge.response_length=4"])
    assert str(e.value).startswith("reward.judge.temperature=0.5, reward.judge.response_length=4 are set, but "
                                   "reward.judge.path=null turns the judge off"), e.value


def test_presets_and_their_defaults_pass():
    from repo_paths import REPO

    #: what a preset needs from the command line (its own paths)
    needs = {name: ["model.path=/ckpt/qwen", "data.path=/data/gsm8k"]
             for name in ("qwen2_5_0_5b_gsm8k", "qwen2_5_1_5b_gsm8k", "qwen2_5_7b_gsm8k")}
    for preset in sorted(p.stem for p in (REPO / "configs").glob("*.yaml")):
        resolve(preset, needs.get(preset, []))
    resolve("default", ["reward.judge.path=ref", "reward.judge.temperature=0.5"])


#: The keys read only when another is set (``_f(..., needs=...)``): at least one of these.
PATH_NEEDS = {"reward.combine.function_weight": ("reward.model.path", "reward.judge.path"),
              "reward.combine.model_weight": ("reward.model.path",),
              "reward.combine.judge_weight": ("reward.judge.path",)}
#: ... or read only with one estimator (or the user's own, which is handed every algorithm.* key).
OWN = "algorithm.adv_estimator=*:*"
ESTIMATOR_NEEDS = {"algorithm.gamma": ("algorithm.adv_estimator=gae", OWN),
                   "algorithm.lam": ("algorithm.adv_estimator=gae", OWN),
                   "algorithm.norm_adv_by_std_in_grpo": ("algorithm.adv_estimator=grpo", OWN)}
#: ... or read only by one policy loss (verl's policy_loss.* options), or with a rollout correction.
LOSS_NEEDS = {f"actor.{k}": (f"actor.policy_loss={mode}",) for mode, keys in (
    ("sapo", ("tau_pos", "tau_neg")), ("clip_cov", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    ("kl_cov", ("kl_cov_ratio", "ppo_kl_coef")), ("dro", ("dro_beta",))) for k in keys}
RC = "algorithm.rollout_correction"
CORRECTION_NEEDS = {f"{RC}.rollout_is_threshold": (f"{RC}.rollout_is",),
                    f"{RC}.rollout_is_batch_normalize": (f"{RC}.rollout_is",),
                    f"{RC}.rollout_rs_threshold": (f"{RC}.rollout_rs",),
                    f"{RC}.loss_type": ("algorithm.bypass_mode",)}
DISTILL_NEEDS = {f"{DL}.topk": (f"{DL}.loss_mode=forward_kl_topk",),
                 f"{DL}.log_prob_min_clamp": (f"{DL}.loss_mode=forward_kl_topk",),
                 f"{DL}.distillation_loss_coef": (f"{DL}.use_task_rewards",),
                 f"{DL}.clip_ratio_low": (f"{DL}.use_policy_gradient",),
                 f"{DL}.clip_ratio_high": (f"{DL}.use_policy_gradient",)}
EXPECTED_NEEDS = {**PATH_NEEDS, **ESTIMATOR_NEEDS, **LOSS_NEEDS, **CORRECTION_NEEDS, **DISTILL_NEEDS}


def test_the_needing_keys_are_the_listed_ones():
    from rljax.config._validate import needing_keys

    assert {k: n for k, n, _, _ in needing_keys(Config())} == EXPECTED_NEEDS


@pytest.mark.parametrize("key", sorted(PATH_NEEDS))
def test_a_key_without_what_it_needs_is_a_usage_error(key, tmp_path):
    with pytest.raises(ConfigError) as e:
        resolve("default", [f"{key}=0.5"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key}=0.5 is set, but ") and all(f"{k}=null" in msg
                                                                                 for k in PATH_NEEDS[key]), msg
    for need in PATH_NEEDS[key]:  # any one of them turns it on
        path = "ref" if need == "reward.judge.path" else str(tmp_path)
        cfg, _ = resolve("default", [f"{key}=0.5", f"{need}={path}"])
        section, name = key.rsplit(".", 1)
        assert getattr(_section(cfg, section), name) == 0.5


@pytest.mark.parametrize("key,value,on,off", [
    ("algorithm.gamma", "0.9", "gae", ("grpo", "rloo", "reinforce_plus_plus_baseline")),
    ("algorithm.lam", "0.95", "gae", ("grpo", "rloo", "reinforce_plus_plus_baseline")),
    ("algorithm.norm_adv_by_std_in_grpo", "false", "grpo", ("rloo", "reinforce_plus_plus_baseline", "gae")),
])
def test_an_estimator_key_with_another_estimator_is_a_usage_error(key, value, on, off, tmp_path):
    """algorithm.lam=0.95 with grpo trained without it (exit 0): GAE's gamma / lam are read by gae
    only, norm_adv_by_std_in_grpo by grpo only, and all three by an estimator of one's own."""
    assert ESTIMATOR_NEEDS[key][0] == f"algorithm.adv_estimator={on}"
    for estimator in off:
        with pytest.raises(ConfigError) as e:
            resolve("default", [f"algorithm.adv_estimator={estimator}", f"{key}={value}"])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{key}={value} is set, but algorithm.adv_estimator='{estimator}', "
                                                  f"so nothing would read it; accepted: set algorithm.adv_estimator="
                                                  f"{on} or algorithm.adv_estimator=path/to/file.py:function"), msg
    own = tmp_path / "est.py"
    for estimator in (on, f"{own}:advantages"):
        cfg, _ = resolve("default", [f"algorithm.adv_estimator={estimator}", f"{key}={value}"])
        assert str(_section(cfg, key)).lower() == value


def _section(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
