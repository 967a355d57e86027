"""The trainer: the pure actor update, old/reference log-probs, the optimizer, the step loop.

``make_train_step(graphdef, optimizer, StepConfig(...), mesh)`` returns one jitted
``(state, batch, key) -> (state, metrics)``; see :mod:`rljax.trainer.step`.
:func:`check` is the trainer's preflight (estimator plugin, model files, tokenizer, ``tp``,
LoRA's saved modules), pure Python: the launcher runs it before JAX starts, so the update's
names (JAX) are imported on first use.
"""

from rljax.trainer._check import check

_STEP = ("StepConfig", "TrainState", "actor_loss", "init_state", "make_logprob_fn", "make_optimizer",
         "make_train_step", "response_logprobs", "trainable")

__all__ = ["check", *_STEP]


def __getattr__(name):
    if name in _STEP:
        from rljax.trainer import step  # jax: the preflight imports this package before JAX may start

        return getattr(step, name)
    raise AttributeError(f"module 'rljax.trainer' has no attribute {name!r}")
