"""Shared pieces of the log-prob paths: the statistics merge, the logit-gradient formula and
the helpers that keep gradients well typed inside ``jax.shard_map``."""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

# Padded vocabulary columns get this logit. It is finite on purpose: exp(MASK - m) is an
# exact 0 and 0 * MASK is 0, so no 0 * inf NaN can appear in the entropy or its gradient.
MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable: it is a ``custom_vjp`` non-diff argument)."""

    impl: str  # "chunked", "pallas_tpu" or "pallas_gpu" once resolved
    inv_temp: float
    block_t: int | None
    block_v: int | None
    vocab_axis: str | None = None
    interpret: bool = False
    softcap: float | None = None  # logits soft-capped to softcap * tanh(z / softcap) before the temperature


def softcap_value(softcap) -> float | None:
    """``softcap`` (final-logit soft-capping) as a float (None: no cap), or a ValueError saying what is accepted."""
    if softcap is None:
        return None
    try:
        cap = float(softcap)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        cap = float("nan")
    if isinstance(softcap, bool) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap={softcap!r}; accepted: None or a concrete finite number > 0")
    return cap


def merge_stats(m, s, u, zy, axis_name):
    """Merges per-shard statistics over the vocabulary axis ``axis_name``.

    Each shard holds, per token, ``m = max_v z``, ``s = sum_v exp(z - m)``,
    ``u = sum_v exp(z - m) (z - m)`` over its own columns, and ``zy`` = the target logit if the
    target lives in this shard, else 0.
    """
    m_all = lax.pmax(m, axis_name)
    scale = jnp.exp(m - m_all)
    s_all = lax.psum(s * scale, axis_name)
    u_all = lax.psum(scale * (u + (m - m_all) * s), axis_name)
    zy_all = lax.psum(zy, axis_name)
    return m_all, s_all, u_all, zy_all


def finish_stats(m, s, u, zy):
    """(m, s, u, zy) -> (logp, entropy, lse, mean logit E_p[z]), all float32 [N]."""
    log_s = jnp.log(s)
    mean_shift = u / s  # E_p[z] - m
    lse = m + log_s
    return zy - lse, log_s - mean_shift, lse, m + mean_shift


def logit_cotangent(z, hit, lse, ez, g_logp, g_ent):
    """d(g_logp . logp + g_ent . entropy) / dz for one tile, float32.

    ``z`` is the [rows, cols] logit tile (masked columns at MASK_VALUE), ``hit`` marks the
    target column, the rest are [rows, 1] per-token values. With p = softmax(z):
    d logp / dz = onehot(y) - p and d entropy / dz = -p (z - E_p[z]).
    """
    p = jnp.exp(z - lse)
    dz = -p * (g_logp + g_ent * (z - ez))
    return jnp.where(hit, dz + g_logp, dz)


def vma(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)  # jax <= 0.9 spelling
    if axes is None:
        axes = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return frozenset(axes)


def pvary(x, axes):
    if not axes:
        return x
    axes = tuple(sorted(axes))
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # pragma: no cover - older jax


def unify_vma(*xs):
    """Marks every array as varying over the union of the manual axes any of them varies over
    (needed for primitives such as ``pallas_call`` that want equal input types)."""
    union = frozenset().union(*(vma(x) for x in xs))
    return tuple(pvary(x, union - vma(x)) for x in xs)


def match_vma(ct, primal):
    """Gives a cotangent the manual-axis type of its primal, as JAX's own autodiff would:
    summed over the axes the primal is replicated on, broadcast to the ones it varies over."""
    ct_vma, p_vma = vma(ct), vma(primal)
    extra = ct_vma - p_vma
    if extra:
        ct = lax.psum(ct, tuple(sorted(extra)))
    return pvary(ct, p_vma - ct_vma)


def full(shape, value, dtype, axes):
    """``jnp.full`` typed as varying over the manual axes ``axes`` (for loop carries)."""
    return pvary(jnp.full(shape, value, dtype), axes)


_SDS_PARAMS = inspect.signature(jax.ShapeDtypeStruct).parameters


def out_struct(shape, dtype, like):
    """Output type of a ``pallas_call``, typed (inside ``shard_map``) as varying over the same
    manual axes as ``like``."""
    aval = jax.typeof(like)
    if "manual_axis_type" in _SDS_PARAMS and hasattr(aval, "mat"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.mat)
    if "vma" in _SDS_PARAMS:  # jax <= 0.9 spelling
        return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", frozenset()))
    return jax.ShapeDtypeStruct(shape, dtype)


def _precision(dtype):
    # Explicit, so that a global jax_default_matmul_precision cannot change the kernels (Mosaic
    # rejects "high"; Triton would take TF32): float32 operands get full fp32 contraction,
    # 16-bit ones are exact.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def dot(a, b, dims):
    """float32-accumulated ``dot_general`` of same-dtype operands (inside a kernel)."""
    return lax.dot_general(a, b, (dims, ((), ())), precision=_precision(a.dtype),
                           preferred_element_type=jnp.float32)


def dot_f32(x, y, dims, *, x_is_f32):
    """``dot_general`` of a float32 operand with an operand in the input dtype, float32 result.

    For float32 inputs this is one full-precision matmul. For 16-bit inputs the other operand
    is exact in its dtype, so the float32 one is split into hi + lo 16-bit parts: two native
    matrix-unit passes, ~16 mantissa bits for the float32 operand (vs one pass and 8 bits by
    rounding it, or six passes by upcasting the other operand).
    """
    f32, other = (x, y) if x_is_f32 else (y, x)
    if other.dtype == jnp.float32:
        return dot(x, y, dims)
    hi = f32.astype(other.dtype)
    lo = (f32 - hi.astype(jnp.float32)).astype(other.dtype)
    if x_is_f32:
        return dot(hi, other, dims) + dot(lo, other, dims)
    return dot(other, hi, dims) + dot(other, lo, dims)
