"""Top-k of a softmax over a large vocabulary, and log-probs at given token ids, without ``[N, V]``
logits: the chunked path's ``lax`` loops over ``[block_t, block_v]`` logit tiles
(:mod:`rljax.pallas._chunked`), for ``forward_kl_topk`` distillation (:mod:`rljax.trainer.teacher`).

* :func:`fused_topk_logprob` ``(hidden, unembed, k) -> (ids, logp) [.., k]``: the teacher's ``k``
  most likely tokens per position and their log-probs. Per token block, each vocabulary chunk's
  logits are merged into a running top-k (``lax.top_k`` over the ``k`` kept and the chunk's
  ``block_v`` candidates) and running log-sum-exp statistics. No gradient (the teacher's).
* :func:`fused_logprob_at` ``(hidden, unembed, ids) -> logp [.., K]``: the student's log-probs of
  given ids per position, differentiable; its ``custom_vjp`` recomputes the tiles in the
  backward: ``d z = onehot-scatter(g) - (sum_j g_j) softmax(z)``.

Both take ``z = hidden @ unembed / temperature`` (with ``softcap``, Gemma 2's final-logit
soft-capping: ``softcap * tanh(hidden @ unembed / softcap) / temperature``) in float32 (operands in the input dtype, float32
accumulation), as :func:`rljax.pallas.fused_logprob`. ``*_sharded`` run them under
``jax.shard_map`` with tokens split over the batch axes and ``sp`` and the vocabulary whole on
each device (``unembed`` replicated; with ``tp`` > 1 each ``tp`` rank repeats its tokens' work).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from rljax.pallas._chunked import _capped_logits, _logits, _loop, _slice, default_blocks
from rljax.pallas._common import MASK_VALUE, full, match_vma, softcap_value, unify_vma, vma


def _fail(msg: str):
    raise ValueError(f"fused top-k log-prob: {msg}")


def _flat(hidden, unembed, last):
    if hidden.ndim not in (2, 3) or unembed.ndim != 2 or unembed.shape[0] != hidden.shape[-1]:
        _fail(f"hidden {hidden.shape} and unembed {unembed.shape}; accepted: [N, H] or [B, T, H] and [H, V]")
    return hidden.reshape(-1, hidden.shape[-1]), hidden.shape[:-1] + (last,)


def _running_lse(m, s, z):
    m_new = jnp.maximum(m, z.max(axis=1))
    return m_new, jnp.exp(m - m_new) * s + jnp.exp(z - m_new[:, None]).sum(axis=1)


def _cap_arg(softcap):
    try:
        return softcap_value(softcap)
    except ValueError as e:
        _fail(str(e))


def _topk_flat(h, w, k: int, inv_temp: float, block_t, block_v, softcap=None):
    n, n_vocab = h.shape[0], w.shape[1]
    block_t, block_v = default_blocks(n, n_vocab, block_t, block_v)

    def token_block(t0, bt, out, inputs):
        h, w = inputs
        h_b = _slice(h, t0, bt, 0)

        def vocab_chunk(v0, bv, carry, inputs):
            h_b, w = inputs
            vals, ids, m, s = carry
            z = _logits(h_b, _slice(w, v0, bv, 1), inv_temp, softcap)  # [bt, bv]
            m, s = _running_lse(m, s, z)
            cand = jnp.concatenate([vals, z], axis=1)
            cand_ids = jnp.concatenate([ids, v0 + lax.broadcasted_iota(jnp.int32, z.shape, 1)], axis=1)
            vals, pick = lax.top_k(cand, k)
            return vals, jnp.take_along_axis(cand_ids, pick, axis=1), m, s

        init = (jnp.full((bt, k), MASK_VALUE, jnp.float32), jnp.zeros((bt, k), jnp.int32),
                jnp.full((bt,), MASK_VALUE, jnp.float32), jnp.zeros((bt,), jnp.float32))
        vals, ids, m, s = _loop(n_vocab, block_v, vocab_chunk, init, (h_b, w))
        logp = vals - (m + jnp.log(s))[:, None]
        return tuple(lax.dynamic_update_slice_in_dim(o, b, t0, axis=0) for o, b in zip(out, (ids, logp)))

    out = (jnp.zeros((n, k), jnp.int32), jnp.zeros((n, k), jnp.float32))
    return _loop(n, block_t, token_block, out, (h, w))


def fused_topk_logprob(hidden, unembed, k: int, *, temperature: float = 1.0, block_t: int | None = None,
                       block_v: int | None = None, softcap: float | None = None):
    """``(ids int32, logp float32)`` with hidden's leading shape + ``[k]``: the ``k`` most likely
    tokens of ``softmax(hidden @ unembed / temperature)`` at each position, most likely first,
    and their log-probs (equal to ``lax.top_k`` of the full log-softmax). Gradient stopped."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= unembed.shape[-1]:
        _fail(f"k={k!r}; accepted: an int in [1, V={unembed.shape[-1]}]")
    h, lead = _flat(hidden, unembed, k)
    h, w = lax.stop_gradient(h), lax.stop_gradient(unembed)
    ids, logp = _topk_flat(h, w, k, 1.0 / float(temperature), block_t, block_v, _cap_arg(softcap))
    return ids.reshape(lead), logp.reshape(lead)


def _at_stats(h, w, ids, inv_temp, block_t, block_v, softcap=None):
    """``(z at ids [N, K], lse [N])`` float32."""
    n, n_vocab = h.shape[0], w.shape[1]
    block_t, block_v = default_blocks(n, n_vocab, block_t, block_v)
    h, w, ids = unify_vma(h, w, ids)
    axes = vma(h)

    def token_block(t0, bt, out, inputs):
        h, w, ids = inputs
        h_b, ids_b = _slice(h, t0, bt, 0), _slice(ids, t0, bt, 0)

        def vocab_chunk(v0, bv, carry, inputs):
            h_b, w, ids_b = inputs
            zk, m, s = carry
            z = _logits(h_b, _slice(w, v0, bv, 1), inv_temp, softcap)
            m, s = _running_lse(m, s, z)
            local = ids_b - v0
            inside = (local >= 0) & (local < bv)
            z_at = jnp.take_along_axis(z, jnp.clip(local, 0, bv - 1), axis=1)
            return zk + jnp.where(inside, z_at, 0.0), m, s

        init = (full(ids_b.shape, 0, jnp.float32, axes), full((bt,), MASK_VALUE, jnp.float32, axes),
                full((bt,), 0, jnp.float32, axes))
        zk, m, s = _loop(n_vocab, block_v, vocab_chunk, init, (h_b, w, ids_b))
        return tuple(lax.dynamic_update_slice_in_dim(o, b, t0, axis=0) for o, b in zip(out, (zk, m + jnp.log(s))))

    out = (full(ids.shape, 0, jnp.float32, axes), full((n,), 0, jnp.float32, axes))
    return _loop(n, block_t, token_block, out, (h, w, ids))


def _at_grads(h, w, ids, lse, g, inv_temp, block_t, block_v, softcap=None):
    """``(d hidden, d unembed)`` float32 of ``sum g * logp_at``: per tile ``dz = scatter(g) - G p``."""
    n, n_vocab = h.shape[0], w.shape[1]
    block_t, block_v = default_blocks(n, n_vocab, block_t, block_v)
    h, w, ids, lse, g = unify_vma(h, w, ids, lse, g)
    axes, total = vma(h), g.sum(axis=1)

    def vocab_chunk(v0, bv, carry, inputs):
        h, w, ids, lse, g, total = inputs
        dh, dw = carry
        w_c = _slice(w, v0, bv, 1)

        def token_block(t0, bt, inner, inputs):
            h, w_c, ids, lse, g, total = inputs
            dh, dw_c = inner
            h_b = _slice(h, t0, bt, 0)
            z, dcap = _capped_logits(h_b, w_c, inv_temp, softcap)
            p = jnp.exp(z - _slice(lse, t0, bt, 0)[:, None])
            local, g_b = _slice(ids, t0, bt, 0) - v0, _slice(g, t0, bt, 0)
            inside = (local >= 0) & (local < bv)
            rows = lax.broadcasted_iota(jnp.int32, local.shape, 0)
            hits = full(z.shape, 0, jnp.float32, axes).at[rows, jnp.clip(local, 0, bv - 1)].add(jnp.where(inside, g_b, 0.0))
            dz = (hits - _slice(total, t0, bt, 0)[:, None] * p) * inv_temp
            if dcap is not None:
                dz = dz * dcap
            dh_b = _slice(dh, t0, bt, 0) + jnp.dot(dz, w_c.T.astype(jnp.float32))
            dh = lax.dynamic_update_slice_in_dim(dh, dh_b, t0, axis=0)
            return dh, dw_c + jnp.dot(h_b.T.astype(jnp.float32), dz)

        dh, dw_c = _loop(n, block_t, token_block, (dh, full((w.shape[0], bv), 0, jnp.float32, axes)),
                         (h, w_c, ids, lse, g, total))
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw.dtype), v0, axis=1)

    init = (full(h.shape, 0, jnp.float32, axes), full(w.shape, 0, w.dtype, axes))
    return _loop(n_vocab, block_v, vocab_chunk, init, (h, w, ids, lse, g, total))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _at(h, w, ids, inv_temp, block_t, block_v, softcap=None):
    zk, lse = _at_stats(h, w, ids, inv_temp, block_t, block_v, softcap)
    return zk - lse[:, None]


def _at_fwd(h, w, ids, inv_temp, block_t, block_v, softcap=None):
    zk, lse = _at_stats(h, w, ids, inv_temp, block_t, block_v, softcap)
    return zk - lse[:, None], (h, w, ids, lse)


def _at_bwd(inv_temp, block_t, block_v, softcap, res, g):
    h, w, ids, lse = res
    dh, dw = _at_grads(h, w, ids, lse, g.astype(jnp.float32), inv_temp, block_t, block_v, softcap)
    return match_vma(dh.astype(h.dtype), h), match_vma(dw.astype(w.dtype), w), None


_at.defvjp(_at_fwd, _at_bwd)


def fused_logprob_at(hidden, unembed, ids, *, temperature: float = 1.0, block_t: int | None = None,
                     block_v: int | None = None, softcap: float | None = None):
    """``logp [.., K]`` float32: ``log softmax(hidden @ unembed / temperature)`` at ``ids``
    (integer ``[.., K]`` with hidden's leading shape), differentiable in ``hidden`` and ``unembed``."""
    if tuple(ids.shape[:-1]) != tuple(hidden.shape[:-1]) or not jnp.issubdtype(ids.dtype, jnp.integer):
        _fail(f"ids {ids.shape} {ids.dtype}; accepted: integer ids of shape hidden's leading {hidden.shape[:-1]} + [K]")
    h, lead = _flat(hidden, unembed, ids.shape[-1])
    logp = _at(h, unembed, ids.reshape(h.shape[0], -1).astype(jnp.int32), 1.0 / float(temperature), block_t, block_v,
               _cap_arg(softcap))
    return logp.reshape(lead)


def _token_specs(hidden, batch_axes: Sequence[str], seq_axis):
    seq = (seq_axis,) if seq_axis else ()
    return P(tuple(batch_axes) or None, *seq) if hidden.ndim == 3 else P((tuple(batch_axes) + seq) or None)


def fused_topk_logprob_sharded(hidden, unembed, k: int, *, mesh: Mesh, batch_axes: Sequence[str] = ("dp",),
                               seq_axis: str | None = "sp", temperature: float = 1.0, **blocks):
    """:func:`fused_topk_logprob` under ``jax.shard_map``: tokens on ``batch_axes`` x ``seq_axis``."""
    tok = _token_specs(hidden, batch_axes, seq_axis)
    fn = functools.partial(fused_topk_logprob, k=k, temperature=temperature, **blocks)
    out = P(*tok, None)
    return jax.shard_map(lambda h, w: fn(h, w), mesh=mesh, in_specs=(P(*tok, None), P(None, None)),
                         out_specs=(out, out), check_vma=False)(hidden, unembed)


def fused_logprob_at_sharded(hidden, unembed, ids, *, mesh: Mesh, batch_axes: Sequence[str] = ("dp",),
                             seq_axis: str | None = "sp", temperature: float = 1.0, **blocks):
    """:func:`fused_logprob_at` under ``jax.shard_map``: tokens on ``batch_axes`` x ``seq_axis``,
    ``unembed`` whole on every device (its gradient summed over the token shards)."""
    tok = _token_specs(hidden, batch_axes, seq_axis)
    fn = functools.partial(fused_logprob_at, temperature=temperature, **blocks)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(*tok, None), P(None, None), P(*tok, None)),
                         out_specs=P(*tok, None))(hidden, unembed, ids)


__all__ = ["fused_logprob_at", "fused_logprob_at_sharded", "fused_topk_logprob", "fused_topk_logprob_sharded"]
