"""KL estimators between the policy and a reference, and categorical entropy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def _k1(logp, ref_logp):
    return logp - ref_logp


def _abs(logp, ref_logp):
    return jnp.abs(logp - ref_logp)


def _k2(logp, ref_logp):
    return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp, ref_logp):
    log_ratio = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


_ESTIMATORS = {"k1": _k1, "kl": _k1, "abs": _abs, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3}


def kl_penalty(logp: chex.Array, ref_logp: chex.Array, *, kind: str) -> jax.Array:
    r"""Per-token KL estimate between the policy and the reference (Schulman 2020, "Approximating KL").

    With :math:`\delta = \log\pi - \log\pi_{ref}`:

    * ``k1`` / ``kl``: :math:`\delta`
    * ``abs``: :math:`|\delta|`
    * ``k2`` / ``mse``: :math:`\tfrac12\delta^2`
    * ``k3`` / ``low_var_kl``: :math:`e^{-\delta} + \delta - 1`, with :math:`-\delta` clamped to
      :math:`\pm 20` and the value clamped to :math:`\pm 10` (as verl)
    * any of these with a ``+`` suffix (``k1+``, ``k3+``): the value of the base estimator with
      the gradient of ``k2`` (straight-through), whose expected gradient is the true KL gradient.

    Args:
      logp: log-probs of the taken tokens under the policy, any shape.
      ref_logp: same shape, under the reference policy.
      kind: estimator name as above.

    Returns:
      Per-element estimate, same shape as ``logp``.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in _ESTIMATORS:
        accepted = ", ".join(KL_KINDS + ("k1+", "k3+"))
        raise ValueError(f"unknown KL estimator {kind!r}; accepted: {accepted}")
    chex.assert_equal_shape([logp, ref_logp])
    value = _ESTIMATORS[base](logp, ref_logp)
    if not kind.endswith("+"):
        return value
    surrogate = _k2(logp, ref_logp)
    return surrogate - jax.lax.stop_gradient(surrogate) + jax.lax.stop_gradient(value)


def entropy_from_logits(logits: chex.Array) -> jax.Array:
    r"""Entropy of the categorical distribution over the last axis.

    .. math:: H(z) = \mathrm{logsumexp}(z) - \sum_v \mathrm{softmax}(z)_v\, z_v

    Computed in float32. Entries of ``-inf`` (masked vocabulary) contribute exactly 0 and
    no NaN reaches the value or the gradient.

    Args:
      logits: ``[..., V]``.

    Returns:
      ``[...]`` float32 entropies.
    """
    chex.assert_rank(logits, {1, 2, 3, 4})
    z = jnp.asarray(logits, jnp.float32)
    finite = jnp.isfinite(z)
    lse = jax.nn.logsumexp(z, axis=-1)
    probs = jnp.exp(jnp.where(finite, z, -jnp.inf) - lse[..., None])
    z_safe = jnp.where(finite, z, 0.0)
    return lse - jnp.sum(jnp.where(finite, probs * z_safe, 0.0), axis=-1)


def mean_sequence_kl(kl: chex.Array, mask: chex.Array, *, row_mask: chex.Array | None = None) -> jax.Array:
    """The batch KL the adaptive controller steers: each row's token-mean of ``kl`` over
    ``mask``, averaged over rows (verl's ``apply_kl_penalty``).

    Args:
      kl: ``[B, T]`` per-token KL (e.g. :func:`kl_penalty` of old vs reference log-probs).
      mask: ``[B, T]`` response mask.
      row_mask: ``[B]`` bool, False on padding rows (excluded from the row mean; verl has none).

    Returns:
      A float32 scalar. A row with an empty mask counts as 0, as in verl.
    """
    chex.assert_rank([kl, mask], 2)
    chex.assert_equal_shape([kl, mask])
    mask = mask.astype(jnp.float32)
    per_row = jnp.sum(kl.astype(jnp.float32) * mask, axis=-1) / (jnp.sum(mask, axis=-1) + 1e-8)
    if row_mask is None:
        return jnp.mean(per_row)
    chex.assert_shape(row_mask, (kl.shape[0],))
    rows = row_mask.astype(jnp.float32)
    return jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def adaptive_kl_coef(kl_coef, current_kl, n_steps, *, target_kl: float, horizon: int) -> jax.Array:
    r"""The next KL-in-reward coefficient of the adaptive controller (Ziegler et al. 2019,
    "Fine-Tuning Language Models from Human Preferences", §2.2; verl's ``AdaptiveKLController``).

    .. math::
        \beta_{t+1} = \beta_t \left(1 + \operatorname{clip}\left(\frac{KL_t}{KL_{target}} - 1,
        -0.2, 0.2\right) \frac{n_t}{H}\right)

    The step's penalty uses :math:`\beta_t` (the value before the update), as verl does.

    Args:
      kl_coef: the current coefficient :math:`\beta_t` (``algorithm.kl_ctrl.kl_coef`` at the start).
      current_kl: the step's batch KL, :func:`mean_sequence_kl` of the in-reward KL.
      n_steps: trajectories in the step (verl passes the batch size); padding rows excluded.
      target_kl: ``algorithm.kl_ctrl.target_kl`` (> 0).
      horizon: ``algorithm.kl_ctrl.horizon`` (>= 1).

    Returns:
      :math:`\beta_{t+1}` as a float32 scalar (works on Python floats and under ``jax.jit``).
    """
    if not target_kl > 0:
        raise ValueError(f"adaptive_kl_coef: target_kl={target_kl} must be > 0")
    if not horizon >= 1:
        raise ValueError(f"adaptive_kl_coef: horizon={horizon} must be >= 1")
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target_kl - 1.0, -0.2, 0.2)
    return jnp.asarray(kl_coef, jnp.float32) * (1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon)
