"""Cross-field checks: contradictions between fields, and fit to a mesh. Pure Python."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import string
from collections.abc import Mapping

from rljax._meshspec import MESH_AXES, batch_shards, parse_mesh_sizes
from rljax.config._corrections import check_corrections, correction_blockers
from rljax.config._distill import check_distillation
from rljax.config._schema import ADV_ESTIMATORS, GROUP_ESTIMATORS, MODEL_PRESETS, MODEL_SHAPE_FIELDS, REWARD_BUILTINS
from rljax.errors import ConfigError


def parse_mesh_spec(spec: str | None, key: str = "trainer.mesh") -> dict[str, int] | None:
    """``"dp2,tp2"`` -> ``{"dp": 2, "fsdp": 1, "tp": 2, "sp": 1}`` (syntax only; device count is checked by the launcher)."""
    if spec is None:
        return None
    try:
        _, sizes = parse_mesh_sizes(spec)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def check_estimator_spec(spec: str) -> None:
    """Syntax of ``algorithm.adv_estimator``: a built-in estimator, or ``path/to/file.py:function_name``."""
    if spec in ADV_ESTIMATORS:
        return
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier():
        raise ConfigError(f"algorithm.adv_estimator={spec!r} is not one of {', '.join(ADV_ESTIMATORS)} nor "
                          "path/to/file.py:function_name")


def check_reward_spec(spec: str, key: str = "reward.function") -> None:
    """Syntax of a reward spec: a built-in name, or ``path/to/file.py:function_name``."""
    if spec in REWARD_BUILTINS:
        return
    if ":" not in spec:
        raise ConfigError(
            f"{key}={spec!r} is not a built-in reward ({', '.join(REWARD_BUILTINS)}) nor path/to/file.py:function_name"
        )
    path, name = spec.rsplit(":", 1)
    if not path or not name.isidentifier():
        raise ConfigError(f"{key}={spec!r} must be path/to/file.py:function_name with a Python identifier after ':'")


def check_reward_functions(r) -> None:
    """``reward.functions`` / ``reward.weights``: specs, one weight each, and not beside ``reward.function``."""
    if not r.functions:
        if r.weights:
            raise ConfigError(f"reward.weights={list(r.weights)} weighs reward.functions, which is empty; set "
                              "reward.functions=[a.py:f,b.py:g] or drop reward.weights")
        return
    for spec in r.functions:
        check_reward_spec(spec, "reward.functions")
    if r.function != "auto":
        raise ConfigError(f"reward.function={r.function} and reward.functions are both set; list every function in "
                          f"reward.functions (e.g. [{r.function},...]) and leave reward.function=auto")
    if len(set(r.functions)) != len(r.functions):
        raise ConfigError(f"reward.functions={list(r.functions)} names a function twice; weigh it in reward.weights")
    if r.weights and len(r.weights) != len(r.functions):
        raise ConfigError(f"reward.weights has {len(r.weights)} weights for {len(r.functions)} reward.functions; give "
                          "one each (or [] for 1.0 each)")


ENV_BUILTINS = ("lookup", "tools")


def check_env(config) -> None:
    """``env.*``: the environment spec's syntax, and the lookup task needs its environment."""
    e, d = config.env, config.data
    if e.function is not None:
        if e.function not in ENV_BUILTINS and (":" not in e.function or not e.function.rsplit(":", 1)[1].isidentifier()):
            raise ConfigError(f"env.function={e.function!r} is not a built-in environment ({', '.join(ENV_BUILTINS)}) "
                              "nor path/to/file.py:ClassName")
        if not e.stop:
            raise ConfigError("env.stop is empty; give the token that ends a turn as a tool call (e.g. '?')")
    if d.dataset == "embedded" and d.embedded.task == "lookup" and e.function is None:
        raise ConfigError("data.embedded.task=lookup is a tool task: set env.function=lookup (its answer is only "
                          "known to the lookup tool)")


def on_policy_blockers(config) -> list[str]:
    """Why the actor update is not exactly on-policy, so that ``old_logp`` cannot come from the
    update itself (``actor.skip_old_log_prob``); empty when it can: one epoch over one
    mini-batch, and nothing reads ``old_logp`` before the update."""
    a, al, r = config.actor, config.algorithm, config.rollout
    out = []
    if a.ppo_epochs != 1:
        out.append(f"actor.ppo_epochs={a.ppo_epochs} (updates after the first are off-policy)")
    minis = config.data.train_batch_size // a.ppo_mini_batch_size
    if minis != 1:
        out.append(f"{minis} mini-batches per step (data.train_batch_size={config.data.train_batch_size} / "
                   f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; updates after the first are off-policy)")
    if al.bypass_mode:
        out.append("algorithm.bypass_mode=true (the behaviour log-prob is the sampler's rollout_logp)")
    if r.correction != "none":
        out.append(f"rollout.correction={r.correction} (its weights read old_logp before the update)")
    out += correction_blockers(config)
    if al.use_kl_in_reward:
        out.append("algorithm.use_kl_in_reward=true (the KL penalty in the rewards reads old_logp before the update)")
    if a.lora.rank > 0 and a.lora.dropout > 0:
        out.append(f"actor.lora.dropout={a.lora.dropout} (the update's log-probs are under dropout, the old pass's "
                   "are not)")
    return out


def _check_shared_prefix(a) -> None:
    """``actor.shared_prefix=on`` is a packed layout: the update must run packed."""
    if a.shared_prefix == "on" and (a.use_remove_padding == "false" or (a.lora.rank > 0 and a.lora.dropout > 0)):
        why = ("actor.use_remove_padding=false" if a.use_remove_padding == "false" else
               f"actor.lora.dropout={a.lora.dropout} (use_remove_padding=auto runs such an update padded)")
        raise ConfigError(f"actor.shared_prefix=on lays prompts once in the packed learner rows, but {why}; accepted: "
                          "actor.use_remove_padding=true or auto (without LoRA dropout), or actor.shared_prefix=auto / off")


def validate(config) -> None:
    """Checks that no two fields contradict each other; raises :class:`ConfigError`."""
    d, a, r = config.data, config.actor, config.rollout
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ConfigError(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must divide data.train_batch_size={d.train_batch_size} "
            "(both count prompts)"
        )
    mini_traj = a.ppo_mini_batch_size * r.n
    if a.ppo_micro_batch_size is not None and mini_traj % a.ppo_micro_batch_size:
        raise ConfigError(
            f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size} (trajectories) must divide "
            f"actor.ppo_mini_batch_size*rollout.n={a.ppo_mini_batch_size}*{r.n}={mini_traj}"
        )
    if a.ppo_max_token_len_per_device and a.use_remove_padding == "false":
        raise ConfigError(f"actor.ppo_max_token_len_per_device={a.ppo_max_token_len_per_device} sizes packed "
                          "micro-batches; it needs actor.use_remove_padding=true or auto (or null)")
    if a.use_remove_padding == "true" and a.lora.rank > 0 and a.lora.dropout > 0:
        raise ConfigError(f"actor.use_remove_padding=true does not apply LoRA dropout (actor.lora.dropout="
                          f"{a.lora.dropout}); accepted: actor.lora.dropout=0, or use_remove_padding=auto / false "
                          "(auto runs such an update padded)")
    _check_shared_prefix(a)
    if config.algorithm.adv_estimator in GROUP_ESTIMATORS and r.n < 2:
        raise ConfigError(
            f"rollout.n={r.n} is too small for algorithm.adv_estimator={config.algorithm.adv_estimator}, "
            "which compares samples of one prompt; use rollout.n>=2"
        )
    if a.skip_old_log_prob == "true":
        blockers = on_policy_blockers(config)
        if blockers:
            raise ConfigError(f"actor.skip_old_log_prob=true needs an exactly on-policy update, but {blockers[0]}; "
                              "use auto (skip only when on-policy) or false")
    if config.algorithm.bypass_mode and r.correction != "none":
        raise ConfigError(f"rollout.correction={r.correction} with algorithm.bypass_mode=true: the correction weights "
                          "would all be 1 (old_logp is the rollout log-prob); use rollout.correction=none")
    if d.dataset in ("gsm8k", "local") and not d.path and not (d.dataset == "local" and d.train_files):
        local = " or a datasets.save_to_disk directory (or verl's data.train_files / data.val_files)"
        raise ConfigError(f"data.path is required for data.dataset={d.dataset}: the directory with train/test .jsonl, "
                          ".json or .parquet files" + (local if d.dataset == "local" else ""))
    if (d.train_files or d.val_files) and d.dataset != "local":
        raise ConfigError(f"data.train_files / data.val_files name local files; they need data.dataset=local "
                          f"(now {d.dataset})")
    check_corrections(config)
    check_distillation(config)
    check_template("data.prompt_template", d.prompt_template)
    check_reward_spec(config.reward.function)
    check_reward_functions(config.reward)
    check_estimator_spec(config.algorithm.adv_estimator)
    if config.reward.function == "embedded" and d.dataset != "embedded":
        raise ConfigError(f"reward.function=embedded scores the embedded task only; data.dataset={d.dataset}")
    check_env(config)
    parse_mesh_spec(config.trainer.mesh)
    for key in ("project_name", "experiment_name"):
        name = getattr(config.trainer, key)
        if name.strip() in ("", ".", "..") or "/" in name or "\\" in name:
            raise ConfigError(f"trainer.{key}={name!r} names a run directory component; "
                              "use a non-empty name without '/' or '\\' (not '.' or '..')")
    check_async(config)
    m = config.model
    if m.path is None and m.name not in MODEL_PRESETS:
        raise ConfigError(f"model.name={m.name!r} is not a preset; accepted: {', '.join(MODEL_PRESETS)} (or set model.path)")
    if m.tokenizer is None and m.path is None and m.name != "tiny":
        raise ConfigError(
            f"model.name={m.name} needs a tokenizer: set model.path to the local checkpoint or model.tokenizer to a tokenizer.json"
        )
    if m.eos_token_id is not None and (m.tokenizer == "char" or (m.tokenizer is None and m.path is None)):
        raise ConfigError(f"model.eos_token_id={m.eos_token_id} sets a tokenizer.json's EOS, but the run uses the char "
                          "tokenizer (its EOS is <eos>); set model.path or model.tokenizer, or unset model.eos_token_id")
    shape = model_overrides(m)
    if shape and m.path is not None:
        raise ConfigError(f"model.{next(iter(shape))} overrides a preset's shape, but model.path is set (its config.json "
                          "decides the shape); unset one of them")
    if m.num_heads is not None and m.num_kv_heads is not None and m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
    if m.head_dim is not None and m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even (rotary embedding)")
    if m.head_dim is None and m.hidden_size is not None and m.num_heads is not None and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} does not divide into model.num_heads={m.num_heads} heads; "
                          "set model.head_dim")
    _validate_lora(config)
    check_switched_off(config)


def switched_sections(config, prefix: str = "") -> list[tuple[str, str, str, object, object]]:
    """Every section with an on/off switch (``_section(..., switch=(key, what[, value]))`` in the
    schema), as ``(dotted section, the switch's full key, what it turns on, the section's value,
    the switch value that turns it on or None: any set value)``."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not dataclasses.is_dataclass(value):
            continue
        if "switch" in f.metadata:
            key, what, *on = f.metadata["switch"]
            out.append((prefix + f.name, key if "." in key else f"{prefix}{f.name}.{key}", what, value,
                        on[0] if on else None))
        out.extend(switched_sections(value, prefix + f.name + "."))
    return out


def check_switched_off(config) -> None:
    """A section whose feature is off (its switch null / false / 0, or not the value that turns
    it on) has every other key at its default (its nested sections' too), and a key that needs
    another (``needs``) keeps its default without it: a key set there would be ignored and the
    run would train without what was asked (``reward.judge.prompt_template=...`` with no
    ``reward.judge.path``, ``critic.optim.lr=...`` without ``algorithm.adv_estimator=gae``).

    Raises:
      ConfigError: one line naming the keys set, the switch and how to turn the feature on.
    """
    for section, switch, what, value, on_value in switched_sections(config):
        on = _get(config, switch)
        if (on == on_value) if on_value is not None else on:
            continue
        changed = [f"{k}={_shown(v)}" for k, v in _changed_leaves(value, type(value)(), section)
                   if k != switch]
        if changed:
            turn_on = switch if on_value is None else f"{switch}={_shown(on_value)}"
            raise ConfigError(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} set, but "
                              f"{switch}={_shown(on)} turns {what} off, so nothing would read "
                              f"{'it' if len(changed) == 1 else 'them'}; accepted: set {turn_on} as well, "
                              f"or leave {section}.* at the defaults")
    for key, needs, value, default in needing_keys(config):
        if value != default and not any(_need_met(config, n) for n in needs):
            keys = list(dict.fromkeys(n.partition("=")[0] for n in needs))
            off = " and ".join(f"{k}={_shown(_get(config, k))}" for k in keys)
            wanted = " or ".join(n.replace("=*:*", "=path/to/file.py:function") for n in needs)
            raise ConfigError(f"{key}={_shown(value)} is set, but {off}, so nothing would read it; accepted: set "
                              f"{wanted} as well, or leave {key} at its default {_shown(default)}")


def _need_met(config, need: str) -> bool:
    """A ``needs`` entry: ``key`` set (not null / false / 0), or ``key=pattern`` matched by its value."""
    key, eq, pattern = need.partition("=")
    value = _get(config, key)
    return fnmatch.fnmatchcase(str(value), pattern) if eq else bool(value)


def _changed_leaves(value, default, prefix: str) -> list[tuple[str, object]]:
    """``(full key, value)`` of each leaf of ``value`` (nested sections walked) that differs from ``default``'s."""
    out = []
    for f in dataclasses.fields(value):
        v, d = getattr(value, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(v) and dataclasses.is_dataclass(d):
            out.extend(_changed_leaves(v, d, f"{prefix}.{f.name}"))
        elif v != d:
            out.append((f"{prefix}.{f.name}", v))
    return out


def needing_keys(config, prefix: str = "") -> list[tuple[str, tuple, object, object]]:
    """Every leaf key read only when another is set (``_f(..., needs=(...))`` in the schema), as
    ``(full key, the keys it needs, its value, its default)``."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(needing_keys(value, prefix + f.name + "."))
        elif "needs" in f.metadata:
            out.append((prefix + f.name, f.metadata["needs"], value, getattr(type(config)(), f.name)))
    return out


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _shown(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return "[" + ",".join(map(str, v)) + "]"
    return repr(v) if isinstance(v, str) else str(v)


def _validate_lora(config) -> None:
    lora = config.actor.lora
    if lora.rank > 0 and not lora.target_modules:
        raise ConfigError("actor.lora.target_modules is empty; name at least one projection (e.g. [q_proj,v_proj])")
    if lora.rank > 0 and len(set(lora.target_modules)) != len(lora.target_modules):
        raise ConfigError(f"actor.lora.target_modules={list(lora.target_modules)} names a projection twice")
    if len(set(lora.modules_to_save)) != len(lora.modules_to_save):
        raise ConfigError(f"actor.lora.modules_to_save={list(lora.modules_to_save)} names a module twice")


def check_async(config) -> None:
    """``rollout.placement`` / ``rollout.num_devices`` and ``async_training.*`` against each other."""
    r, at = config.rollout, config.async_training
    if r.placement == "disaggregated":
        if r.num_devices is None:
            raise ConfigError("rollout.placement=disaggregated needs rollout.num_devices (sampler devices per process)")
        if r.num_devices % r.tp:
            raise ConfigError(f"rollout.num_devices={r.num_devices} must be a multiple of rollout.tp={r.tp}")
    elif r.num_devices is not None:
        raise ConfigError(f"rollout.num_devices={r.num_devices} is only used with rollout.placement=disaggregated "
                          "(the colocated sampler uses every local device)")
    if config.trainer.mode == "async" and at.max_staleness < at.trigger_parameter_sync_step - 1:
        raise ConfigError(
            f"async_training.max_staleness={at.max_staleness} is below trigger_parameter_sync_step-1="
            f"{at.trigger_parameter_sync_step - 1}: weights pushed every {at.trigger_parameter_sync_step} updates lag "
            "the learner by that many versions, so every batch would be dropped as stale")

def model_overrides(model) -> dict:
    """The ``model.*`` shape overrides that are set, as ``rljax.models.ModelConfig`` fields.

    ``{}`` when none is set. When ``hidden_size`` or ``num_heads`` is overridden and
    ``head_dim`` is not, the preset's ``head_dim`` no longer fits: the caller derives
    ``head_dim = hidden_size / num_heads`` (see :func:`apply_model_overrides`).
    """
    return {k: getattr(model, k) for k in MODEL_SHAPE_FIELDS if getattr(model, k) is not None}


def apply_model_overrides(base, model):
    """``base`` (a ``rljax.models.ModelConfig`` preset) with the ``model.*`` overrides applied.

    Raises ``ConfigError`` naming the keys when the result is not a valid model (e.g. heads
    that do not divide the hidden size).
    """
    changes = model_overrides(model)
    if not changes:
        return base
    if "head_dim" not in changes and ("hidden_size" in changes or "num_heads" in changes):
        hidden, heads = changes.get("hidden_size", base.hidden_size), changes.get("num_heads", base.num_heads)
        if hidden % heads:
            raise ConfigError(f"model.hidden_size={hidden} does not divide into {heads} heads (model.num_heads); "
                              "set model.head_dim")
        changes["head_dim"] = hidden // heads
    try:
        return base.replace(**changes)
    except ValueError as e:
        keys = ", ".join(f"model.{k}={v}" for k, v in model_overrides(model).items())
        raise ConfigError(f"{keys} on preset {model.name!r}: {e}") from None


def validate_for_mesh(config, mesh_sizes: Mapping[str, int], *, num_devices: int | None = None) -> dict[str, int]:
    """Checks the batch sizes against a mesh; returns the derived sizes.

    Args:
      config: a resolved :class:`~rljax.config.Config`.
      mesh_sizes: ``{"dp": .., "fsdp": .., "tp": .., "sp": ..}`` (missing axes are 1).
      num_devices: the device count (default: the product of the mesh sizes).

    Returns:
      ``{"devices", "dp", "fsdp", "tp", "sp", "trajectories_per_step", "trajectories_per_minibatch",
      "micro_batch", "grad_accum", "rollout_replicas"}``.

    Raises:
      ConfigError: when the step's trajectories (``train_batch_size * rollout.n``), a
        mini-batch (``ppo_mini_batch_size * rollout.n``) or a micro-batch do not divide
        ``dp * fsdp``, when ``rollout.tp`` does not divide the devices, or when the mesh needs a
        different number of devices.
    """
    unknown = set(mesh_sizes) - set(MESH_AXES)
    if unknown:
        raise ConfigError(f"mesh axes {sorted(unknown)} are not accepted; accepted: {', '.join(MESH_AXES)}")
    sizes = {ax: int(mesh_sizes.get(ax, 1)) for ax in MESH_AXES}
    if any(v < 1 for v in sizes.values()):
        raise ConfigError(f"mesh sizes must be >= 1, got {sizes}")
    devices = math.prod(sizes.values())
    if num_devices is not None and num_devices != devices:
        raise ConfigError(f"mesh {sizes} needs {devices} devices, found {num_devices}")
    dp = batch_shards(sizes)  # the batch splits over dp x fsdp
    shards = f"dp={dp}" if sizes["fsdp"] == 1 else f"dp*fsdp={sizes['dp']}*{sizes['fsdp']}={dp}"
    d, a, r = config.data, config.actor, config.rollout
    per_step = d.train_batch_size * r.n
    per_mini = a.ppo_mini_batch_size * r.n
    micro = a.ppo_micro_batch_size or per_mini
    for name, value in (
        (f"data.train_batch_size*rollout.n={d.train_batch_size}*{r.n}", per_step),
        (f"actor.ppo_mini_batch_size*rollout.n={a.ppo_mini_batch_size}*{r.n}", per_mini),
        ("actor.ppo_micro_batch_size", micro),
    ):
        if value % dp:
            raise ConfigError(f"{name}={value} trajectories must be divisible by the mesh's {shards}")
    if r.placement == "colocated" and devices % r.tp:
        raise ConfigError(f"rollout.tp={r.tp} must divide the device count {devices}")
    return {
        "devices": devices,
        **sizes,
        "trajectories_per_step": per_step,
        "trajectories_per_minibatch": per_mini,
        "micro_batch": micro,
        "grad_accum": per_mini // micro,
        "rollout_replicas": (r.num_devices if r.placement == "disaggregated" else devices) // r.tp,
    }


def check_template(key: str, template: str | None) -> None:
    """A prompt template must be a format string whose only field is ``{prompt}``."""
    if template is None:
        return
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"{key}={template!r} is not a valid format string ({e}); use {{prompt}} and double other braces") from None
    if fields != {"prompt"}:
        raise ConfigError(f"{key}={template!r} must contain the field {{prompt}} and no other; found {sorted(fields) or 'none'}")
