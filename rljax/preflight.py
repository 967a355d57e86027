"""The launcher's preflight: each package checks the inputs a config names, before JAX starts.

:func:`check_inputs` asks, in order, ``rljax.reward.check`` (the reward plugin),
``rljax.env.check`` (the environment file), ``rljax.trainer.check`` (the estimator plugin,
the model checkpoint, the tokenizer, ``tp`` against the vocabulary, LoRA's saved modules, the
loggers) and ``rljax.data.check`` (the dataset's files, every prompt tokenized under the
length policy, positions, enough prompts for one batch). Each raises :class:`~rljax.errors.ConfigError` with one line
naming the key or file; the launcher prints it and exits 2 before anything is written.
A package with inputs of its own adds its ``check(cfg)`` to :data:`CHECKS`.
"""

from __future__ import annotations

from rljax import data, env, reward, trainer

#: The packages' own checks, in the order they run.
CHECKS = (reward.check, env.check, trainer.check, data.check)


def check_inputs(config) -> None:
    """Runs every package's ``check(config)``; the first mistake raises its ConfigError."""
    for check in CHECKS:
        check(config)
