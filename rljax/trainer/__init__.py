"""The trainer: the pure actor update, old/reference log-probs, the optimizer.

``make_train_step(graphdef, optimizer, StepConfig(...), mesh)`` returns one jitted
``(state, batch, key) -> (state, metrics)``; see :mod:`rljax.trainer.step`.
"""

from rljax.trainer.step import (
    StepConfig,
    TrainState,
    actor_loss,
    init_state,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    response_logprobs,
    trainable,
)

__all__ = [
    "StepConfig",
    "TrainState",
    "actor_loss",
    "init_state",
    "make_logprob_fn",
    "make_optimizer",
    "make_train_step",
    "response_logprobs",
    "trainable",
]
