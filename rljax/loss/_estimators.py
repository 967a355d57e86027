r"""Advantage estimators behind one signature, registered by name (verl's ``register_adv_est``).

The trainer's prepare stage calls the estimator named by ``algorithm.adv_estimator``
through this one signature, so a new estimator (built in or a user's
``path/to/file.py:function``) needs no change to the trainer::

    fn(token_level_rewards, response_mask, *, group_id, num_groups, row_mask, values,
       config) -> (advantages, returns)

Args of every estimator:
  token_level_rewards: ``[B, T]`` float32. The outcome score sits on each trajectory's
    last generated token; with ``algorithm.use_kl_in_reward`` the per-token KL penalty
    ``-kl_coef * KL_t`` is added on every action token. Outcome estimators use
    ``scores = token_level_rewards.sum(-1)`` (verl does the same).
  response_mask: ``[B, T]`` float32 action mask of the learner (the loss mask): 1 on tokens
    the policy generated, 0 on tool observations, padding and padding rows.
  group_id: ``[B]`` int32 dense prompt-group index (the uid's group).
  num_groups: static number of groups.
  row_mask: ``[B]`` bool, False on padding rows (they must get advantage 0).
  values: ``[B, T]`` float32 critic values, or ``None`` without a critic.
  config: a mapping of the ``algorithm.*`` hyper-parameters (``gamma``, ``lam``,
    ``norm_adv_by_std_in_grpo``, ...); read what you need.

Returns ``(advantages, returns)``, both ``[B, T]`` float32. Estimators without a critic
return the advantages as returns (verl's convention). The function is traced under
``jax.jit``: use ``jax.numpy``, no host callbacks.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from rljax.loss._advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rljax.loss._registry import Registry

_ADV_ESTIMATORS = Registry("advantage estimator")


def register_adv_estimator(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering an estimator of the module's signature under ``name``."""
    return _ADV_ESTIMATORS.register(name)


def get_adv_estimator(name: str) -> Callable:
    """The estimator registered as ``name``; ``ValueError`` listing the known names otherwise."""
    return _ADV_ESTIMATORS.get(name)


def registered_adv_estimators() -> tuple[str, ...]:
    return tuple(sorted(_ADV_ESTIMATORS._fns))


def _outcome(token_level_rewards: jax.Array) -> jax.Array:
    return jnp.sum(token_level_rewards, axis=-1)


@register_adv_estimator("grpo")
def _grpo(token_level_rewards, response_mask, *, group_id, num_groups: int, row_mask, values=None,
          config: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    adv = grpo_advantages(_outcome(token_level_rewards), group_id, num_groups=num_groups, row_mask=row_mask,
                          scale_by_std=bool(config.get("norm_adv_by_std_in_grpo", True)))
    adv = adv[:, None] * response_mask
    return adv, adv


@register_adv_estimator("rloo")
def _rloo(token_level_rewards, response_mask, *, group_id, num_groups: int, row_mask, values=None,
          config: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    adv = rloo_advantages(_outcome(token_level_rewards), group_id, num_groups=num_groups, row_mask=row_mask)
    adv = adv[:, None] * response_mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus_baseline")
def _rpp_baseline(token_level_rewards, response_mask, *, group_id, num_groups: int, row_mask, values=None,
                  config: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    mask = response_mask * row_mask[:, None]
    adv = reinforce_pp_baseline_advantages(_outcome(token_level_rewards), group_id, mask, num_groups=num_groups)
    return adv, adv


@register_adv_estimator("gae")
def _gae(token_level_rewards, response_mask, *, group_id, num_groups: int, row_mask, values: Optional[jax.Array],
         config: Mapping[str, Any]) -> tuple[jax.Array, jax.Array]:
    if values is None:
        raise ValueError("adv_estimator 'gae' needs critic values (critic.* and a value model)")
    return gae_advantages(token_level_rewards, values, response_mask, gamma=float(config.get("gamma", 1.0)),
                          lam=float(config.get("lam", 1.0)))
