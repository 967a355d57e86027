"""The launcher's preflight: each package checks the inputs a config names, before JAX starts.

:func:`check_inputs` asks, in order, ``rljax.reward.check`` (the reward plugin),
``rljax.env.check`` (the environment file), ``rljax.trainer.check`` (the estimator plugin,
the model checkpoint, the tokenizer, ``tp`` against the vocabulary, LoRA's saved modules, the
loggers), :func:`check_architecture` (``model.path``'s architecture and options) and ``rljax.data.check`` (the dataset's files, every prompt tokenized under the
length policy, positions, enough prompts for one batch). Each raises :class:`~rljax.errors.ConfigError` with one line
naming the key or file; the launcher prints it and exits 2 before anything is written.
A package with inputs of its own adds its ``check(cfg)`` to :data:`CHECKS`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rljax import data, env, reward, trainer
from rljax.errors import ConfigError
from rljax.hf_config import model_fields


def check_architecture(config) -> None:
    """``model.path``'s ``config.json`` names an architecture and options rljax runs
    (:func:`rljax.hf_config.model_fields`), a sliding window (Mistral) holds the longest
    sequence, and a final-logit soft-capping (Gemma 2) is not sent to the Pallas log-prob kernels; a missing or unreadable file is left to ``rljax.trainer.check``'s line."""
    path = config.model.path
    file = Path(path).expanduser() / "config.json" if path else None
    if file is None or not file.is_file():
        return
    try:
        hf = json.loads(file.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(hf, dict):
        return
    try:
        fields = model_fields(hf)
    except ValueError as e:
        raise ConfigError(f"model.path={path!r}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ConfigError(f"model.path={path!r}: config.json has no usable {e} (a field every supported "
                          "architecture has)") from None
    window, cap = fields["sliding_window"], fields.get("final_logit_softcapping")
    if cap is not None and config.actor.logprob_impl == "pallas":
        raise ConfigError(f"actor.logprob_impl=pallas: model.path's final_logit_softcapping={cap} (config.json) is not "
                          "implemented in the Pallas log-prob kernels; accepted: actor.logprob_impl=auto (runs "
                          "chunked for this model), chunked or naive")
    longest = config.data.max_prompt_length + config.data.max_response_length
    if window is not None and longest > window:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {longest} is longer than model.path's "
                          f"sliding_window={window} (config.json), which rljax does not implement (it attends over "
                          f"the whole sequence); keep them within {window}")


#: The packages' own checks, in the order they run.
CHECKS = (reward.check, env.check, trainer.check, check_architecture, data.check)


def check_inputs(config) -> None:
    """Runs every package's ``check(config)``; the first mistake raises its ConfigError."""
    for check in CHECKS:
        check(config)
