"""Typed run configuration: code defaults, YAML presets, ``key=value`` overrides, provenance.

>>> from rljax.config import resolve, write_resolved, non_default_fields
>>> cfg, prov = resolve("default", ["rollout.n=4", "actor.optim.lr=1e-6"])
>>> cfg.rollout.n, prov["rollout.n"]
(4, 'cli')
>>> prov.chain("rollout.n")[0], prov.chain("rollout.n")[-1]
(('default', 8), ('cli', 4))

Pure Python plus PyYAML: the launcher resolves and validates the configuration before
JAX initialises. Errors are :class:`ConfigError` (a ``ValueError``, defined in the leaf
:mod:`rljax.errors` and re-exported here) with one line naming the key and what is accepted.
Checks of the files and data a config names are each package's own ``check(cfg)``, run by
:mod:`rljax.preflight`; this package imports no other rljax package but the leaves. Units of the batch sizes are documented in
:mod:`rljax.config._schema`.
"""

from rljax.errors import ConfigError
from rljax.config._resolve import (
    CLI,
    DEFAULT,
    Change,
    FieldSpec,
    Provenance,
    describe,
    field_specs,
    find_preset,
    format_chain,
    format_config,
    get,
    load_preset,
    load_resolved,
    non_default_fields,
    parse_override,
    preset_dirs,
    resolve,
    resolve_run,
    set_section_class,
    to_dict,
    to_flat_dict,
    write_resolved,
)
from rljax.config._schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    EmbeddedTaskConfig,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    PRESET_POSITIONS,
    RewardConfig,
    RolloutConfig,
    TraceConfig,
    TrainerConfig,
    ValKwargsConfig,
)
from rljax.config._corrections import POLICY_LOSS_KEYS, bypass_loss
from rljax.config._validate import (apply_model_overrides, check_reward_spec, model_overrides, on_policy_blockers,
                                    parse_mesh_spec, validate, validate_for_mesh)

from rljax.config._derived import DerivedSizes, derive
from rljax.config._verl import set_train_row_counter

__all__ = [
    "derive",
    "set_train_row_counter",
    "CLI",
    "DEFAULT",
    "ActorConfig",
    "AlgorithmConfig",
    "Change",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DerivedSizes",
    "DataConfig",
    "EmbeddedTaskConfig",
    "FieldSpec",
    "Provenance",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "PRESET_POSITIONS",
    "RewardConfig",
    "RolloutConfig",
    "TraceConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "apply_model_overrides",
    "check_reward_spec",
    "describe",
    "field_specs",
    "find_preset",
    "format_chain",
    "format_config",
    "get",
    "load_preset",
    "load_resolved",
    "model_overrides",
    "non_default_fields",
    "parse_mesh_spec",
    "parse_override",
    "preset_dirs",
    "resolve",
    "resolve_run",
    "set_section_class",
    "to_dict",
    "to_flat_dict",
    "on_policy_blockers",
    "POLICY_LOSS_KEYS",
    "bypass_loss",
    "validate",
    "validate_for_mesh",
    "write_resolved",
]
