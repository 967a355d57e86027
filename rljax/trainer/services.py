"""The run's services: what the stages use and never change.

:func:`rljax.trainer.build.build` makes them once per run. Frozen dataclasses, grouped by
side (model, rollout, learner, reward), so no stage can rebind a member; the sampler (which
installs weights) and the prompt feed (which advances) are I/O services whose positions the
:class:`~rljax.trainer.state.RunState` records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from rljax.config import Config
from rljax.trainer.step import StepConfig


@dataclasses.dataclass(frozen=True)
class Model:
    """The policy model's description (what the ledgers compile and the checkpoints name)."""

    config: Any  # rljax.models ModelConfig
    graphdef: Any
    lora_base: Optional[dict]  # the frozen base's signature of a LoRA run, else None
    step_config: StepConfig
    sizes: Any  # rljax.config.derive(cfg): trajectories, mini/micro batches, learner lengths


@dataclasses.dataclass(frozen=True)
class RoleFns:
    """One role's learner passes: ``update(train_state, batch, key) -> (train_state, metrics)``
    and ``forward(params, inputs)`` (the actor's ``(logp, entropy)``, the critic's values)."""

    update: Callable
    forward: Callable


@dataclasses.dataclass(frozen=True)
class Learner:
    """The learner side's functions and fixed inputs."""

    actor: RoleFns
    critic: Optional[RoleFns]  # adv_estimator=gae
    prepare: Callable  # (fields, kl_coef) -> advantages, returns, ... (rljax.trainer.prepare)
    prepare_inputs: tuple
    ref_params: Any  # a separate reference copy (KL loss / KL reward without LoRA), else None
    ref_is_base: bool  # LoRA: the reference is the actor's own base (adapters off)
    #: ``old_logp`` comes out of the update (``actor.skip_old_log_prob``): no ``old_log_prob`` stage.
    old_logp_in_update: bool
    prompt_len: int
    response_len: int


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The rollout side: the sampler, its decode settings, the prompts, this process's share."""

    sampler: Any  # rljax.rollout.Sampler (installs weights; its version is the sampler's)
    decode: Any  # DecodeParams of training rollouts
    val_decode: Any  # DecodeParams of validation (rollout.val_kwargs)
    tokenizer: Any
    prompts: Any  # the train split's PromptIterator (its position is RunState.data)
    val_prompts: Callable  # () -> a fresh pass over the held-out split
    share: Any  # this process's share of a batch's prompts (rljax.trainer.distribute.rollout_share)
    to_sampler: Callable  # actor params -> what the sampler reshards from
    client: Any = None  # the run's rollout client (rljax.trainer.clients): single-turn or multi-turn episodes
    weights: Any = None  # the weight publisher weight_sync calls (rljax.trainer.weights): install now, or push


class Lazy:
    """A service loaded on its first use, then kept (a reward model, a judge): ``get(*args)``
    calls ``load(*args)`` once. A service that loads itself, not run state."""

    def __init__(self, load: Callable):
        self._load, self._value = load, None

    def get(self, *args):
        if self._value is None:
            self._value = self._load(*args)
        return self._value


@dataclasses.dataclass(frozen=True)
class Reward:
    fn: Callable  # the rule / plugin reward (a worker pool or the function itself)
    model: Optional[Lazy]  # reward.model.path: get() -> (inputs -> [B] scores)
    judge: Optional[Lazy]  # reward.judge.path: get(state) -> rljax.trainer.judge.Judge


@dataclasses.dataclass(frozen=True)
class Services:
    """What the stages use and never change (see the module docstring)."""

    cfg: Config
    mesh: Any
    model: Model
    rollout: Rollout
    learner: Learner
    reward: Reward
    teacher: Optional[Lazy] = None  # distillation.enabled: get() -> rljax.trainer.teacher.Teacher

    @property
    def behaviour_logp(self) -> str:
        return "rollout_logp" if self.cfg.algorithm.bypass_mode else "old_logp"
