"""The Pallas kernels for GPUs (Triton lowering): one forward kernel and two backward kernels.

Triton-style: the grid runs one program per token block (forward, ``d hidden``) or per vocab
block (``d unembed``), and each program walks the other dimension with ``fori_loop``s over
refs that hold the whole array, loading ``[rows, cols]`` tiles with masked ``plgpu.load``. A
logit tile ``[block_t, block_v]`` is contracted over ``H`` in ``block_h`` chunks (the K loop
of a Triton matmul), so no operand larger than a ``[block_t, block_h]`` / ``[block_h,
block_v]`` tile is ever loaded and ``H`` needs no particular size.

Forward (grid ``(token blocks,)``): the running max / sum-exp / shifted weighted sum / target
logit of the token block are loop carries (registers), updated once per vocab block: an online
logsumexp. Backward: ``d hidden`` (grid ``(token blocks,)``) loops over vocab blocks, and
``d unembed`` (grid ``(vocab blocks,)``) loops over token blocks; each recomputes its logit tile
and its cotangent ``dz`` and adds ``dz @ unembed^T`` / ``hidden^T @ dz`` chunk by chunk of
``H`` into its own rows / columns of a float32 output (read-modify-write of memory no other
program touches, ordered by a block barrier): deterministic, no atomics, and no accumulator
larger than a tile in registers.

Masking: Triton blocks are powers of two, so edge tiles overrun ``N``, ``V`` and ``H``. Loads
past an edge read 0 (``other=0``), logits of columns ``>= V`` become MASK_VALUE, the cotangent
is zeroed outside the valid rows and columns, and stores are masked. (Interpret mode reads NaN
past an edge, so a missing mask shows up in the CPU tests.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rljax.pallas._common import MASK_VALUE, dot, dot_f32, logit_cotangent, out_struct

DEFAULT_BLOCK_T = 64
DEFAULT_BLOCK_V = 128
BLOCK_H = 64
MIN_BLOCK = 16  # Triton's smallest matrix-multiply tile dimension
NUM_WARPS = 4
NUM_STAGES = 2


def _pow2_at_least(n: int) -> int:
    return max(MIN_BLOCK, pl.next_power_of_2(n))


def default_blocks(n_tokens: int, n_vocab: int, block_t, block_v):
    """Blocks no larger than needed (a power of two >= 16 covering the dimension); the caller
    has checked that explicit ones are powers of two >= 16."""
    return (min(block_t or DEFAULT_BLOCK_T, _pow2_at_least(n_tokens)),
            min(block_v or DEFAULT_BLOCK_V, _pow2_at_least(n_vocab)))


@functools.lru_cache(maxsize=None)
def _params():
    return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of one call (closed over by the kernels)."""

    n: int
    hidden: int
    n_vocab: int
    bt: int
    bv: int
    bh: int
    inv_temp: float
    interpret: bool

    @classmethod
    def of(cls, h, w, block_t, block_v, inv_temp, interpret):
        (n, hidden), n_vocab = h.shape, w.shape[1]
        bt, bv = default_blocks(n, n_vocab, block_t, block_v)
        return cls(n, hidden, n_vocab, bt, bv, min(BLOCK_H, _pow2_at_least(hidden)), inv_temp,
                   interpret)

    def barrier(self):
        """Orders this program's global-memory stores before its later loads (a block barrier;
        the interpreter runs a program's threads as one, and has no lowering for it)."""
        if not self.interpret:
            plgpu.debug_barrier()

    def rows(self, i):
        r = i * self.bt + jnp.arange(self.bt)
        return r, r < self.n

    def cols(self, j):
        c = j * self.bv + jnp.arange(self.bv)
        return c, c < self.n_vocab

    def chunk(self, k):
        return k * self.bh + jnp.arange(self.bh) < self.hidden

    @property
    def n_chunks(self):
        return pl.cdiv(self.hidden, self.bh)


def _load(ref, r0, size, ok, other=0.0):
    return plgpu.load(ref.at[pl.ds(r0, size)], mask=ok, other=other)


def _h_chunk(h_ref, d, i, k, row_ok):
    return plgpu.load(h_ref.at[pl.ds(i * d.bt, d.bt), pl.ds(k * d.bh, d.bh)],
                      mask=row_ok[:, None] & d.chunk(k)[None, :], other=0.0)


def _w_chunk(w_ref, d, j, k, col_ok):
    return plgpu.load(w_ref.at[pl.ds(k * d.bh, d.bh), pl.ds(j * d.bv, d.bv)],
                      mask=d.chunk(k)[:, None] & col_ok[None, :], other=0.0)


def _logits(h_ref, w_ref, d, i, j, row_ok, col_ok):
    """The [bt, bv] float32 logit tile of token block i and vocab block j, contracted over H in
    bh chunks; columns >= V at MASK_VALUE."""
    def k_step(k, acc):
        return acc + dot(_h_chunk(h_ref, d, i, k, row_ok), _w_chunk(w_ref, d, j, k, col_ok),
                         ((1,), (0,)))

    z = lax.fori_loop(0, d.n_chunks, k_step, jnp.zeros((d.bt, d.bv), jnp.float32)) * d.inv_temp
    return jnp.where(col_ok[None, :], z, MASK_VALUE)


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(h_ref, w_ref, y_ref, m_ref, s_ref, u_ref, zy_ref, *, d: _Dims):
    i = pl.program_id(0)
    _, row_ok = d.rows(i)
    y = _load(y_ref, i * d.bt, d.bt, row_ok, other=-1)

    def vocab_step(j, carry):
        m, s, u, zy = carry
        cols, col_ok = d.cols(j)
        z = _logits(h_ref, w_ref, d, i, j, row_ok, col_ok)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        scale = jnp.exp(m - m_new)
        zc = z - m_new[:, None]
        e = jnp.exp(zc)
        u = scale * (u + (m - m_new) * s) + jnp.sum(e * zc, axis=1)
        s = scale * s + jnp.sum(e, axis=1)
        zy = zy + jnp.sum(jnp.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        return m_new, s, u, zy

    zeros = jnp.zeros((d.bt,), jnp.float32)
    init = (jnp.full((d.bt,), MASK_VALUE, jnp.float32), zeros, zeros, zeros)
    out = lax.fori_loop(0, pl.cdiv(d.n_vocab, d.bv), vocab_step, init)
    for ref, value in zip((m_ref, s_ref, u_ref, zy_ref), out):
        plgpu.store(ref.at[pl.ds(i * d.bt, d.bt)], value, mask=row_ok)


def stats(h, w, y, *, inv_temp, block_t, block_v, interpret):
    """Per-token (m, s, u, zy), float32 [N]; see ``_common.merge_stats``."""
    d = _Dims.of(h, w, block_t, block_v, inv_temp, interpret)
    vec = out_struct((d.n,), jnp.float32, h)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, d=d),
        grid=(pl.cdiv(d.n, d.bt),),
        out_shape=[vec] * 4,
        compiler_params=_params(),
        interpret=interpret,
        name="rljax_logprob_fwd_gpu",
    )(h, w, y)


# ----------------------------------------------------------------------------- backward


def _tile_cotangent(h_ref, w_ref, tok, d, i, j, row_ok):
    """dz * inv_temp of tile (i, j), float32, exactly 0 outside the valid rows and columns."""
    y, lse, ez, g_logp, g_ent = tok
    cols, col_ok = d.cols(j)
    z = _logits(h_ref, w_ref, d, i, j, row_ok, col_ok)
    hit = cols[None, :] == y[:, None]
    dz = logit_cotangent(z, hit, lse[:, None], ez[:, None], g_logp[:, None], g_ent[:, None])
    return jnp.where(row_ok[:, None] & col_ok[None, :], dz * d.inv_temp, 0.0), col_ok


def _token_values(refs, d, i, row_ok):
    y_ref, *f32_refs = refs
    return (_load(y_ref, i * d.bt, d.bt, row_ok, other=-1),
            *(_load(r, i * d.bt, d.bt, row_ok) for r in f32_refs))


def _accumulate(ref, rows, cols, mask, update):
    """ref[rows, cols] += update, for memory this program alone writes."""
    view = ref.at[rows, cols]
    plgpu.store(view, plgpu.load(view, mask=mask, other=0.0) + update, mask=mask)


def _dh_kernel(h_ref, w_ref, *refs, d: _Dims):
    *token_refs, dh_ref = refs
    i = pl.program_id(0)
    _, row_ok = d.rows(i)
    rows = pl.ds(i * d.bt, d.bt)
    tok = _token_values(token_refs, d, i, row_ok)

    def zero(k, _):
        mask = row_ok[:, None] & d.chunk(k)[None, :]
        plgpu.store(dh_ref.at[rows, pl.ds(k * d.bh, d.bh)],
                    jnp.zeros((d.bt, d.bh), jnp.float32), mask=mask)

    lax.fori_loop(0, d.n_chunks, zero, None)
    d.barrier()

    def vocab_step(j, _):
        dz, col_ok = _tile_cotangent(h_ref, w_ref, tok, d, i, j, row_ok)

        def k_step(k, _):
            w = _w_chunk(w_ref, d, j, k, col_ok)
            _accumulate(dh_ref, rows, pl.ds(k * d.bh, d.bh), row_ok[:, None] & d.chunk(k)[None, :],
                        dot_f32(dz, w, ((1,), (1,)), x_is_f32=True))

        lax.fori_loop(0, d.n_chunks, k_step, None)
        d.barrier()  # this block's stores are seen by the next block's loads

    lax.fori_loop(0, pl.cdiv(d.n_vocab, d.bv), vocab_step, None)


def _dw_kernel(h_ref, w_ref, *refs, d: _Dims):
    *token_refs, dw_ref = refs
    j = pl.program_id(0)
    _, col_ok = d.cols(j)
    cols = pl.ds(j * d.bv, d.bv)

    def zero(k, _):
        plgpu.store(dw_ref.at[pl.ds(k * d.bh, d.bh), cols], jnp.zeros((d.bh, d.bv), jnp.float32),
                    mask=d.chunk(k)[:, None] & col_ok[None, :])

    lax.fori_loop(0, d.n_chunks, zero, None)
    d.barrier()

    def token_step(i, _):
        _, row_ok = d.rows(i)
        tok = _token_values(token_refs, d, i, row_ok)
        dz, _ = _tile_cotangent(h_ref, w_ref, tok, d, i, j, row_ok)

        def k_step(k, _):
            h = _h_chunk(h_ref, d, i, k, row_ok)
            _accumulate(dw_ref, pl.ds(k * d.bh, d.bh), cols, d.chunk(k)[:, None] & col_ok[None, :],
                        dot_f32(h, dz, ((0,), (0,)), x_is_f32=False))

        lax.fori_loop(0, d.n_chunks, k_step, None)
        d.barrier()

    lax.fori_loop(0, pl.cdiv(d.n, d.bt), token_step, None)


def grads(h, w, y, lse, ez, g_logp, g_ent, *, inv_temp, block_t, block_v, dw_dtype, interpret):
    """(d hidden float32 [N, H], d unembed [H, V] in ``dw_dtype``) for this shard's columns.

    ``d unembed`` accumulates in a float32 output, cast to ``dw_dtype`` afterwards."""
    d = _Dims.of(h, w, block_t, block_v, inv_temp, interpret)
    (n, hidden), n_vocab = h.shape, w.shape[1]
    inputs = (h, w, y, lse, ez, g_logp, g_ent)
    call = functools.partial(pl.pallas_call, compiler_params=_params(), interpret=interpret)
    dh = call(functools.partial(_dh_kernel, d=d), grid=(pl.cdiv(n, d.bt),),
              out_shape=out_struct((n, hidden), jnp.float32, h),
              name="rljax_logprob_bwd_hidden_gpu")(*inputs)
    dw = call(functools.partial(_dw_kernel, d=d), grid=(pl.cdiv(n_vocab, d.bv),),
              out_shape=out_struct((hidden, n_vocab), jnp.float32, h),
              name="rljax_logprob_bwd_unembed_gpu")(*inputs)
    return dh, dw.astype(dw_dtype)
