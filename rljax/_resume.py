"""What a ``--resume`` continues: the run's recorded configuration, and what it may not change.

Pure Python plus :mod:`rljax.config` (the launcher plans a resume before JAX starts, so a
refused resume costs seconds and writes nothing).

* A bare ``--resume`` (no ``--config``) resolves the run's own ``config.resolved.yaml``,
  with the command line's ``key=value`` overrides applied on top; the overrides are listed
  with the values they replace. The one-shot resume choices (``trainer.resume_from``) are
  not inherited from the recorded file.
* Keys that change the saved arrays (the model's shape, LoRA's shape, whether a critic
  exists) cannot change on resume: the launch exits 2 listing each key with both values.
* Keys that name the task (dataset, its files and content, the reward, the environment)
  change only with ``--resume-from-weights``: the policy's weights are taken from the
  checkpoint and the optimizer and data position start fresh.
* A resume whose checkpoint is at (or past) ``trainer.total_steps`` has nothing to train
  (:func:`nothing_to_train`, as verl stops when ``global_steps >= total_training_steps``):
  the launcher says so in one line and exits 0, writing nothing (raising
  ``trainer.total_steps`` trains on).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from rljax._rundir import resume_checkpoint
from rljax.config import load_resolved, parse_override, resolve, to_flat_dict

RESOLVED = "config.resolved.yaml"
#: Keys whose change alters the checkpoint's arrays: never changed by a resume.
SHAPE_KEYS = ("model.name", "model.path", "model.tokenizer", "model.hidden_size", "model.intermediate_size",
              "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.head_dim", "model.tie_embeddings",
              "model.qkv_bias", "actor.lora.rank", "actor.lora.target_modules", "actor.lora.modules_to_save")
#: Key prefixes that name the task: changed only with ``--resume-from-weights``.
TASK_PREFIXES = ("data.dataset", "data.path", "data.embedded.", "data.prompt_key", "data.answer_key",
                 "data.messages_key", "data.train_files", "data.val_files", "reward.function", "env.function")
#: Resume choices that belong to one launch, not to the run (not inherited from the recorded file).
ONE_SHOT = ("trainer.resume_from",)


class ResumeRefused(ValueError):
    """A resume that would break the run or silently change its task; one line, exit 2."""


def _show(v: Any) -> str:
    return "null" if v is None else repr(list(v) if isinstance(v, tuple) else v)


def _diff(before: dict, after: dict, keys) -> list[str]:
    return [f"{k}: {_show(before.get(k))} in the run, {_show(after.get(k))} now" for k in keys
            if before.get(k) != after.get(k)]


def _is_gae(flat: dict) -> bool:
    return flat.get("algorithm.adv_estimator") == "gae"


def recorded_config(run_dir: str):
    """``(config, provenance)`` of ``run_dir/config.resolved.yaml``, or None when there is none."""
    path = os.path.join(run_dir, RESOLVED)
    return load_resolved(path) if os.path.isfile(path) else None


def compare(recorded, cfg, *, from_weights: bool = False) -> Optional[str]:
    """One line when ``cfg`` may not resume a run recorded as ``recorded`` (else None)."""
    before, after = to_flat_dict(recorded), to_flat_dict(cfg)
    shape = _diff(before, after, SHAPE_KEYS)
    if _is_gae(before) != _is_gae(after):
        shape.append(f"algorithm.adv_estimator: {_show(before['algorithm.adv_estimator'])} in the run, "
                     f"{_show(after['algorithm.adv_estimator'])} now (a critic exists in only one of them)")
    if shape:
        return ("resume would break the run: its checkpoints hold other arrays (" + "; ".join(shape) +
                "); resume with the run's values, or start a new run with --run-dir")
    task = _diff(before, after, [k for k in after if k.startswith(TASK_PREFIXES)])
    if task and not from_weights:
        return ("resume under another task (" + "; ".join(task) + "): pass --resume-from-weights to start it from "
                "the run's policy weights (fresh optimizer and data position), or use --run-dir for a new run")
    return None


def plan(config_name: Optional[str], overrides: list[str], run_dir: str, *, from_weights: bool = False):
    """The configuration a resume of ``run_dir`` runs with.

    Returns ``(config, provenance, lines)`` (``lines``: what to print about it), or None when
    the run has no recorded configuration (a first launch with ``--resume``). ``config_name``
    None means the recorded file is the base; otherwise the named preset is, and it is
    compared with the recorded one all the same.

    Raises:
      ResumeRefused: a shape key changed, or a task key without ``from_weights``.
      rljax.config.ConfigError: an override or the recorded file is not valid.
    """
    path = os.path.join(run_dir, RESOLVED)
    got = recorded_config(run_dir)
    if got is None:
        return None
    recorded, _ = got
    lines = []
    if config_name is None:
        given = {parse_override(o)[0] for o in overrides}
        reset = [f"{k}=null" for k in ONE_SHOT if k not in given]
        cfg, prov = resolve(path, reset + list(overrides))
        before, after = to_flat_dict(recorded), to_flat_dict(cfg)
        changed = [f"{k}={_show(after[k])} (was {_show(before[k])})" for k in after
                   if before[k] != after[k] and k not in ONE_SHOT and k != "trainer.resume_mode"]
        lines.append(f"resume: the run's recorded configuration {path}" +
                     (", with overrides: " + ", ".join(changed) if changed else ", no overrides"))
    else:
        cfg, prov = resolve(config_name, list(overrides))
    refusal = compare(recorded, cfg, from_weights=from_weights)
    if refusal:
        raise ResumeRefused(refusal)
    return cfg, prov, lines


def nothing_to_train(run_dir: str, cfg, *, unverified: bool = False) -> Optional[int]:
    """The checkpoint step a resume of ``run_dir`` under ``cfg`` would restore when it is at or
    past ``cfg.trainer.total_steps`` (the run has trained every step: nothing to train), else
    None. Read from the checkpoint directory alone (no array read, nothing written), with the
    choice :meth:`rljax.trainer.checkpoint.Checkpointer.select` makes (``trainer.resume_from``,
    else the newest checkpoint, past those without a digest unless ``unverified``)."""
    step, _ = resume_checkpoint(os.path.join(run_dir, "checkpoints"), cfg.trainer.resume_from,
                                past_undigested=not unverified)
    return step if step is not None and step >= cfg.trainer.total_steps else None


def summary_closed(run_dir: str) -> bool:
    """Whether the run's ``trace_summary.json`` was closed (status ``completed``); read here, without
    :mod:`rljax.trace` (JAX), so a resume of a finished run answers in a second. A summary that is
    not (:func:`rljax.trace.tracer.complete_summary`) is a launch killed after its last step."""
    try:
        with open(os.path.join(run_dir, "trace_summary.json"), encoding="utf-8") as fh:
            return json.load(fh).get("status") == "completed"
    except (OSError, ValueError, AttributeError):
        return False
