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

Soft-capping (Gemma 2): with ``softcap`` set, every function here replaces the scaled scores
``s`` by ``softcap * tanh(s / softcap)`` before the mask and the softmax (the blockwise
backward multiplies the score cotangent by ``1 - tanh^2``); ``None`` leaves them as they are.

Packed rows (several sequences laid end to end, :mod:`rljax.trainer.packing`) pass
``q_segment`` / ``k_segment`` ids: a query then sees only the keys of its own segment.

Shared prefixes (a group's prompt laid once, then its responses): an id carries a *group*
in its high bits and a *branch* in its low :data:`BRANCH_BITS` (:func:`branch_ids`); branch
0 is the group's shared prefix. A query sees a key when their ids are equal, or when the key
is the shared prefix of the query's own group (:func:`visible`), so a response sees its
prompt and itself, never another response. Plain segment ids ``1, 2, ...`` are branches of
group 0, which has no prefix (id 0 is padding, never a valid key): the plain rule unchanged.
:func:`block_sparse_attention` computes the same attention over only the key blocks a
query block can see (a host-made list), so a row of one prompt and ``n`` responses costs
about what ``n`` rows of prompt + response cost, not the square of its length.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_NEG = float(np.finfo(np.float32).min)
_PAD = int(np.iinfo(np.int32).max)  # k_index of keys added to fill the last block


#: Low bits of a segment id that hold the branch (:func:`branch_ids`); the rest hold the group.
BRANCH_BITS = 16
_BRANCH_MASK = (1 << BRANCH_BITS) - 1


def branch_ids(group, branch):
    """Segment ids of a shared-prefix layout: ``group << BRANCH_BITS | branch`` (``branch`` 0: the
    group's shared prefix, seen by every branch of the group; ``1 <= branch < 2**BRANCH_BITS``: one
    response, which sees the prefix and itself). Works on NumPy and JAX integer arrays."""
    return (group << BRANCH_BITS) | branch


def visible(q_segment, k_segment):
    """bool where a query of id ``q_segment`` may see a key of id ``k_segment`` (broadcasting): the
    same id, or the key is the shared prefix (branch 0) of the query's group (:func:`branch_ids`)."""
    prefix = ((k_segment & _BRANCH_MASK) == 0) & ((k_segment >> BRANCH_BITS) == (q_segment >> BRANCH_BITS))
    return (k_segment == q_segment) | prefix


def soft_cap(x, softcap):
    """``softcap * tanh(x / softcap)`` (Gemma 2's soft-capping of attention scores and of output
    logits); ``None``: ``x`` unchanged."""
    return x if softcap is None else softcap * jnp.tanh(x / softcap)


def _mask(q_index, k_index, k_valid, q_segment=None, k_segment=None):
    """``[B,Tq,Tk]`` bool: causal by index, padding keys hidden, and (with segment ids) a
    query sees only the keys :func:`visible` to it (its own segment, and its group's prefix)."""
    m = (k_index[:, None, :] <= q_index[:, :, None]) & k_valid[:, None, :]
    if q_segment is not None:
        m = m & visible(q_segment[:, :, None], k_segment[:, None, :])
    return m


def dense_attention(q, k, v, q_index, k_index, k_valid, q_segment=None, k_segment=None, *,
                    softcap: float | None = None) -> jax.Array:
    """Reference attention; materialises the ``[B,N,Tq,Tk]`` scores.

    Args:
      q: ``[B,Tq,N,D]``; k, v: ``[B,Tk,K,D]`` with ``N % K == 0``.
      q_index, k_index: ``[B,Tq]`` / ``[B,Tk]`` integer indices in the sequence.
      k_valid: ``[B,Tk]`` bool, False for padding keys.
      q_segment, k_segment: optional ``[B,Tq]`` / ``[B,Tk]`` integer segment ids (packed
        sequences): a query attends only to keys with its own segment id.
      softcap: scores become ``softcap * tanh(scores / softcap)`` before the mask (None: as they are).

    Returns ``[B,Tq,N,D]`` in ``q.dtype``.
    """
    b, tq, n, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, tq, kh, n // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = soft_cap(scores, softcap)
    scores = jnp.where(_mask(q_index, k_index, k_valid, q_segment, k_segment)[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, n, d).astype(q.dtype)


def _blocks(x, nb, block):
    """``[B, nb*block, ...]`` -> ``[nb, B, block, ...]`` (scan over the leading axis)."""
    return jnp.swapaxes(x.reshape(x.shape[0], nb, block, *x.shape[2:]), 0, 1)


def _flash_forward(qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, block, softcap):
    b, tq, kh, g, d = qg.shape
    nb = k.shape[1] // block
    scale = 1.0 / math.sqrt(d)
    # carries derive from q so that, inside shard_map, they vary over the same mesh axes
    base = jnp.zeros_like(qg[..., 0], dtype=jnp.float32).transpose(0, 2, 3, 1)  # [B,K,G,Tq]
    init = (base + _NEG, base, jnp.zeros_like(qg, dtype=jnp.float32).transpose(0, 2, 3, 1, 4))

    def step(carry, xs):
        m, l, acc = carry
        kc, vc, ki, kv, ks = xs
        s = soft_cap(jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale, softcap)
        s = jnp.where(_mask(q_index, ki, kv, q_seg, ks)[:, None, None], s, _NEG)
        s = jnp.where((ki == _PAD)[:, None, None, None, :], -jnp.inf, s)  # fill keys weigh exactly 0
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return (m_new, l, acc * corr[..., None] + pv), None

    xs = (_blocks(k, nb, block), _blocks(v, nb, block), _blocks(k_index, nb, block), _blocks(k_valid, nb, block),
          _blocks(k_seg, nb, block))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4)  # [B,Tq,K,G,D]
    # (m, l) rather than m + log(l): for a query with no visible key m is float32 min and
    # the log would be absorbed.
    return out.astype(qg.dtype), (m, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _flash(qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, block, softcap=None):
    return _flash_forward(qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, block, softcap)[0]


def _flash_fwd(qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, block, softcap=None):
    out, stats = _flash_forward(qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, block, softcap)
    return out, (qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, out, stats)


def _flash_bwd(block, softcap, res, dout):
    qg, k, v, q_index, k_index, k_valid, q_seg, k_seg, out, (m, l) = res
    b, tq, kh, g, d = qg.shape
    nb = k.shape[1] // block
    scale = 1.0 / math.sqrt(d)
    dout = dout.astype(jnp.float32)
    delta = jnp.sum(dout * out.astype(jnp.float32), -1).transpose(0, 2, 3, 1)  # [B,K,G,Tq]

    def step(dq, xs):
        kc, vc, ki, kv, ks = xs
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale
        if softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            t = jnp.tanh(s / softcap)
            s, dcap = softcap * t, 1.0 - t * t
        visible = _mask(q_index, ki, kv, q_seg, ks)[:, None, None]
        s = jnp.where(visible, s, _NEG)
        s = jnp.where((ki == _PAD)[:, None, None, None, :], -jnp.inf, s)
        p = jnp.exp(s - m[..., None]) / l[..., None]
        dv = jnp.einsum("bkgts,btkgd->bskd", p, dout)
        dp = jnp.einsum("btkgd,bskd->bkgts", dout, vc.astype(jnp.float32))
        ds = jnp.where(visible, p * (dp - delta[..., None]) * scale, 0.0)  # masked scores are constants
        if softcap is not None:
            ds = ds * dcap
        dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, kc.astype(jnp.float32))
        dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg.astype(jnp.float32))
        return dq, (dk, dv)

    xs = (_blocks(k, nb, block), _blocks(v, nb, block), _blocks(k_index, nb, block), _blocks(k_valid, nb, block),
          _blocks(k_seg, nb, block))
    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(qg, dtype=jnp.float32), xs)
    unblock = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, nb * block, kh, d)
    return dq.astype(qg.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q, k, v, q_index, k_index, k_valid, q_segment=None, k_segment=None, *,
                        block_size: int = 512, softcap: float | None = None) -> jax.Array:
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
        if k_segment is not None:
            k_segment = jnp.pad(k_segment, ((0, 0), (0, pad)))
    if q_segment is None:  # one segment: every comparison is true
        q_segment, k_segment = jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32)
    qg = q.reshape(b, tq, kh, n // kh, d)
    out = _flash(qg, k, v, q_index.astype(jnp.int32), k_index.astype(jnp.int32), k_valid.astype(bool),
                 q_segment.astype(jnp.int32), k_segment.astype(jnp.int32), block, softcap)
    return out.reshape(b, tq, n, d)


def attention(q, k, v, q_index, k_index, k_valid, q_segment=None, k_segment=None, *,
              block_size: int | None, softcap: float | None = None) -> jax.Array:
    """Blockwise when ``block_size`` is set and smaller than ``Tk``, dense otherwise."""
    if (q_segment is None) != (k_segment is None):
        raise ValueError("attention: pass both q_segment and k_segment, or neither")
    if block_size is None or k.shape[1] <= block_size:
        return dense_attention(q, k, v, q_index, k_index, k_valid, q_segment, k_segment, softcap=softcap)
    return blockwise_attention(q, k, v, q_index, k_index, k_valid, q_segment, k_segment, block_size=block_size,
                               softcap=softcap)


def block_sparse_attention(q, k, v, q_index, k_index, k_valid, q_segment, k_segment, key_blocks, *,
                           softcap: float | None = None) -> jax.Array:
    """:func:`dense_attention` (self-attention, ``Tq == Tk``) over only the listed key blocks.

    The row's ``T`` positions are cut into ``nq`` blocks of ``ceil(T / nq)`` (the last padded with
    hidden keys); ``key_blocks [B, nq, J]`` int32 lists, for each query block of each row, the
    key blocks it reads (-1: an unused entry). A query block attends over its ``J`` listed blocks
    with the mask of :func:`dense_attention`; every key the mask lets a query see must lie in a
    listed block (the caller's contract, :func:`rljax.trainer.packing.key_block_lists` makes such
    lists), and then the result equals :func:`dense_attention`'s to float rounding on every query
    that sees a key (one that sees none averages its listed keys instead of all). Each query
    block runs as one sequence of its ``J`` gathered key blocks through the blockwise kernel
    (online softmax, recomputed in the backward pass): the cost is ``nq * J`` blocks squared
    instead of ``T`` squared, the memory ``J`` gathered copies of the keys and values.
    """
    b, t, n, d = q.shape
    kh = k.shape[2]
    nq, j = key_blocks.shape[1], key_blocks.shape[2]
    block = -(-t // nq)
    pad = nq * block - t
    if pad:
        wide = lambda x, c=0: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=c)  # noqa: E731
        q, k, v = wide(q), wide(k), wide(v)
        q_index, k_index, k_valid = wide(q_index), wide(k_index, _PAD), wide(k_valid)
        q_segment, k_segment = wide(q_segment), wide(k_segment)
    live = key_blocks >= 0
    pick = jax.vmap(lambda x, i: x[i])  # per row: blocks [nq, block, ...] at [nq, J] -> [nq, J, block, ...]

    def gather(x):
        x = pick(x.reshape((b, nq, block) + x.shape[2:]), jnp.maximum(key_blocks, 0))
        return x.reshape((b, nq, j * block) + x.shape[4:])

    kval = gather(k_valid) & jnp.repeat(live, block, axis=2)
    # each (row, query block) is one sequence of J gathered key blocks, run by the blockwise kernel
    flat = lambda x: x.reshape((b * nq,) + x.shape[2:])  # noqa: E731
    qg = q.reshape(b * nq, block, kh, n // kh, d)
    as_int = lambda x: x.reshape(b * nq, -1).astype(jnp.int32)  # noqa: E731
    out = _flash(qg, flat(gather(k)), flat(gather(v)), as_int(q_index), as_int(gather(k_index)), flat(kval),
                 as_int(q_segment), as_int(gather(k_segment)), block, softcap)
    return out.reshape(b, nq * block, n, d)[:, :t]


def live_decode_attention(q, cache_k, cache_v, layer, q_index, *, live=None, block_size: int = 256,
                          softcap: float | None = None) -> jax.Array:
    """Decode attention whose cost follows the live cache length, not its capacity.

    ``q [S,Tn,N,D]`` (new tokens of every slot) against layer ``layer`` of a cache
    ``[L,S,M,K,D]``: query ``(s, t)`` sees cache entries ``j <= q_index[s, t]``. The keys are
    read in blocks of ``block_size`` by a ``fori_loop`` whose trip count is
    ``ceil((max(q_index) + 1) / block_size)`` (the max over the slots marked ``live [S]``
    when given; the others' outputs are then meaningless): blocks past the longest live
    sequence of the step are neither read nor computed. Online softmax in float32 (as
    :func:`blockwise_attention`); equals :func:`dense_attention` over the whole cache with
    ``k_index = arange(M)`` to float rounding.

    Why not a paged cache: pages save memory for uneven lengths, but in JAX every page
    table lookup is a gather over the cache (XLA cannot read scattered pages in place as
    a paged-attention kernel does), which costs more on CPU/GPU than it saves; the
    contiguous ``[S, M]`` cache with a live-length bound keeps dense, sliceable reads.
    """
    s, tn, n, d = q.shape
    m, kh = cache_k.shape[2], cache_k.shape[3]
    block = min(block_size, m)
    qg = q.reshape(s, tn, kh, n // kh, d)
    scale = 1.0 / math.sqrt(d)
    bound = q_index if live is None else jnp.where(live[:, None], q_index, 0)
    num_blocks = (jnp.max(bound) + block) // block
    base = jnp.zeros((s, kh, n // kh, tn), jnp.float32)
    init = (base + _NEG, base, jnp.zeros((s, kh, n // kh, tn, d), jnp.float32))

    def body(i, carry):
        m_run, l_run, acc = carry
        nominal = i * block
        start = jnp.minimum(nominal, m - block)  # the last block may overlap the previous one
        kc = jax.lax.dynamic_slice(cache_k, (layer, 0, start, 0, 0), (1, s, block, kh, d))[0].astype(q.dtype)
        vc = jax.lax.dynamic_slice(cache_v, (layer, 0, start, 0, 0), (1, s, block, kh, d))[0].astype(q.dtype)
        k_index = start + jnp.arange(block)
        visible = (k_index[None, None, :] >= nominal) & (k_index[None, None, :] <= q_index[:, :, None])  # [S,Tn,blk]
        sc = soft_cap(jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32) * scale, softcap)
        sc = jnp.where(visible[:, None, None], sc, -jnp.inf)
        m_new = jnp.maximum(m_run, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        corr = jnp.exp(m_run - m_new)
        l_new = l_run * corr + p.sum(-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return m_new, l_new, acc * corr[..., None] + pv

    _, l_run, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = jnp.where(l_run[..., None] > 0, acc / jnp.maximum(l_run, 1e-30)[..., None], 0.0)
    out = out.transpose(0, 3, 1, 2, 4)  # [S,Tn,K,G,D]
    return out.reshape(s, tn, n, d).astype(q.dtype)


def slot_cache_attention(q, cache_k, cache_v, q_index, *, live=None, block_size: int = 256,
                         softcap: float | None = None) -> jax.Array:
    """Decode attention against one layer's cache laid out ``[S,K,M,D]`` (heads before length).

    ``q [S,Tn,N,D]``: query ``(s, t)`` sees cache entries ``j <= q_index[s, t]``. With the
    length axis after the heads, a slot's keys of one head are contiguous, so both
    ``q.k`` and ``p.v`` are batched dots over ``(slot, head)`` that read the cache in place
    (the ``[S,M,K,D]`` layout needs a transposed copy of every block it reads). Per step it
    reads either the whole cache in place or, when the longest live query (over ``live [S]``
    when given) needs less than half of it, only the keys up to that query, in a loop: the
    whole blocks of ``block_size`` below it, then the rest in blocks of ``block_size // 8``
    (each block a strided copy; on CPU the reads are bound by memory bandwidth, so the finer
    tail reads up to ``7/8`` of a block less). Equals :func:`dense_attention` over the whole
    cache to float rounding; the softmax is float32.
    """
    s, tn, n, d = q.shape
    kh, m = cache_k.shape[1], cache_k.shape[2]
    g = n // kh
    # [S,Tn,K,G,D] -> [S,K,G*Tn,D]: the queries of a kv head are the rows of one dot
    qg = q.reshape(s, tn, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(s, kh, g * tn, d)
    q_idx = jnp.broadcast_to(q_index[:, None, None, :], (s, kh, g, tn)).reshape(s, kh, g * tn)
    scale = 1.0 / math.sqrt(d)
    cast = lambda c: c if c.dtype == q.dtype else c.astype(q.dtype)

    def scores(kc, start):
        sc = soft_cap(jnp.einsum("skqd,skmd->skqm", qg, cast(kc), preferred_element_type=jnp.float32) * scale, softcap)
        k_index = start + jnp.arange(kc.shape[2])
        return sc, k_index

    def whole(_):
        sc, k_index = scores(cache_k, 0)
        sc = jnp.where(k_index[None, None, None, :] <= q_idx[..., None], sc, -jnp.inf)
        mx = sc.max(-1)
        p = jnp.exp(sc - mx[..., None])
        l_run = p.sum(-1)
        acc = jnp.einsum("skqm,skmd->skqd", p.astype(q.dtype), cast(cache_v), preferred_element_type=jnp.float32)
        return l_run, acc

    block = min(block_size, m)
    tail = max(block // 8, 1)
    bound = q_index if live is None else jnp.where(live[:, None], q_index, 0)
    end = jnp.max(bound) + 1  # keys [0, end) are read
    whole_blocks = end // block
    tail_start = whole_blocks * block
    tail_blocks = (end - tail_start + tail - 1) // tail

    def blocked(_):
        base = jnp.zeros((s, kh, g * tn), jnp.float32)

        def body(size, first):
            def step(i, carry):
                m_run, l_run, acc = carry
                start = first + i * size  # < m / 2: blocks never reach the end of the cache here
                kc = jax.lax.dynamic_slice_in_dim(cache_k, start, size, axis=2)
                vc = jax.lax.dynamic_slice_in_dim(cache_v, start, size, axis=2)
                sc, k_index = scores(kc, start)
                sc = jnp.where(k_index[None, None, None, :] <= q_idx[..., None], sc, -jnp.inf)
                m_new = jnp.maximum(m_run, sc.max(-1))
                p = jnp.exp(sc - m_new[..., None])
                corr = jnp.exp(m_run - m_new)
                pv = jnp.einsum("skqm,skmd->skqd", p.astype(q.dtype), cast(vc), preferred_element_type=jnp.float32)
                return m_new, l_run * corr + p.sum(-1), acc * corr[..., None] + pv

            return step

        carry = (base + _NEG, base, jnp.zeros((s, kh, g * tn, d), jnp.float32))
        carry = jax.lax.fori_loop(0, whole_blocks, body(block, 0), carry)
        _, l_run, acc = jax.lax.fori_loop(0, tail_blocks, body(tail, tail_start), carry)
        return l_run, acc

    if m <= block:
        l_run, acc = whole(None)
    else:  # a block is copied, then read: worth it while the live blocks are under half the cache
        l_run, acc = jax.lax.cond(2 * (tail_start + tail_blocks * tail) < m, blocked, whole, None)
    out = jnp.where(l_run[..., None] > 0, acc / jnp.maximum(l_run, 1e-30)[..., None], 0.0)
    out = out.reshape(s, kh, g, tn, d).transpose(0, 3, 1, 2, 4)  # [S,Tn,K,G,D]
    return out.reshape(s, tn, n, d).astype(q.dtype)
