"""The chunked-XLA path: plain ``lax`` loops over ``[block_t, block_v]`` logit tiles, never
more than one tile of logits (and its cotangent) alive at a time.

Sizes that are not multiples of the blocks need no padding and no masking: each loop runs a
``fori_loop`` over the full blocks and one statically shaped call for the ragged tail, so the
inputs are never copied.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from rljax.pallas._common import MASK_VALUE, full, logit_cotangent, unify_vma, vma

# Default tile: 1024 x 2048 float32 logits = 8 MiB, so a tile and its exp stay in a CPU's
# last-level cache; measured on CPU (bench/logprob.py) against 256..8192-wide tiles, this was
# the fastest forward and forward+backward at N=4096..8192, V=32768.
DEFAULT_BLOCK_T = 1024
DEFAULT_BLOCK_V = 2048


def default_blocks(n_tokens: int, n_vocab: int, block_t, block_v):
    return min(block_t or DEFAULT_BLOCK_T, n_tokens), min(block_v or DEFAULT_BLOCK_V, n_vocab)


def _loop(total: int, block: int, body, carry, inputs):
    """``body(start, size, carry, inputs)`` over [0, total) in blocks: the full blocks in a
    ``fori_loop``, the ragged tail as one call with a static size.

    ``inputs`` (the arrays the body slices) travel through the loop carry behind an
    ``optimization_barrier``: otherwise XLA:CPU hoists a dtype conversion of a whole bf16
    input (an [H, V] float32 copy of ``unembed``) out of the loop.
    """
    n_full, tail = divmod(total, block)
    if n_full == 1:
        carry = body(0, block, carry, inputs)
    elif n_full > 1:
        def step(i, state):
            carry, pinned = state
            pinned = lax.optimization_barrier(pinned)
            return body(i * block, block, carry, pinned), pinned

        carry, _ = lax.fori_loop(0, n_full, step, (carry, inputs))
    if tail:
        carry = body(n_full * block, tail, carry, inputs)
    return carry


def _slice(x, start, size, axis):
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + size, axis=axis)
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _logits(h, w, inv_temp, softcap=None):
    return _capped_logits(h, w, inv_temp, softcap)[0]


def _capped_logits(h, w, inv_temp, softcap):
    """``(z, dcap)``: the tile's logits ``softcap * tanh(h w / softcap) * inv_temp`` (no cap: ``h w *
    inv_temp``) and ``dz / d(h w) / inv_temp`` (``1 - tanh^2``; None without a cap)."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32)
    if softcap is None:
        return z * inv_temp, None
    t = jnp.tanh(z / softcap)
    return softcap * t * inv_temp, 1.0 - t * t


def stats(h, w, y, *, inv_temp, block_t, block_v, softcap=None):
    """Per-token (m, s, u, zy), float32 [N]; see ``_common.merge_stats``."""
    n, n_vocab = h.shape[0], w.shape[1]
    block_t, block_v = default_blocks(n, n_vocab, block_t, block_v)
    h, w, y = unify_vma(h, w, y)
    axes = vma(h)

    def token_block(t0, bt, out, inputs):
        h, w, y = inputs
        h_b, y_b = _slice(h, t0, bt, 0), _slice(y, t0, bt, 0)

        def vocab_chunk(v0, bv, carry, inputs):
            h_b, w, y_b = inputs
            m, s, u, zy = carry
            z = _logits(h_b, _slice(w, v0, bv, 1), inv_temp, softcap)  # [bt, bv]
            m_new = jnp.maximum(m, z.max(axis=1))
            scale = jnp.exp(m - m_new)
            zc = z - m_new[:, None]
            e = jnp.exp(zc)
            u = scale * (u + (m - m_new) * s) + (e * zc).sum(axis=1)
            s = scale * s + e.sum(axis=1)
            local = y_b - v0
            inside = (local >= 0) & (local < bv)
            z_y = jnp.take_along_axis(z, jnp.clip(local, 0, bv - 1)[:, None], axis=1)[:, 0]
            zy = zy + jnp.where(inside, z_y, 0.0)
            return m_new, s, u, zy

        init = (full((bt,), MASK_VALUE, jnp.float32, axes),) + (full((bt,), 0, jnp.float32, axes),) * 3
        block_stats = _loop(n_vocab, block_v, vocab_chunk, init, (h_b, w, y_b))
        return tuple(
            lax.dynamic_update_slice_in_dim(o, b, t0, axis=0) for o, b in zip(out, block_stats))

    out = (full((n,), 0, jnp.float32, axes),) * 4
    return _loop(n, block_t, token_block, out, (h, w, y))


def grads(h, w, y, lse, ez, g_logp, g_ent, *, inv_temp, block_t, block_v, dw_dtype, softcap=None):
    """(d hidden float32 [N, H], d unembed [H, V] in ``dw_dtype``) for this shard's columns.

    Vocabulary chunks form the outer loop, so each ``d unembed`` chunk is finished (summed over
    all token blocks) before it is written; ``d hidden`` accumulates across chunks.
    """
    n, n_vocab = h.shape[0], w.shape[1]
    block_t, block_v = default_blocks(n, n_vocab, block_t, block_v)
    h, w, y, lse, ez, g_logp, g_ent = unify_vma(h, w, y, lse, ez, g_logp, g_ent)
    axes = vma(h)
    per_token = tuple(x[:, None] for x in (lse, ez, g_logp, g_ent))

    def vocab_chunk(v0, bv, carry, inputs):
        h, w, y, per_token = inputs
        dh, dw = carry
        w_c = _slice(w, v0, bv, 1)

        def token_block(t0, bt, inner, inputs):
            h, w_c, y, per_token = inputs
            dh, dw_c = inner
            h_b = _slice(h, t0, bt, 0)
            z, dcap = _capped_logits(h_b, w_c, inv_temp, softcap)
            cols = v0 + lax.broadcasted_iota(jnp.int32, z.shape, 1)
            hit = cols == _slice(y, t0, bt, 0)[:, None]
            dz = logit_cotangent(z, hit, *(_slice(x, t0, bt, 0) for x in per_token)) * inv_temp
            if dcap is not None:
                dz = dz * dcap
            dh_b = _slice(dh, t0, bt, 0) + jnp.dot(dz, w_c.T, preferred_element_type=jnp.float32)
            dh = lax.dynamic_update_slice_in_dim(dh, dh_b, t0, axis=0)
            dw_c = dw_c + jnp.dot(h_b.T, dz, preferred_element_type=jnp.float32)
            return dh, dw_c

        dh, dw_c = _loop(n, block_t, token_block, (dh, full((w.shape[0], bv), 0, jnp.float32, axes)),
                         (h, w_c, y, per_token))
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_c.astype(dw_dtype), v0, axis=1)

    init = (full(h.shape, 0, jnp.float32, axes), full(w.shape, 0, dw_dtype, axes))
    return _loop(n_vocab, block_v, vocab_chunk, init, (h, w, y, per_token))
