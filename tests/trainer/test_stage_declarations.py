"""Each stage is declared once, beside its function (``@stage`` in rljax/trainer/stages/), and the
runner holds every stage to its declaration: fields read and written, configuration keys read,
state taken or changed. docs/concepts/stage-flow.md is generated from the declarations."""

import difflib
import types

import jax
import pytest

from rljax.config import resolve
from rljax.trainer import stages as S
from rljax.trainer.clients import SINGLE_TURN
from rljax.trainer.runner import Stage, StageContractError, StepRunner, stage
from rljax.trainer.services import Services
from rljax.trainer.stages import page
from rljax.trainer.state import RunState

from repo_paths import REPO


def _services(*overrides, processes=1, critic=False, ref=False, in_update=False):
    """Services enough to choose and bind the stage list (no model, no sampler)."""
    cfg, _ = resolve("default", list(overrides))
    share = types.SimpleNamespace(processes=processes, local_bound=lambda b: b if processes == 1 else 1.0)
    learner = types.SimpleNamespace(critic=object() if critic else None, ref_params=object() if ref else None,
                                    ref_is_base=False, old_logp_in_update=in_update)
    rollout = types.SimpleNamespace(share=share, client=SINGLE_TURN)
    return Services(cfg=cfg, mesh={"dp": 8}, model=None, rollout=rollout,
                    learner=learner, reward=None)


def _state():
    return RunState(actor=None, critic=None, key=jax.random.key(0))


def test_a_declared_stage_that_writes_an_undeclared_field_fails():
    @stage("s", writes=("x",))
    def fn(s, b):
        return {"x": 1, "y": 2}

    with pytest.raises(StageContractError, match=r"^stage 's' wrote field 'y', which it does not declare"):
        StepRunner([fn.stage.bind(_services())]).run(1, {"step": 1})


def test_a_stage_declaring_a_state_change_it_does_not_make_fails():
    @stage("s", state="changes", writes=("x",))
    def same(s, state, b):
        return state, {"x": 1}

    with pytest.raises(StageContractError, match=r"^stage 's' declares state='changes' but returned the run state"):
        StepRunner([same.stage.bind(_services())]).run_state(_state(), 1, {"step": 1})

    @stage("s", state="changes", writes=("x",))
    def changes(s, state, b):
        return state.replace(version=state.version + 1), {"x": 1}

    state, _, _ = StepRunner([changes.stage.bind(_services())]).run_state(_state(), 1, {"step": 1})
    assert state.version == 1

    @stage("s", state="reads", writes=("x",))
    def reads(s, state, b):  # a stage that only reads the state returns its outputs alone
        return {"x": state.version}

    state, _, _ = StepRunner([reads.stage.bind(_services())]).run_state(_state(), 1, {"step": 1})
    assert state.version == 0
    with pytest.raises(ValueError, match="state="):
        stage("s", state="maybe")(lambda s, b: {})


def test_a_stage_reading_an_undeclared_config_key_fails():
    @stage("s", writes=("n",), config=("rollout.n", "algorithm.kl_ctrl"))
    def fn(s, b):
        return {"n": (s.cfg.rollout.n, s.cfg.algorithm.kl_ctrl.target_kl, s.cfg.algorithm.kl_ctrl)}

    services = _services("rollout.n=4")
    metrics_stage = Stage("m", lambda b: {"metrics": {"n": b["n"][0]}}, reads=("n",), writes=("metrics",))
    metrics, _ = StepRunner([fn.stage.bind(services), metrics_stage]).run(1, {"step": 1})
    assert metrics["n"] == 4  # declared keys, and the keys of a declared section, read through

    @stage("s", writes=("n",), config=("rollout.n",))
    def undeclared(s, b):
        return {"n": s.cfg.rollout.temperature}

    with pytest.raises(StageContractError, match=r"^stage 's' read config 'rollout.temperature', which it does not "
                                                 r"declare \(config=\['rollout.n'\]\)"):
        StepRunner([undeclared.stage.bind(services)]).run(1, {"step": 1})
    with pytest.raises(StageContractError, match="read config 'data'"):
        stage("w", when=lambda s: s.cfg.data)(lambda s, b: {}).stage.applies(services)


def test_every_stage_declares_a_known_state_a_timing_and_a_summary():
    for spec in S.specs():
        assert spec.timing and spec.summary, spec.name
        assert spec.fn.stage is spec and spec.fn.__module__.startswith("rljax.trainer.stages."), spec.name
    names = [spec.name for spec in S.specs()]
    assert len(set(names)) == len(names) - 1  # rollout_sessions: unfiltered and filtered


@pytest.mark.parametrize("overrides, kw, want", [
    ((), {}, ["dataset_item", "rollout_sessions", "trajectory_fields", "reward", "old_log_prob", "advantages",
              "actor_minibatch", "weight_sync", "metrics"]),
    (("algorithm.filter_groups.enable=true",), {"processes": 2}, ["dataset_item", "rollout_sessions",
                                                                   "trajectory_fields", "reward", "gather_rollout",
                                                                   "old_log_prob", "advantages", "actor_minibatch",
                                                                   "weight_sync", "metrics"]),
    (("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"), {"critic": True, "ref": True},
     ["dataset_item", "rollout_sessions", "trajectory_fields", "reward", "old_log_prob", "reference", "values",
      "advantages", "kl_controller", "update_critic", "actor_minibatch", "weight_sync", "metrics"]),
    (("algorithm.bypass_mode=true",), {}, ["dataset_item", "rollout_sessions", "trajectory_fields", "reward",
                                            "advantages", "actor_minibatch", "weight_sync", "metrics"]),
])
def test_the_stage_list_follows_the_declared_conditions(overrides, kw, want):
    services = _services(*overrides, **kw)
    stages = S.sync_stages(services)
    assert [st.name for st in stages] == want
    rollout = next(st for st in stages if st.name == "rollout_sessions")
    filtered = "algorithm.filter_groups.enable=true" in overrides
    assert ("dynamic_sampling" in rollout.writes) == filtered  # one variant, chosen by its declared condition


def test_bind_passes_only_declared_options():
    spec = S.rollout_sessions.stage
    with pytest.raises(TypeError, match="takes no option 'other'"):
        spec.bind(_services(), other=1)


def test_the_stage_flow_page_is_generated_from_the_declarations():
    have = (REPO / page.PAGE).read_text()
    want = page.render()
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), page.PAGE,
                                                 "generated", n=0))[:40])
        raise AssertionError(f"{page.PAGE} is out of date with the stage declarations; regenerate it with:\n"
                             f"    {page.COMMAND}\n{diff}")
    for spec in S.specs():
        assert f"| `{spec.name}` | `{spec.timing}` |" in want
