"""The ``custom_vjp`` shared by the ``chunked`` and ``pallas`` paths.

It lives on the per-shard function: called directly it sees the whole problem; called inside
``jax.shard_map`` it sees one shard, merges the vocabulary statistics over ``vocab_axis``
with ``pmax`` / ``psum`` in the forward, and sums ``d hidden`` over the same axis in the
backward. Cotangents are then given the manual-axis type of their primal (``match_vma``), so
a replicated ``unembed`` receives the sum of its per-shard gradients, exactly as JAX's own
autodiff would produce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rljax.pallas import _chunked, _common, _gpu, _tpu

_KERNELS = {"pallas_tpu": _tpu, "pallas_gpu": _gpu}


def _same_dtype(h, w):
    """The kernels' matmuls take one operand dtype: mixed inputs run in the promoted one (as
    the naive path's ``jnp.dot`` would), at the cost of a converted copy of the narrower."""
    dtype = jnp.promote_types(h.dtype, w.dtype)
    return h.astype(dtype), w.astype(dtype)


def _stats(h, w, y, cfg: _common.Config):
    if cfg.impl in _KERNELS:
        h, w = _same_dtype(h, w)
        h, w, y = _common.unify_vma(h, w, y)
        return _KERNELS[cfg.impl].stats(h, w, y, inv_temp=cfg.inv_temp, block_t=cfg.block_t,
                          block_v=cfg.block_v, interpret=cfg.interpret)
    return _chunked.stats(h, w, y, inv_temp=cfg.inv_temp, block_t=cfg.block_t,
                          block_v=cfg.block_v, softcap=cfg.softcap)


def _grads(h, w, y, lse, ez, g_logp, g_ent, cfg: _common.Config, dw_dtype):
    if cfg.impl in _KERNELS:
        h, w = _same_dtype(h, w)
        h, w, y, lse, ez, g_logp, g_ent = _common.unify_vma(h, w, y, lse, ez, g_logp, g_ent)
        return _KERNELS[cfg.impl].grads(h, w, y, lse, ez, g_logp, g_ent, inv_temp=cfg.inv_temp,
                          block_t=cfg.block_t, block_v=cfg.block_v, dw_dtype=dw_dtype,
                          interpret=cfg.interpret)
    return _chunked.grads(h, w, y, lse, ez, g_logp, g_ent, inv_temp=cfg.inv_temp,
                          block_t=cfg.block_t, block_v=cfg.block_v, dw_dtype=dw_dtype, softcap=cfg.softcap)


def _local_targets(y, n_local_vocab, vocab_axis):
    """Target ids relative to this shard's first column (out of range: not in this shard)."""
    if vocab_axis is None:
        return y
    return y - lax.axis_index(vocab_axis) * n_local_vocab


def _forward(h, w, y, cfg):
    y_local = _local_targets(y, w.shape[1], cfg.vocab_axis)
    m, s, u, zy = _stats(h, w, y_local, cfg)
    if cfg.vocab_axis is not None:
        m, s, u, zy = _common.merge_stats(m, s, u, zy, cfg.vocab_axis)
    logp, entropy, lse, ez = _common.finish_stats(m, s, u, zy)
    return (logp, entropy), (h, w, y_local, lse, ez)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused(h, w, y, cfg):
    """(logp, entropy), float32 [N], for h [N, H], w [H, V_shard], int32 y [N]."""
    return _forward(h, w, y, cfg)[0]


def _fused_bwd(cfg, res, cts):
    h, w, y_local, lse, ez = res
    g_logp, g_ent = (jnp.asarray(g, jnp.float32) for g in cts)
    # d unembed is produced in float32 when it still has to be summed over shards.
    reduce_dw = bool((_common.vma(g_logp) | _common.vma(g_ent) | _common.vma(h))
                     - _common.vma(w))
    dw_dtype = jnp.float32 if reduce_dw else w.dtype
    dh, dw = _grads(h, w, y_local, lse, ez, g_logp, g_ent, cfg, dw_dtype)
    if cfg.vocab_axis is not None:
        dh = lax.psum(dh, cfg.vocab_axis)
    dh = _common.match_vma(dh, h).astype(h.dtype)
    dw = _common.match_vma(dw, w).astype(w.dtype)
    return dh, dw, None


fused.defvjp(_forward, _fused_bwd)
