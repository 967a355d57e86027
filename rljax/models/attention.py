"""Causal grouped-query attention: dense, and blockwise (flash-style) with a custom VJP.

Both compute, for ``q [B,Tq,N,D]`` and ``k, v [B,Tk,K,D]`` (query head ``n`` uses key/value
head ``n // (N/K)``), ``softmax(q k^T / sqrt(D) + mask) v`` where a query sees the keys with
``k_index <= q_index`` that are valid. Softmax statistics are float32.

:func:`blockwise_attention` never materialises the ``[Tq, Tk]`` score matrix: the forward
pass scans over key blocks with an online softmax and keeps only the per-query
softmax statistics (running max and sum); the backward pass recomputes each block's probabilities from it. Memory is
``O(Tq * block)`` per head instead of ``O(Tq * Tk)``, which is what lets activation memory
fall as the sequence is split over ``sp``. Rows with no visible key (padding queries)
average all keys uniformly in both implementations, so they agree everywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_NEG = float(np.finfo(np.float32).min)
_PAD = int(np.iinfo(np.int32).max)  # k_index of keys added to fill the last block


def _mask(q_index, k_index, k_valid):
    """``[B,Tq,Tk]`` bool: causal by index, padding keys hidden."""
    return (k_index[:, None, :] <= q_index[:, :, None]) & k_valid[:, None, :]


def dense_attention(q, k, v, q_index, k_index, k_valid) -> jax.Array:
    """Reference attention; materialises the ``[B,N,Tq,Tk]`` scores.

    Args:
      q: ``[B,Tq,N,D]``; k, v: ``[B,Tk,K,D]`` with ``N % K == 0``.
      q_index, k_index: ``[B,Tq]`` / ``[B,Tk]`` integer indices in the sequence.
      k_valid: ``[B,Tk]`` bool, False for padding keys.

    Returns ``[B,Tq,N,D]`` in ``q.dtype``.
    """
    b, tq, n, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, tq, kh, n // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(_mask(q_index, k_index, k_valid)[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, n, d).astype(q.dtype)


def _blocks(x, nb, block):
    """``[B, nb*block, ...]`` -> ``[nb, B, block, ...]`` (scan over the leading axis)."""
    return jnp.swapaxes(x.reshape(x.shape[0], nb, block, *x.shape[2:]), 0, 1)


def _flash_forward(qg, k, v, q_index, k_index, k_valid, block):
    b, tq, kh, g, d = qg.shape
    nb = k.shape[1] // block
    scale = 1.0 / math.sqrt(d)
    # carries derive from q so that, inside shard_map, they vary over the same mesh axes
    base = jnp.zeros_like(qg[..., 0], dtype=jnp.float32).transpose(0, 2, 3, 1)  # [B,K,G,Tq]
    init = (base + _NEG, base, jnp.zeros_like(qg, dtype=jnp.float32).transpose(0, 2, 3, 1, 4))

    def step(carry, xs):
        m, l, acc = carry
        kc, vc, ki, kv = xs
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
        s = jnp.where(_mask(q_index, ki, kv)[:, None, None], s, _NEG)
        s = jnp.where((ki == _PAD)[:, None, None, None, :], -jnp.inf, s)  # fill keys weigh exactly 0
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return (m_new, l, acc * corr[..., None] + pv), None

    xs = (_blocks(k, nb, block), _blocks(v, nb, block), _blocks(k_index, nb, block), _blocks(k_valid, nb, block))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B,Tq,K,G,D]
    # (m, l) rather than m + log(l): for a query with no visible key m is float32 min and
    # the log would be absorbed.
    return out.astype(qg.dtype), (m, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(qg, k, v, q_index, k_index, k_valid, block):
    return _flash_forward(qg, k, v, q_index, k_index, k_valid, block)[0]


def _flash_fwd(qg, k, v, q_index, k_index, k_valid, block):
    out, stats = _flash_forward(qg, k, v, q_index, k_index, k_valid, block)
    return out, (qg, k, v, q_index, k_index, k_valid, out, stats)


def _flash_bwd(block, res, dout):
    qg, k, v, q_index, k_index, k_valid, out, (m, l) = res
    b, tq, kh, g, d = qg.shape
    nb = k.shape[1] // block
    scale = 1.0 / math.sqrt(d)
    dout = dout.astype(jnp.float32)
    delta = jnp.sum(dout * out.astype(jnp.float32), -1).transpose(0, 2, 3, 1)  # [B,K,G,Tq]

    def step(dq, xs):
        kc, vc, ki, kv = xs
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
        visible = _mask(q_index, ki, kv)[:, None, None]
        s = jnp.where(visible, s, _NEG)
        s = jnp.where((ki == _PAD)[:, None, None, None, :], -jnp.inf, s)
        p = jnp.exp(s - m[..., None]) / l[..., None]
        dv = jnp.einsum("bkgts,btkgd->bskd", p, dout)
        dp = jnp.einsum("btkgd,bskd->bkgts", dout, vc.astype(jnp.float32))
        ds = jnp.where(visible, p * (dp - delta[..., None]) * scale, 0.0)  # masked scores are constants
        dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, kc.astype(jnp.float32))
        dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg.astype(jnp.float32))
        return dq, (dk, dv)

    xs = (_blocks(k, nb, block), _blocks(v, nb, block), _blocks(k_index, nb, block), _blocks(k_valid, nb, block))
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(qg, dtype=jnp.float32), xs)
    unblock = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, nb * block, kh, d)
    return dq.astype(qg.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q, k, v, q_index, k_index, k_valid, *, block_size: int = 512) -> jax.Array:
    """:func:`dense_attention` computed over key blocks of ``block_size`` (same arguments).

    ``Tk`` need not divide ``block_size``: the keys are padded with masked entries.
    """
    b, tq, n, d = q.shape
    tk, kh = k.shape[1], k.shape[2]
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    block = min(block_size, tk)
    pad = -tk % block
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_index = jnp.pad(k_index, ((0, 0), (0, pad)), constant_values=_PAD)
        k_valid = jnp.pad(k_valid, ((0, 0), (0, pad)))
    qg = q.reshape(b, tq, kh, n // kh, d)
    out = _flash(qg, k, v, q_index.astype(jnp.int32), k_index.astype(jnp.int32), k_valid.astype(bool), block)
    return out.reshape(b, tq, n, d)


def attention(q, k, v, q_index, k_index, k_valid, *, block_size: int | None) -> jax.Array:
    """Blockwise when ``block_size`` is set and smaller than ``Tk``, dense otherwise."""
    if block_size is None or k.shape[1] <= block_size:
        return dense_attention(q, k, v, q_index, k_index, k_valid)
    return blockwise_attention(q, k, v, q_index, k_index, k_valid, block_size=block_size)
