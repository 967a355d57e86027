"""Masked reductions (the building blocks every loss and estimator uses).

Semantics follow verl's ``verl.utils.torch_functional`` (``masked_sum``, ``masked_mean``,
``masked_var``, ``masked_whiten``), including the ``+1e-8`` guards, so numbers match for
the same inputs. Values outside the mask never reach the result, not even a NaN there.
"""

from __future__ import annotations

from typing import Optional, Union

import chex
import jax
import jax.numpy as jnp

Axis = Optional[Union[int, tuple]]


def _check(values: chex.Array, mask: chex.Array) -> None:
    chex.assert_equal_shape([values, mask])


def masked_sum(values: chex.Array, mask: chex.Array, axis: Axis = None) -> jax.Array:
    r"""Sum of ``values`` where ``mask`` is non-zero.

    .. math:: \sum_i m_i v_i

    Entries with ``mask == 0`` are replaced by 0 before the product, so a NaN or inf there
    cannot contaminate the sum or its gradient.

    Args:
        values: any shape.
        mask: same shape as ``values``; bool or numeric (a numeric mask weights the sum).
        axis: axis or axes to reduce; ``None`` reduces everything.

    Returns:
        The masked sum, ``values`` reduced over ``axis``.
    """
    _check(values, mask)
    mask = jnp.asarray(mask)
    valid = jnp.where(mask.astype(bool), values, 0.0)
    return jnp.sum(valid * mask.astype(valid.dtype), axis=axis)


def masked_mean(values: chex.Array, mask: chex.Array, axis: Axis = None) -> jax.Array:
    r"""Mean of ``values`` over the mask: :math:`\sum m v / (\sum m + 10^{-8})` (as verl)."""
    _check(values, mask)
    mask = jnp.asarray(mask)
    total = masked_sum(values, mask, axis)
    return total / (jnp.sum(mask.astype(total.dtype), axis=axis) + 1e-8)


def masked_var(values: chex.Array, mask: chex.Array, *, unbiased: bool = True) -> jax.Array:
    r"""Variance of ``values`` over the whole mask.

    .. math:: \mathrm{var} = \frac{n}{n-1}\,\mathrm{mean}_m\big((v - \mathrm{mean}_m v)^2\big)

    with Bessel's correction ``n/(n-1)`` when ``unbiased`` (``n = sum(mask)``).

    verl raises when ``n <= 1``; a jitted function cannot raise on a value, so here the
    correction is skipped when ``n <= 1`` (the variance of zero or one element is 0).
    """
    _check(values, mask)
    mask = jnp.asarray(mask)
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask.astype(var.dtype))
        safe = jnp.where(n > 1, n - 1, 1.0)
        var = var * jnp.where(n > 1, n / safe, 1.0)
    return var


def masked_whiten(values: chex.Array, mask: chex.Array, *, shift_mean: bool = True) -> jax.Array:
    r"""Whiten with masked statistics: :math:`(v - \mu_m) / \sqrt{\sigma^2_m + 10^{-8}}`.

    With ``shift_mean=False`` the mean is added back after scaling (as verl).
    Statistics use only masked entries; the whole array is transformed.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
