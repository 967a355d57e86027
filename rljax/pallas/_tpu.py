"""The Pallas kernels (TPU / Mosaic backend): one forward kernel and two backward kernels.

Forward: grid ``(token blocks, vocab blocks)``, vocab axis ``"arbitrary"``; per-token running
max / sum-exp / shifted weighted sum / target logit live in VMEM scratch and are written once,
at the last vocab block. Backward: ``d hidden`` accumulates over vocab blocks on the same grid;
``d unembed`` runs on the transposed grid ``(vocab blocks, token blocks)`` and accumulates over
token blocks. Both recompute their logit tile from ``hidden`` and ``unembed``.

Edge blocks (``N`` or ``V`` not a multiple of the block) read undefined rows / columns on TPU
(NaN in interpret mode), so every kernel masks: logits of columns ``>= V`` become MASK_VALUE,
and the operands of the backward matmuls are zeroed where they are out of range. Per-token
vectors travel lane-replicated as ``[N, 128]`` arrays, the layout Mosaic handles natively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rljax.pallas._common import MASK_VALUE, dot as _dot, dot_f32 as _dot_f32, logit_cotangent, out_struct as _out_struct

LANES = 128
DEFAULT_BLOCK_T = 256
DEFAULT_BLOCK_V = 512
# Requested scoped-VMEM ceiling: what every current TPU generation has per core (v7x: 64 MiB).
_VMEM_CAP = 64 * 1024 * 1024


def default_blocks(n_tokens: int, n_vocab: int, block_t, block_v):
    """A block equal to the full dimension is always legal; otherwise the caller has checked
    block_t % 8 == 0 and block_v % 128 == 0."""
    return min(block_t or DEFAULT_BLOCK_T, n_tokens), min(block_v or DEFAULT_BLOCK_V, n_vocab)


def _lanes(x):
    """[N] -> [N, 128] float32, lane-replicated (target ids < 2**24 are exact)."""
    return jnp.broadcast_to(x.astype(jnp.float32)[:, None], (x.shape[0], LANES))


def _col(ref):
    """A lane-replicated [rows, 128] block as a [rows, 1] column: a lane reduction of equal
    values, which needs no unaligned lane slicing."""
    return jnp.max(ref[...], axis=1, keepdims=True)


def _hit(cols, y_ref):
    return cols == _col(y_ref).astype(jnp.int32)


def _interpret_arg(interpret):
    return pltpu.InterpretParams() if interpret else False


def _compiler_params(semantics, vmem_bytes):
    limit = None
    if vmem_bytes > 16 * 1024 * 1024:  # above the smallest default scoped limit
        limit = min(int(vmem_bytes * 1.25), _VMEM_CAP)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)


def _tile(h, w, inv_temp, v0, n_vocab, mask_vocab):
    """Logit tile [bt, bv] in float32 and the global column ids; columns >= V are masked."""
    z = _dot(h, w, ((1,), (0,))) * inv_temp
    cols = v0 + lax.broadcasted_iota(jnp.int32, z.shape, 1)
    if mask_vocab:
        z = jnp.where(cols < n_vocab, z, MASK_VALUE)
    return z, cols


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(y_ref, h_ref, w_ref, out_ref, m_sc, s_sc, u_sc, zy_sc, *, inv_temp, n_vocab,
                block_v, mask_vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        u_sc[...] = jnp.zeros(u_sc.shape, jnp.float32)
        zy_sc[...] = jnp.zeros(zy_sc.shape, jnp.float32)

    z, cols = _tile(h_ref[...], w_ref[...], inv_temp, j * block_v, n_vocab, mask_vocab)
    m = _col(m_sc)
    s = _col(s_sc)
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
    scale = jnp.exp(m - m_new)
    zc = z - m_new
    e = jnp.exp(zc)
    u_new = scale * (_col(u_sc) + (m - m_new) * s) + jnp.sum(e * zc, axis=1, keepdims=True)
    s_new = scale * s + jnp.sum(e, axis=1, keepdims=True)
    zy_new = _col(zy_sc) + jnp.sum(jnp.where(_hit(cols, y_ref), z, 0.0), axis=1, keepdims=True)

    shape = m_sc.shape
    m_sc[...] = jnp.broadcast_to(m_new, shape)
    s_sc[...] = jnp.broadcast_to(s_new, shape)
    u_sc[...] = jnp.broadcast_to(u_new, shape)
    zy_sc[...] = jnp.broadcast_to(zy_new, shape)

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        lane = lax.broadcasted_iota(jnp.int32, shape, 1)
        out_ref[...] = jnp.where(
            lane == 0, m_sc[...],
            jnp.where(lane == 1, s_sc[...], jnp.where(lane == 2, u_sc[...], zy_sc[...])))


def stats(h, w, y, *, inv_temp, block_t, block_v, interpret):
    """Per-token (m, s, u, zy), float32 [N]; see ``_common.merge_stats``."""
    (n, hidden), n_vocab = h.shape, w.shape[1]
    bt, bv = default_blocks(n, n_vocab, block_t, block_v)
    grid = (pl.cdiv(n, bt), pl.cdiv(n_vocab, bv))
    kernel = functools.partial(
        _fwd_kernel, inv_temp=inv_temp, n_vocab=n_vocab, block_v=bv,
        mask_vocab=n_vocab % bv != 0)
    vmem = 2 * (bt * hidden * h.dtype.itemsize + hidden * bv * w.dtype.itemsize) + 6 * bt * bv * 4
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bt, LANES), lambda i, j: (i, 0)),
            pl.BlockSpec((bt, hidden), lambda i, j: (i, 0)),
            pl.BlockSpec((hidden, bv), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bt, LANES), lambda i, j: (i, 0)),
        out_shape=_out_struct((n, LANES), jnp.float32, h),
        scratch_shapes=[pltpu.VMEM((bt, LANES), jnp.float32) for _ in range(4)],
        compiler_params=_compiler_params(("parallel", "arbitrary"), vmem),
        interpret=_interpret_arg(interpret),
        name="rljax_logprob_fwd",
    )(_lanes(y), h, w)
    return out[:, 0], out[:, 1], out[:, 2], out[:, 3]


# ----------------------------------------------------------------------------- backward


def _tile_cotangent(token_refs, h, w, inv_temp, v0, n_vocab, mask_vocab):
    """dz * inv_temp for one tile (float32, zero on masked columns)."""
    y_ref, lse_ref, ez_ref, g_logp_ref, g_ent_ref = token_refs
    z, cols = _tile(h, w, inv_temp, v0, n_vocab, mask_vocab)
    dz = logit_cotangent(z, _hit(cols, y_ref), _col(lse_ref), _col(ez_ref), _col(g_logp_ref),
                         _col(g_ent_ref))
    if mask_vocab:  # exact zeros past V, whatever the cotangent's magnitude
        dz = jnp.where(cols < n_vocab, dz, 0.0)
    return dz * inv_temp, cols


def _dh_kernel(y_ref, lse_ref, ez_ref, g_logp_ref, g_ent_ref, h_ref, w_ref, dh_ref, acc_sc, *,
               inv_temp, n_vocab, block_v, mask_vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    w = w_ref[...]
    token_refs = (y_ref, lse_ref, ez_ref, g_logp_ref, g_ent_ref)
    dz, _ = _tile_cotangent(token_refs, h_ref[...], w, inv_temp, j * block_v, n_vocab, mask_vocab)
    if mask_vocab:  # undefined columns past V would turn 0 * garbage into NaN
        w_cols = j * block_v + lax.broadcasted_iota(jnp.int32, w.shape, 1)
        w = jnp.where(w_cols < n_vocab, w, jnp.zeros_like(w))
    acc_sc[...] += _dot_f32(dz, w, ((1,), (1,)), x_is_f32=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        dh_ref[...] = acc_sc[...].astype(dh_ref.dtype)


def _dw_kernel(y_ref, lse_ref, ez_ref, g_logp_ref, g_ent_ref, h_ref, w_ref, dw_ref, acc_sc, *,
               inv_temp, n_tokens, block_t, n_vocab, block_v, mask_tokens, mask_vocab):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    h = h_ref[...]
    if mask_tokens:  # undefined rows past N (hidden and the per-token residuals)
        h_rows = i * block_t + lax.broadcasted_iota(jnp.int32, h.shape, 0)
        h = jnp.where(h_rows < n_tokens, h, jnp.zeros_like(h))
    token_refs = (y_ref, lse_ref, ez_ref, g_logp_ref, g_ent_ref)
    dz, _ = _tile_cotangent(token_refs, h, w_ref[...], inv_temp, j * block_v, n_vocab, mask_vocab)
    if mask_tokens:
        rows = i * block_t + lax.broadcasted_iota(jnp.int32, dz.shape, 0)
        dz = jnp.where(rows < n_tokens, dz, 0.0)
    acc_sc[...] += _dot_f32(h, dz, ((0,), (0,)), x_is_f32=False)

    @pl.when(i == pl.num_programs(1) - 1)
    def _write():
        dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def grads(h, w, y, lse, ez, g_logp, g_ent, *, inv_temp, block_t, block_v, dw_dtype, interpret):
    """(d hidden float32 [N, H], d unembed [H, V] in ``dw_dtype``) for this shard's columns."""
    (n, hidden), n_vocab = h.shape, w.shape[1]
    bt, bv = default_blocks(n, n_vocab, block_t, block_v)
    nt, nv = pl.cdiv(n, bt), pl.cdiv(n_vocab, bv)
    per_token = [_lanes(x) for x in (y, lse, ez, g_logp, g_ent)]
    tile_bytes = 2 * (bt * hidden * h.dtype.itemsize + hidden * bv * w.dtype.itemsize)
    tile_bytes += 6 * bt * bv * 4 + 4 * hidden * bv + 4 * bt * hidden  # temporaries, f32 copies
    common = dict(inv_temp=inv_temp, n_vocab=n_vocab, block_v=bv, mask_vocab=n_vocab % bv != 0)

    dh = pl.pallas_call(
        functools.partial(_dh_kernel, **common),
        grid=(nt, nv),
        in_specs=[
            *[pl.BlockSpec((bt, LANES), lambda i, j: (i, 0)) for _ in per_token],
            pl.BlockSpec((bt, hidden), lambda i, j: (i, 0)),
            pl.BlockSpec((hidden, bv), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bt, hidden), lambda i, j: (i, 0)),
        out_shape=_out_struct((n, hidden), jnp.float32, h),
        scratch_shapes=[pltpu.VMEM((bt, hidden), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary"), tile_bytes + 8 * bt * hidden),
        interpret=_interpret_arg(interpret),
        name="rljax_logprob_bwd_hidden",
    )(*per_token, h, w)

    dw = pl.pallas_call(
        functools.partial(_dw_kernel, n_tokens=n, block_t=bt, mask_tokens=n % bt != 0, **common),
        grid=(nv, nt),
        in_specs=[
            *[pl.BlockSpec((bt, LANES), lambda j, i: (i, 0)) for _ in per_token],
            pl.BlockSpec((bt, hidden), lambda j, i: (i, 0)),
            pl.BlockSpec((hidden, bv), lambda j, i: (0, j)),
        ],
        out_specs=pl.BlockSpec((hidden, bv), lambda j, i: (0, j)),
        out_shape=_out_struct((hidden, n_vocab), dw_dtype, h),
        scratch_shapes=[pltpu.VMEM((hidden, bv), jnp.float32)],
        compiler_params=_compiler_params(("parallel", "arbitrary"), tile_bytes + 8 * hidden * bv),
        interpret=_interpret_arg(interpret),
        name="rljax_logprob_bwd_unembed",
    )(*per_token, h, w)
    return dh, dw
