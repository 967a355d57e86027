"""rljax: JAX-native reinforcement-learning post-training for language models.

Sub-packages are imported on demand; importing ``rljax`` itself pulls in nothing heavy, so
``from rljax.loss import ...`` costs only JAX, chex and numpy.

Layers, top to bottom (a module imports only from layers below its own, never sideways or up;
``tests/project/test_import_layers.py`` enforces it, deferred imports included):

    api                                       rljax.train: the launcher from Python
    launch, export                            the command lines: compose everything, hold no logic
    plan                                      --plan: per-device memory of a run before it starts
    preflight, _resume                        launch-time input checks (each package's check(cfg)); resume plans
    trainer                                   stages, schedulers, the update, checkpoints, the step loop
    env, trace                                multi-turn episodes; the run's trace, ledgers, metrics, alerts
    rollout, data                             the sampler and its engine; datasets, prompts, iteration
    reward                                    rule rewards, path:function plugins, worker pools
    models                                    the transformer, its parameters, LoRA, HF checkpoints, remat
    config                                    schema, resolve, validate (no package-specific checks)
    loss, sharding, pallas                    pure math, meshes and layouts, kernels: no other package
    tokenizer, hf_config, compilation_cache, _meshspec, _tensorflow, _rundir, _digest, _rollout_thresholds    small leaves
    errors, rljax                             ConfigError / UsageError; this file (imports nothing)

A package checks its own inputs in ``check(cfg)`` (``rljax.data.check``, ``rljax.reward.check``,
``rljax.env.check``, ``rljax.trainer.check``), which :mod:`rljax.preflight` runs before JAX
starts; errors come from the leaf :mod:`rljax.errors`. An import is deferred into a function
only where the module is heavy or must wait (JAX before the launcher sets up devices,
TensorFlow, torch, wandb, mlflow), with a one-line reason beside it.
"""

__version__ = "0.1.0.dev0"


def __getattr__(name):
    """``rljax.train`` (:func:`rljax.api.train`), loaded on first use: importing rljax stays light."""
    if name == "train":
        import importlib

        return importlib.import_module("rljax.api").train
    raise AttributeError(f"module 'rljax' has no attribute {name!r}")
