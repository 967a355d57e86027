"""The prepare stage (rljax.trainer.prepare): token rewards with the KL penalty, advantages
through the estimator registry, returns and rollout-correction weights, checked against the
loss functions called by hand; and the step runner's observation protocol."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import loss as rl
from rljax.trainer.prepare import PrepareConfig, make_prepare_fn, prepare
from rljax.trainer.runner import Stage, StepRunner

B, T, G = 6, 4, 3


def _fields(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), np.float32)
    mask[0, 3:] = 0  # a shorter response
    mask[5] = 0  # a padding row
    return {
        "scores": jnp.asarray(rng.uniform(size=B).astype(np.float32) * (mask.sum(1) > 0)),
        "loss_mask": jnp.asarray(mask),
        "group_id": jnp.asarray(np.arange(B) // 2, jnp.int32),
        "row_mask": jnp.asarray(mask.sum(1) > 0),
        "old_logp": jnp.asarray(-rng.uniform(0.1, 2, (B, T)).astype(np.float32)),
        "ref_logp": jnp.asarray(-rng.uniform(0.1, 2, (B, T)).astype(np.float32)),
        "rollout_logp": jnp.asarray(-rng.uniform(0.1, 2, (B, T)).astype(np.float32)),
        "values": jnp.asarray(rng.normal(size=(B, T)).astype(np.float32)),
    }


def _cfg(**kw):
    kw.setdefault("algorithm", (("gamma", 1.0), ("lam", 0.95), ("norm_adv_by_std_in_grpo", True)))
    return PrepareConfig(estimator=kw.pop("estimator", "grpo"), num_groups=G, **kw)


def test_grpo_matches_the_loss_function_and_ignores_padding():
    f = _fields()
    out = make_prepare_fn(_cfg())(f, jnp.float32(0.0))
    expect = rl.grpo_advantages(f["scores"], f["group_id"], num_groups=G, row_mask=f["row_mask"])
    np.testing.assert_allclose(out["advantages"], expect[:, None] * f["loss_mask"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["returns"], out["advantages"])
    assert float(jnp.abs(out["advantages"][5]).sum()) == 0.0  # the padding row
    # the score sits on the last action token of each row
    tr = np.asarray(out["token_level_rewards"])
    np.testing.assert_allclose(tr.sum(1), np.asarray(f["scores"]), rtol=1e-6)
    assert tr[0, 2] == pytest.approx(float(f["scores"][0])) and tr[0, 3] == 0.0


def test_kl_in_reward_lowers_the_token_rewards_by_coef_times_kl():
    f = _fields()
    cfg = _cfg(use_kl_in_reward=True, kl_penalty="kl")
    base = prepare(f, jnp.float32(0.0), cfg=cfg)
    out = prepare(f, jnp.float32(0.5), cfg=cfg)
    kl = (f["old_logp"] - f["ref_logp"]) * f["loss_mask"]  # k1 estimator
    np.testing.assert_allclose(out["token_level_rewards"], base["token_level_rewards"] - 0.5 * kl, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(out["kl_in_reward"], rl.mean_sequence_kl(kl, f["loss_mask"], row_mask=f["row_mask"]),
                               rtol=1e-6)
    # the outcome estimators see the penalised sequence score
    scores = f["scores"] - 0.5 * jnp.sum(kl, axis=1)
    expect = rl.grpo_advantages(scores, f["group_id"], num_groups=G, row_mask=f["row_mask"])
    np.testing.assert_allclose(out["advantages"], expect[:, None] * f["loss_mask"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "gae"])
def test_every_builtin_estimator_through_the_registry(name):
    f = _fields()
    out = prepare(f, jnp.float32(0.0), cfg=_cfg(estimator=name))
    m = f["loss_mask"]
    if name == "rloo":
        expect = rl.rloo_advantages(f["scores"], f["group_id"], num_groups=G, row_mask=f["row_mask"])[:, None] * m
    elif name == "reinforce_plus_plus_baseline":
        expect = rl.reinforce_pp_baseline_advantages(f["scores"], f["group_id"], m, num_groups=G)
    else:
        tr = out["token_level_rewards"]
        expect, ret = rl.gae_advantages(tr, f["values"], m, gamma=1.0, lam=0.95)
        np.testing.assert_allclose(out["returns"], ret, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["advantages"], expect, rtol=1e-5, atol=1e-6)


def test_rollout_correction_weights():
    f = _fields()
    out = prepare(f, jnp.float32(0.0), cfg=_cfg(correction="token", correction_threshold=1.5))
    expect = rl.rollout_correction_weights(f["old_logp"], f["rollout_logp"], f["loss_mask"], level="token",
                                           threshold=1.5)
    np.testing.assert_allclose(out["rollout_is_weights"], expect, rtol=1e-6)
    assert "rollout_is_weights" not in prepare(f, jnp.float32(0.0), cfg=_cfg())


def test_a_registered_user_estimator_is_called_with_the_one_signature():
    seen = {}

    @rl.register_adv_estimator("test_prepare_constant")
    def constant(token_level_rewards, response_mask, *, group_id, num_groups, row_mask, values, config):
        seen.update(num_groups=num_groups, config=dict(config), values=values is not None)
        adv = jnp.full_like(token_level_rewards, config["c"]) * response_mask
        return adv, adv + 1.0

    f = _fields()
    out = prepare(f, jnp.float32(0.0), cfg=_cfg(estimator="test_prepare_constant", algorithm=(("c", 2.0),)))
    np.testing.assert_allclose(out["advantages"], 2.0 * f["loss_mask"])
    np.testing.assert_allclose(out["returns"], 2.0 * f["loss_mask"] + 1.0)
    assert seen == {"num_groups": G, "config": {"c": 2.0}, "values": True}


def test_prepare_inputs_follow_the_configuration():
    assert _cfg().inputs(critic=False) == ("scores", "loss_mask", "group_id", "row_mask")
    cfg = _cfg(use_kl_in_reward=True, correction="sequence", behaviour_logp="rollout_logp")
    assert cfg.inputs(critic=True) == ("scores", "loss_mask", "group_id", "row_mask", "rollout_logp", "ref_logp",
                                       "values", "old_logp")


class _Recorder:
    def __init__(self):
        self.events, self.ends, self.cleanups = [], [], []

    def step_start(self, step, t):
        self.start = step

    def stage(self, event):
        self.events.append((event.stage, sorted(event.reads), sorted(event.writes), dict(event.producers),
                            dict(event.aliases)))

    def step_end(self, step, metrics):
        self.ends.append(dict(metrics))

    def cleanup(self, report):
        self.cleanups.append(report)


def test_runner_records_what_each_stage_really_read_and_follows_aliases():
    kept = []
    stages = [
        Stage("a", lambda b: {"x": jnp.ones(3), "unused": jnp.zeros(2)}, writes=("x", "unused")),
        Stage("b", lambda b: {"y": b["x"] * 2, "alias": b["x"]}, reads=("x", "unused"), writes=("y", "alias")),
        Stage("c", lambda b: {"metrics": {"y": float(b["y"].sum())}}, "custom", reads=("y",), writes=("metrics",)),
    ]
    rec = _Recorder()
    metrics, timings = StepRunner(stages, [rec]).run(1, {"step": 1})
    assert [e[0] for e in rec.events] == ["a", "b", "c"]
    assert rec.events[1][1] == ["x"] and rec.events[2][1] == ["y"]  # reads as observed, "unused" never read
    assert rec.events[1][3]["alias"] == "a" and rec.events[1][4] == {"alias": "x"}  # producer of the original
    assert metrics["y"] == 6.0 and set(timings) == {"a", "b", "custom"} and metrics["timing_s/step"] >= 0
    assert rec.cleanups[0].leaked == [] and rec.cleanups[0].tracked >= 3
    assert rec.cleanups[0].stages == ["a", "b", "c"]  # the stages the step ran, in order
    # a stage that keeps a batch array past the step is reported
    leaky = [Stage("a", lambda b: {"x": jnp.ones(3)}, writes=("x",)),
             Stage("keep", lambda b: kept.append(b["x"]) or {}, reads=("x",))]
    rec = _Recorder()
    StepRunner(leaky, [rec]).run(2, {"step": 2})
    assert rec.cleanups[0].leaked == ["x"]


def test_runner_refuses_a_field_a_stage_does_not_declare():
    from rljax.trainer.runner import StageContractError

    ok = Stage("a", lambda b: {"x": jnp.ones(3)}, writes=("x",))
    with pytest.raises(StageContractError, match=r"^stage 'b' wrote field 'z', which it does not declare"):
        StepRunner([ok, Stage("b", lambda b: {"y": b["x"], "z": 1}, reads=("x",), writes=("y",))]).run(1, {"step": 1})
    with pytest.raises(StageContractError, match=r"^stage 'b' read field 'x', which it does not declare"):
        StepRunner([ok, Stage("b", lambda b: {"y": b["x"]}, reads=("step",), writes=("y",))]).run(1, {"step": 1})
    with pytest.raises(TypeError, match="tuple of field names"):
        Stage("b", lambda b: {}, reads="x")


def test_a_produced_prior_runs_first_in_the_stage_record():
    producer = StepRunner([Stage("gen", lambda b: {"x": jnp.ones(3)}, reads=("step",), writes=("x",))])
    prior = producer.produce(5, {"step": 5})
    rec = _Recorder()
    learner = StepRunner([Stage("use", lambda b: {"y": b["x"] + 1}, reads=("x",), writes=("y",))], [rec])
    learner.run(1, {"step": 1}, prior=prior)
    assert rec.cleanups[0].stages == ["gen", "use"] and [e[0] for e in rec.events] == ["gen", "use"]


def test_runner_rejects_duplicate_stage_names():
    with pytest.raises(ValueError, match="unique"):
        StepRunner([Stage("a", lambda b: {}), Stage("a", lambda b: {})])


def _kl_step(ctrl_type: str, coef: float, kl: float, rows: int = 10):
    """One ``kl_controller`` stage (rljax.trainer.stages), run by the step runner on a run state."""
    import types

    from rljax.config import resolve
    from rljax.trainer.services import Services
    from rljax.trainer.stages import kl_controller
    from rljax.trainer.state import RunState

    cfg, _ = resolve("default", ["algorithm.use_kl_in_reward=true", f"algorithm.kl_ctrl.type={ctrl_type}",
                                 "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=100"])
    services = Services(cfg=cfg, mesh=None, model=None, rollout=None, learner=None, reward=None)
    state = RunState(actor=None, critic=None, key=jax.random.key(0), kl_coef=coef)
    stage = kl_controller.stage.bind(services)
    metrics = Stage("metrics", lambda b: {"metrics": {"critic/kl": b["kl"], "critic/kl_coef": b["kl_coef"]}},
                    reads=("kl", "kl_coef"), writes=("metrics",))
    traj = types.SimpleNamespace(is_padding=np.array([False] * rows + [True] * 2))  # two padding rows: not counted
    state, m, _ = StepRunner([stage, metrics]).run_state(state, 1, {"kl_in_reward": jnp.float32(kl),
                                                                    "trajectories": traj})
    return state.kl_coef, m


def test_adaptive_kl_controller_stage_follows_the_measured_kl():
    coef, m = _kl_step("adaptive", 0.1, 0.5)  # far above target: +20% x 10/100
    assert coef == pytest.approx(0.1 * 1.02)
    assert m["critic/kl_coef"] == 0.1 and m["critic/kl"] == 0.5  # the coefficient this step's advantages used
    coef, _ = _kl_step("adaptive", coef, 0.0)  # below target: shrinks
    assert coef == pytest.approx(0.1 * 1.02 * 0.98)
    assert _kl_step("adaptive", 0.1, float("nan"))[0] == 0.1  # a non-finite KL leaves it
    assert _kl_step("fixed", 0.1, 10.0)[0] == 0.1


def test_a_stage_that_takes_the_state_needs_run_state():
    stage = Stage("s", lambda st, b: {}, state="reads")
    with pytest.raises(ValueError, match="run_state"):
        StepRunner([stage]).run(1, {"step": 1})


ESTIMATOR_FILE = '''
import jax.numpy as jnp

def centered(token_level_rewards, response_mask, *, group_id, num_groups, row_mask, values, config):
    scores = jnp.sum(token_level_rewards, axis=-1)
    adv = (scores - jnp.sum(scores * row_mask) / jnp.maximum(jnp.sum(row_mask), 1))[:, None] * response_mask
    return adv, adv

def wrong(scores, group_ids):
    return scores
'''


def test_an_estimator_from_a_file_is_loaded_checked_and_registered(tmp_path):
    from rljax.config import ConfigError
    from rljax.trainer.prepare import load_estimator

    path = tmp_path / "est.py"
    path.write_text(ESTIMATOR_FILE)
    fn = load_estimator(f"{path}:centered")
    assert rl.get_adv_estimator(f"{path}:centered") is fn
    f = _fields()
    out = prepare(f, jnp.float32(0.0), cfg=_cfg(estimator=f"{path}:centered"))
    assert abs(float(jnp.sum(out["advantages"][:, 0] * f["row_mask"]))) < 1e-5  # centred over the real rows
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator=.*wrong\(scores, group_ids\) must accept"):
        load_estimator(f"{path}:wrong")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_estimator(f"{path}:nope")


@pytest.mark.parametrize("spec,message", [
    ("{dir}/est.py:wrong", "must accept (token_level_rewards"),
    ("{dir}/missing.py:centered", "not found"),
    ("ppo", "is not one of grpo, rloo"),
])
def test_a_bad_estimator_is_a_usage_error_before_anything_is_written(tmp_path, spec, message):
    import subprocess
    import sys

    (tmp_path / "est.py").write_text(ESTIMATOR_FILE)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--run-dir", str(run),
                          f"algorithm.adv_estimator={spec.format(dir=tmp_path)}"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()
