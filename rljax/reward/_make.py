"""The reward a run scores with: in-process, or a pool of worker processes (:func:`make_reward`).

It composes the plugin loader (:mod:`rljax.reward._plugin`), the child-process import probe
(:mod:`rljax.reward._check`) and the worker pool (:mod:`rljax.reward._pool`), so none of those
imports another's factory.
"""

from __future__ import annotations

from rljax.reward._check import probe_plugin
from rljax.errors import ConfigError
from rljax.reward._plugin import (BUILTIN_REWARDS, DATA_SOURCES, InProcessReward, get_reward_fn, has_callable,
                                  reward_spec, weighted_parts)
from rljax.reward._pool import DEFAULT_TIMEOUT_S, RewardPool, default_num_workers


def make_reward(reward_cfg, *, dataset: str | None = None):
    """What :func:`rljax.reward.score_batch` scores with for a ``reward`` config section: the
    function itself (``reward.num_workers=0``, an :class:`InProcessReward`) or a
    :class:`~rljax.reward.RewardPool` of ``reward.num_workers`` worker processes with
    ``reward.timeout_s`` per sample (null: 30 s) and ``reward.memory_mb`` each. ``null``
    workers: 0 for the built-in rewards without a timeout, ``min(8, CPUs)`` otherwise. A plugin
    is loaded first (in a child process when workers will run it, so the trainer never imports
    it), so a broken plugin is a :class:`ConfigError` before any worker starts. Close a pool
    when done."""
    workers, timeout_s = reward_cfg.num_workers, reward_cfg.timeout_s
    spec = reward_spec(reward_cfg)  # reward.function, or reward.functions with their weights
    if workers is None:
        workers = default_num_workers(spec) if timeout_s is None else default_num_workers("")
    if workers == 0:
        return InProcessReward(get_reward_fn(spec, dataset=dataset), clip=reward_cfg.clip)
    if has_callable(spec):
        raise ConfigError(f"reward.num_workers={workers}: a Python callable given to rljax.train runs in the trainer's "
                          "process; use reward.num_workers=0, or a path/to/file.py:function for workers")
    plugins = [f for f, _ in weighted_parts(spec) if f != "auto" and f not in BUILTIN_REWARDS]  # files
    for plugin in plugins:
        probe_plugin(plugin, data_source=DATA_SOURCES.get(dataset, dataset), timeout_s=reward_cfg.import_timeout_s)
    if len(plugins) < len(weighted_parts(spec)):
        get_reward_fn(spec, dataset=dataset)  # auto against a dataset without a default: ConfigError here
    return RewardPool(spec, dataset=dataset, num_workers=workers,
                      timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
                      memory_mb=reward_cfg.memory_mb, clip=reward_cfg.clip)
