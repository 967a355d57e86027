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
* A resume records the settings it changes in ``config_changes.jsonl`` (:func:`record_changes`):
  one line per resume, ``{"from_step": s, "restored_step": s - 1, "changed": {key: [was, now]}}``,
  so the records say which values each step ran with (:func:`values_at`) and ``trace check``
  judges each step by its own settings.
* A resume whose checkpoint is at (or past) ``trainer.total_steps`` has nothing to train
  (:func:`nothing_to_train`, as verl stops when ``global_steps >= total_training_steps``):
  the launcher says so in one line and exits 0, writing nothing (raising
  ``trainer.total_steps`` trains on).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from rljax._rundir import CHANGES, read_changes, resume_checkpoint, standing, values_at  # noqa: F401 -- re-exported
from rljax.config import load_resolved, parse_override, resolve, to_flat_dict

RESOLVED = "config.resolved.yaml"
#: Keys that say how a launch resumed or where the run lives, not what a step ran with.
NOT_SETTINGS = ("trainer.resume_mode", "trainer.resume_from", "trainer.output_dir")
#: Keys whose change alters the checkpoint's arrays: never changed by a resume.
SHAPE_KEYS = ("model.name", "model.path", "model.tokenizer", "model.hidden_size", "model.intermediate_size",
              "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.head_dim", "model.tie_embeddings",
              "model.qkv_bias", "actor.lora.rank", "actor.lora.target_modules", "actor.lora.modules_to_save")
#: Key prefixes that name the task: changed only with ``--resume-from-weights``. ``reward.functions``
#: (several rewards) by its own name, not only as a string that starts with ``reward.function``;
#: ``reward.weights`` is a setting a resume may change (recorded, as the reward's other settings).
TASK_PREFIXES = ("data.dataset", "data.path", "data.embedded.", "data.prompt_key", "data.answer_key",
                 "data.messages_key", "data.train_files", "data.val_files", "reward.function", "reward.functions",
                 "env.function")
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


def resume_base(config_name: Optional[str], run_dir: Optional[str], resuming: bool) -> Optional[str]:
    """The recorded configuration a bare ``--resume --run-dir DIR`` (no ``--config``) resolves its
    overrides on, when DIR holds one: the overrides are checked against the run's values, not the
    default preset's (``--resume data.train_batch_size=4`` of a run with
    ``actor.ppo_mini_batch_size=4`` was refused against the preset's 16). None otherwise."""
    if config_name is not None or run_dir is None or not resuming:
        return None
    path = os.path.join(os.path.abspath(run_dir), RESOLVED)
    return path if os.path.isfile(path) else None


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


def record_changes(run_dir: str, cfg, *, unverified: bool = False) -> Optional[dict]:
    """Appends to ``run_dir/config_changes.jsonl`` what a resume of ``run_dir`` under ``cfg`` runs
    with: from the step after the checkpoint it restores (the choice :func:`nothing_to_train` reads),
    each setting that differs from the one that step's predecessor ran with (:func:`values_at` of
    the recorded ``config.resolved.yaml``, read before this launch rewrites it). Written for every
    resume, changed settings or not, so it supersedes the lines of the steps it runs again.
    Nothing for a launch that is not a resume or a run with no recorded configuration. Returns
    the line written."""
    if cfg.trainer.resume_mode != "auto" and cfg.trainer.resume_from is None:
        return None
    got = recorded_config(run_dir)
    if got is None:
        return None
    restored, _ = resume_checkpoint(os.path.join(run_dir, "checkpoints"), cfg.trainer.resume_from,
                                    past_undigested=not unverified)
    from_step = 1 if restored is None else restored + 1
    before = values_at(to_flat_dict(got[0]), read_changes(run_dir), from_step - 1)
    now = to_flat_dict(cfg)
    changed = {k: [_plain(before.get(k)), _plain(v)] for k, v in now.items()
               if k not in NOT_SETTINGS and _plain(before.get(k)) != _plain(v)}
    line = {"from_step": from_step, "restored_step": restored, "changed": changed}
    with open(os.path.join(run_dir, CHANGES), "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
    return line


def _plain(v: Any) -> Any:
    """A value as JSON writes and reads it (tuples as lists)."""
    return json.loads(json.dumps(v))
