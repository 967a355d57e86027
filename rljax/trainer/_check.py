"""The trainer's preflight: what the run builds from the config, checked before JAX starts.

:func:`check` (``rljax.trainer.check``, called by :mod:`rljax.preflight`) checks a user's
estimator plugin (``algorithm.adv_estimator``), the model checkpoint directory
(``model.path``: ``config.json`` with ``vocab_size``, ``*.safetensors``), the tokenizer
(``model.tokenizer`` / ``model.path``'s ``tokenizer.json``), ``trainer.mesh``'s ``tp`` against
the learner's vocabulary, ``actor.lora.modules_to_save`` against tied embeddings, that the
experiment loggers ``trainer.logger`` names (wandb, mlflow) are installed, and DAPO's dynamic
sampling (``algorithm.filter_groups``) in the schedules that run it. Each
mistake is a :class:`~rljax.errors.ConfigError` of one line naming the key and what is
accepted. Pure Python: JAX is imported only for what needs it (see the deferred imports).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from rljax.config import apply_model_overrides, parse_mesh_spec
from rljax.errors import ConfigError
from rljax.hf_config import SUPPORTED_ARCHITECTURES, model_fields
from rljax.tokenizer import checked_tokenizer

_CHECKPOINT = "a local Hugging Face checkpoint directory with config.json, *.safetensors and tokenizer.json"


def check(config) -> None:
    """Checks the estimator plugin, the model files, the tokenizer, ``tp``, LoRA's saved modules, the loggers,
    dynamic sampling."""
    _check_filter_groups(config)
    _check_estimator(config)
    vocab, vocab_from = _check_model(config.model)
    _check_tp(config, vocab, vocab_from)
    _check_teacher(config, vocab, vocab_from)
    _check_lora_saved_modules(config)
    _check_loggers(config)


def _check_filter_groups(config) -> None:
    """``algorithm.filter_groups``: groups of several samples, in the schedules that support it."""
    fg = config.algorithm.filter_groups
    if not fg.enable:
        return
    if config.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable=true needs rollout.n>=2 (it drops groups whose samples all "
                          f"score the same; rollout.n={config.rollout.n} makes every group one sample)")
    if fg.metric == "seq_final_reward" and config.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL "
                          "penalty needs the learner's log-probs, computed after the filter; use score or acc")


def _check_loggers(config) -> None:
    """wandb / mlflow in ``trainer.logger`` are installed (found, not imported: both are heavy)."""
    for name in config.trainer.logger:
        if name in ("wandb", "mlflow") and importlib.util.find_spec(name) is None:
            raise ConfigError(f"trainer.logger names {name}, which is not installed: pip install 'rljax[{name}]' "
                              "(or drop it from trainer.logger)")


def _check_estimator(config) -> None:
    """A user's estimator file loads and its function has the registry's signature."""
    spec = config.algorithm.adv_estimator
    if ":" in spec:
        from rljax.trainer.prepare import load_estimator  # jax: only a plugin estimator needs the registry

        load_estimator(spec)


def _check_model(m) -> tuple[int, str]:
    """``(learner vocabulary size, where that size comes from)``."""
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
    tokenizer, where = checked_tokenizer(m)
    if hf_vocab is not None:
        if tokenizer.vocab_size > hf_vocab:
            raise ConfigError(f"the tokenizer ({where}) has {tokenizer.vocab_size} tokens, more than model.path's "
                              f"config.json vocab_size={hf_vocab}; use the checkpoint's own tokenizer.json")
        return hf_vocab, "model.path's config.json vocab_size"
    # A preset trained from scratch takes the tokenizer's vocabulary (rljax.trainer.build.model_for).
    return tokenizer.vocab_size, f"{where} vocabulary; a preset takes its tokenizer's"


def _check_teacher(config, vocab: int, vocab_from: str) -> None:
    """``distillation.teacher_model.model_path``: ``ref``, or a causal-LM checkpoint directory whose
    vocabulary is the policy's (the teacher scores the policy's token ids, position by position)."""
    d = config.distillation
    path = d.teacher_model.model_path
    if not d.enabled or not path or path == "ref":
        return
    key = f"distillation.teacher_model.model_path={path!r}"
    root = Path(path).expanduser()
    expected = f"expected ref or a local Hugging Face directory of {' / '.join(SUPPORTED_ARCHITECTURES)}"
    if not root.is_dir() or not (root / "config.json").is_file() or not any(root.glob("*.safetensors")):
        raise ConfigError(f"{key} is not a checkpoint directory with config.json and *.safetensors (cwd "
                          f"{os.getcwd()}); {expected}")
    try:
        hf = json.loads((root / "config.json").read_text())
        cap = model_fields(hf).get("final_logit_softcapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key}: config.json is not a supported causal LM ({e}); {expected}") from None
    if cap is not None and config.actor.logprob_impl == "pallas":  # the teacher's log-probs take the actor's impl
        raise ConfigError(f"actor.logprob_impl=pallas: {key} has final_logit_softcapping={cap} (config.json), which "
                          "the Pallas log-prob kernels do not implement; accepted: actor.logprob_impl=auto (runs "
                          "chunked for this model), chunked or naive")
    if hf.get("vocab_size") != vocab:
        raise ConfigError(f"{key} has a vocabulary of {hf.get('vocab_size')} tokens, the policy's {vocab} ({vocab_from}):"
                          " the teacher scores the policy's token ids, so it needs the policy's tokenizer")


def _check_lora_saved_modules(config) -> None:
    """``actor.lora.modules_to_save`` trains a copy of ``lm_head`` / ``embed_tokens``: untied embeddings only."""
    lora, m = config.actor.lora, config.model
    if lora.rank == 0 or not lora.modules_to_save:
        return
    if m.path:
        hf = json.loads((Path(m.path).expanduser() / "config.json").read_text())
        tied, where = bool(hf.get("tie_word_embeddings", False)), f"model.path={m.path!r} (tie_word_embeddings: true)"
    else:
        from rljax.models.config import PRESETS  # jax.numpy: only LoRA's modules_to_save needs the preset shapes

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
