"""Advantage estimators: group baselines (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) and GAE.

Semantics follow verl's ``core_algos.py`` so numbers match for the same inputs. verl loops
over a Python dict of group ids; here groups are segment reductions over ``group_ids``
with a static ``num_groups``, so every estimator is jittable and vmappable. Group ids may
be arbitrary integers (for example hashes of prompt uids): they are mapped to dense
indices with a fixed-size ``jnp.unique``.

The functions here are the estimators' own maths, each with the arguments it needs. The
trainer calls every estimator through one signature, registered by name
(:mod:`rljax.loss._estimators`): :func:`register_adv_estimator` and
:func:`get_adv_estimator` live there.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rljax.loss._masked import masked_whiten


def _concrete(x) -> Optional[np.ndarray]:
    """``x`` as a NumPy array when it has a value now (not a tracer under jit/vmap), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _dense_group_index(group_ids: jax.Array, num_groups: int) -> jax.Array:
    """Map arbitrary integer ids to ``[0, num_groups)``, equal ids to equal indices."""
    if not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive Python int (static under jit), got {num_groups!r}")
    concrete = _concrete(group_ids)
    if concrete is not None:
        distinct = np.unique(concrete).size
        if distinct > num_groups:
            raise ValueError(
                f"group_ids hold {distinct} distinct groups but num_groups={num_groups}; "
                "num_groups must be at least the number of distinct ids"
            )
    _, index = jnp.unique(group_ids, size=num_groups, fill_value=None, return_inverse=True)
    return index.reshape(group_ids.shape)


def _check_scores(scores, group_ids, row_mask):
    chex.assert_rank([scores, group_ids], 1)
    chex.assert_equal_shape([scores, group_ids])
    chex.assert_type(group_ids, int)
    if row_mask is not None:
        chex.assert_equal_shape([scores, row_mask])


def _replicated(x: jax.Array) -> jax.Array:
    """``x`` replicated when it is sharded over an explicit mesh axis (no-op otherwise).

    Group statistics couple every row of the batch, and sorting (``jnp.unique``) refuses an
    operand that is explicitly sharded along the sorted axis. The ``[B]`` vectors involved
    are tiny, so gathering them is the right trade.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(s is None for s in spec):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def _group_stats(scores, group_ids, num_groups, row_mask):
    """Per-row group count, group mean and unbiased group std (rows outside ``row_mask`` ignored)."""
    scores = _replicated(jnp.asarray(scores, jnp.float32))
    weight = jnp.ones_like(scores) if row_mask is None else _replicated(jnp.asarray(row_mask, jnp.float32))
    index = _dense_group_index(_replicated(jnp.asarray(group_ids)), num_groups)
    seg = lambda x: jax.ops.segment_sum(x, index, num_segments=num_groups)  # noqa: E731
    count = seg(weight)
    mean = seg(scores * weight) / jnp.maximum(count, 1.0)
    centered = (scores - mean[index]) * weight
    var = seg(centered * centered) / jnp.maximum(count - 1.0, 1.0)
    return scores, weight, count[index], mean[index], jnp.sqrt(var)[index]


def grpo_advantages(
    scores: chex.Array,
    group_ids: chex.Array,
    *,
    num_groups: int,
    eps: float = 1e-6,
    scale_by_std: bool = True,
    row_mask: Optional[chex.Array] = None,
) -> jax.Array:
    r"""GRPO outcome advantage (and Dr.GRPO with ``scale_by_std=False``).

    .. math:: A_i = \frac{s_i - \mu_{g(i)}}{\sigma_{g(i)} + \epsilon}
              \quad\text{or}\quad A_i = s_i - \mu_{g(i)}

    with :math:`\sigma` the unbiased standard deviation of the group. A group of one has
    :math:`\mu = 0, \sigma = 1` (verl's convention). Reference: Shao et al. 2024
    (DeepSeekMath); Dr.GRPO: Liu et al. 2025, arXiv:2503.20783.

    Args:
      scores: ``[B]`` float, one outcome reward per trajectory.
      group_ids: ``[B]`` int, the prompt group of each trajectory (any integers).
      num_groups: static upper bound on the number of distinct ``group_ids``.
      eps: added to the standard deviation.
      scale_by_std: divide by the group standard deviation (GRPO) or not (Dr.GRPO).
      row_mask: optional ``[B]`` bool; rows where it is False (padding rows) are left out
        of every group statistic and get advantage 0.

    Returns:
      ``[B]`` float32 advantages (broadcast them over the response with the loss mask).
    """
    _check_scores(scores, group_ids, row_mask)
    scores, weight, count, mean, std = _group_stats(scores, group_ids, num_groups, row_mask)
    single = count <= 1.0
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    adv = scores - mean
    if scale_by_std:
        adv = adv / (std + eps)
    return adv * weight


def rloo_advantages(
    scores: chex.Array,
    group_ids: chex.Array,
    *,
    num_groups: int,
    row_mask: Optional[chex.Array] = None,
) -> jax.Array:
    r"""RLOO (leave-one-out baseline) outcome advantage.

    .. math:: A_i = s_i - \frac{1}{n-1}\sum_{j \ne i} s_j = \frac{n}{n-1}(s_i - \mu_{g(i)})

    with :math:`n` the group size; 0 for a group of one (verl leaves the raw score there,
    which is not an advantage: rljax returns 0). Reference: Ahmadian et al. 2024,
    arXiv:2402.14740.

    Returns:
      ``[B]`` float32 advantages.
    """
    _check_scores(scores, group_ids, row_mask)
    scores, weight, count, mean, _ = _group_stats(scores, group_ids, num_groups, row_mask)
    factor = jnp.where(count > 1.0, count / jnp.maximum(count - 1.0, 1.0), 0.0)
    return (scores - mean) * factor * weight


def reinforce_pp_baseline_advantages(
    scores: chex.Array,
    group_ids: chex.Array,
    mask: chex.Array,
    *,
    num_groups: int,
) -> jax.Array:
    r"""REINFORCE++-baseline: group-mean baseline, then whitening over the batch.

    .. math:: A_{i,t} = \mathrm{whiten}_m\big((s_i - \mu_{g(i)})\, m_{i,t}\big)\, m_{i,t}

    A group of one has :math:`\mu = 0`. Whitening uses masked batch statistics
    (:func:`masked_whiten`). Reference: Hu 2025, arXiv:2501.03262.

    Args:
      scores: ``[B]`` float.
      group_ids: ``[B]`` int.
      mask: ``[B, T]`` response (loss) mask; padding rows are all zero and count nowhere.
      num_groups: static bound on distinct ids.

    Returns:
      ``[B, T]`` float32 advantages, zero outside the mask.
    """
    chex.assert_rank(mask, 2)
    chex.assert_equal_shape_prefix([scores, mask], 1)
    row_mask = jnp.sum(mask, axis=-1) > 0
    _check_scores(scores, group_ids, row_mask)
    scores, weight, count, mean, _ = _group_stats(scores, group_ids, num_groups, row_mask)
    mean = jnp.where(count <= 1.0, 0.0, mean)
    mask_f = jnp.asarray(mask, jnp.float32)
    adv = ((scores - mean) * weight)[:, None] * mask_f
    return masked_whiten(adv, mask_f) * mask_f


def gae_advantages(
    token_rewards: chex.Array,
    values: chex.Array,
    mask: chex.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    r"""Generalised advantage estimation, TD(:math:`\lambda`) run backwards over the response.

    .. math::
       \delta_t = r_t + \gamma V_{t+1} - V_t, \qquad
       \hat A_t = \delta_t + \gamma\lambda \hat A_{t+1}

    Tokens with ``mask == 0`` (tool observations inside a multi-turn response, padding)
    do not advance the recursion: they carry the next value and the running advantage
    through unchanged, so an agent token before a tool result bootstraps from the next
    agent token. ``returns = A + V`` (before whitening); the advantages are then whitened
    over the mask. Reference: Schulman et al. 2016, arXiv:1506.02438; verl's
    ``compute_gae_advantage_return``.

    Args:
      token_rewards: ``[B, T]`` float.
      values: ``[B, T]`` float, value estimates of the response tokens.
      mask: ``[B, T]`` response (action) mask.
      gamma: discount.
      lam: GAE lambda.

    Returns:
      ``(advantages_whitened, returns)``, both ``[B, T]`` float32.
    """
    chex.assert_rank([token_rewards, values, mask], 2)
    chex.assert_equal_shape([token_rewards, values, mask])
    rewards = jnp.asarray(token_rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    mask_f = jnp.asarray(mask, jnp.float32)

    def step(carry, xs):
        next_value, running = carry
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * running
        next_value = v * m + (1.0 - m) * next_value
        running = adv * m + (1.0 - m) * running
        return (next_value, running), running

    zeros = jnp.zeros_like(rewards[:, 0])  # inherits the batch sharding of the inputs
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, mask_f.T), reverse=True)
    advantages = adv_t.T
    returns = advantages + values
    return masked_whiten(advantages, mask_f), returns
