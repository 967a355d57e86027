"""Checks of a resolved config against the files and sizes it names, before anything runs.

:func:`check_inputs` is what the launcher runs after :func:`~rljax.config.resolve` and
before it creates the run directory or imports JAX: the reward plugin (its file and
signature), the model checkpoint directory (``config.json``, safetensors weights,
``tokenizer.json``), the mesh's ``tp`` against the vocabulary, and the dataset (its files,
every prompt tokenized under the length policy, enough prompts for one batch). Each
mistake is a :class:`ConfigError` of one line naming the key or file and what is accepted.

It imports only pure-Python parts of rljax (``rljax.reward``, ``rljax.data``'s readers,
``rljax.tokenizer``), plus ``tokenizers`` / ``pyarrow`` when the config names a
``tokenizer.json`` / Parquet files. The prompts are tokenized exactly as the trainer does
(:func:`rljax.data.prepare_prompts` with BOS), so a config that passes here does not fail
the same way after compilation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rljax.config._errors import ConfigError
from rljax.config._validate import parse_mesh_spec

_CHECKPOINT = "a local Hugging Face checkpoint directory with config.json, *.safetensors and tokenizer.json"


def check_inputs(config) -> None:
    """Checks ``config`` against the files and sizes it names; raises :class:`ConfigError`.

    Checks, in order: ``reward.function`` (a plugin file that exists and a function with
    rljax's or verl's signature), ``env.function`` (a built-in environment, or a file that
    exists and a class with ``step(turn)``), ``algorithm.adv_estimator`` (a plugin file's function
    with the estimator registry's signature), ``model.path`` / ``model.tokenizer`` (the files exist and
    load), ``trainer.mesh``'s ``tp`` (it divides the learner's vocabulary, which the fused
    log-prob splits over ``tp``), and the dataset (``data.path``'s train and test files,
    their fields, every prompt under ``data.max_prompt_length`` /
    ``data.filter_overlong_prompts`` / ``data.truncation``, at least
    ``data.train_batch_size`` train prompts kept and one test prompt).
    """
    _check_reward(config)
    _check_env(config)
    _check_estimator(config)
    tokenizer, vocab, vocab_from = _check_model(config.model)
    _check_tp(config, vocab, vocab_from)
    _check_lora_saved_modules(config)
    _check_data(config, tokenizer)
    _check_loggers(config)


def _check_loggers(config) -> None:
    """wandb / mlflow in ``trainer.logger`` are installed (found, not imported: both are heavy)."""
    import importlib.util

    for name in config.trainer.logger:
        if name in ("wandb", "mlflow") and importlib.util.find_spec(name) is None:
            raise ConfigError(f"trainer.logger names {name}, which is not installed: pip install 'rljax[{name}]' "
                              "(or drop it from trainer.logger)")


# ---------------------------------------------------------------------------- reward


def _check_reward(config) -> None:
    from rljax.reward import check

    check(config)  # the plugin is imported in a child process (an exit or hang at import is one line)


def _check_env(config) -> None:
    """A user's environment file loads and names a class with ``step(turn)``."""
    if config.env.function is not None:
        from rljax.env import check

        check(config)  # loads it; probes the python tool's sandbox against env.sandbox.require


def _check_estimator(config) -> None:
    """A user's estimator file loads and its function has the registry's signature."""
    spec = config.algorithm.adv_estimator
    if ":" in spec:
        from rljax.trainer.prepare import load_estimator

        load_estimator(spec)


# ---------------------------------------------------------------------------- model and tokenizer


def _check_model(m):
    """``(tokenizer, learner vocabulary size, where that size comes from)``."""
    from rljax.tokenizer import CharTokenizer, load_tokenizer

    hf_vocab = None
    if m.path:
        root = Path(m.path).expanduser()
        if not root.is_dir():
            raise ConfigError(f"model.path={m.path!r} is not a directory (cwd {os.getcwd()}); expected {_CHECKPOINT}")
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model.path={m.path!r} has no config.json; expected {_CHECKPOINT}")
        try:
            hf = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={m.path!r}: config.json is not readable JSON ({e})") from None
        hf_vocab = hf.get("vocab_size") if isinstance(hf, dict) else None
        if not isinstance(hf_vocab, int) or hf_vocab < 1:
            raise ConfigError(f"model.path={m.path!r}: config.json has no positive integer vocab_size")
        if not any(root.glob("*.safetensors")):
            raise ConfigError(f"model.path={m.path!r} has no *.safetensors weights; expected {_CHECKPOINT}")
    spec = m.tokenizer
    if spec == "char" or (spec is None and not m.path):
        tokenizer, where = CharTokenizer(), "the char tokenizer's"
    else:
        key, value = ("model.tokenizer", spec) if spec else ("model.path", m.path)
        target = Path(value).expanduser()
        file = target / "tokenizer.json" if target.is_dir() else target
        if not file.is_file():
            hint = "" if spec else "; set model.tokenizer to a tokenizer.json path, or 'char'"
            raise ConfigError(f"{key}={value!r} has no tokenizer.json (looked for {str(file)!r}){hint}")
        try:
            tokenizer = load_tokenizer(str(file))
        except ImportError as e:
            raise ConfigError(f"{key}={value!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a corrupt tokenizer.json is the user's file
            raise ConfigError(f"{key}={value!r}: {str(file)!r} is not a readable tokenizer.json "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        where = f"{str(file)!r}'s"
    if hf_vocab is not None:
        if tokenizer.vocab_size > hf_vocab:
            raise ConfigError(f"the tokenizer ({where}) has {tokenizer.vocab_size} tokens, more than model.path's "
                              f"config.json vocab_size={hf_vocab}; use the checkpoint's own tokenizer.json")
        return tokenizer, hf_vocab, f"model.path's config.json vocab_size"
    # A preset trained from scratch takes the tokenizer's vocabulary (rljax.trainer.loop._model).
    return tokenizer, tokenizer.vocab_size, f"{where} vocabulary; a preset takes its tokenizer's"


def _check_lora_saved_modules(config) -> None:
    """``actor.lora.modules_to_save`` trains a copy of ``lm_head`` / ``embed_tokens``: untied embeddings only."""
    lora, m = config.actor.lora, config.model
    if lora.rank == 0 or not lora.modules_to_save:
        return
    if m.path:
        hf = json.loads((Path(m.path).expanduser() / "config.json").read_text())
        tied, where = bool(hf.get("tie_word_embeddings", False)), f"model.path={m.path!r} (tie_word_embeddings: true)"
    else:
        from rljax.config._validate import apply_model_overrides
        from rljax.models.config import PRESETS

        tied, where = apply_model_overrides(PRESETS[m.name], m).tie_embeddings, f"model.name={m.name} (tie_embeddings)"
    if tied:
        raise ConfigError(f"actor.lora.modules_to_save={list(lora.modules_to_save)} needs untied embeddings, but "
                          f"{where} ties lm_head to embed_tokens; accepted: [] for this model")


def _check_tp(config, vocab: int, vocab_from: str) -> None:
    sizes = parse_mesh_spec(config.trainer.mesh)
    tp = 1 if sizes is None else sizes["tp"]
    if vocab % tp:
        accepted = [d for d in range(1, min(vocab, 64) + 1) if vocab % d == 0]
        raise ConfigError(
            f"trainer.mesh={config.trainer.mesh} (--mesh): tp={tp} must divide the vocabulary size {vocab} "
            f"({vocab_from}), which the learner splits over tp; accepted tp: {', '.join(map(str, accepted))}"
        )


# ---------------------------------------------------------------------------- data


def _check_data(config, tokenizer) -> None:
    from rljax.data import check  # the data package checks its own inputs

    check(config, tokenizer)
