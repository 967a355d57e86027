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
