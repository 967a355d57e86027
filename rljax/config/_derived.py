"""Sizes derived from the configuration and the mesh, computed once.

verl's batch-size keys count prompts (``data.train_batch_size``,
``actor.ppo_mini_batch_size``) and rljax's micro-batch counts trajectories; the learner pads
the prompt and response lengths up to multiples of ``sp``. Every consumer (the trainer, the
trace's mini-batch facts, ``--print-config``) takes these numbers from :func:`derive`
instead of recomputing them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DerivedSizes:
    trajectories_per_step: int  # data.train_batch_size x rollout.n
    mini_batch_trajectories: int  # actor.ppo_mini_batch_size x rollout.n
    micro_batch_trajectories: int  # actor.ppo_micro_batch_size, or the mini-batch
    mini_batches_per_epoch: int
    micro_batches_per_mini_batch: int
    optimizer_updates: int  # over the whole run: total_steps x ppo_epochs x mini-batches
    learner_prompt_length: int  # data.max_prompt_length rounded up to a multiple of sp
    learner_response_length: int  # data.max_response_length rounded up to a multiple of sp

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def derive(config, *, sp: int = 1) -> DerivedSizes:
    """The derived sizes of ``config`` on a mesh with sequence-parallel size ``sp``."""
    d, a, n = config.data, config.actor, config.rollout.n
    trajectories = d.train_batch_size * n
    mini = a.ppo_mini_batch_size * n
    micro = a.ppo_micro_batch_size or mini
    up = lambda x: -(-x // sp) * sp  # noqa: E731
    return DerivedSizes(
        trajectories_per_step=trajectories, mini_batch_trajectories=mini, micro_batch_trajectories=micro,
        mini_batches_per_epoch=trajectories // mini, micro_batches_per_mini_batch=mini // micro,
        optimizer_updates=config.trainer.total_steps * a.ppo_epochs * (trajectories // mini),
        learner_prompt_length=up(d.max_prompt_length), learner_response_length=up(d.max_response_length))
