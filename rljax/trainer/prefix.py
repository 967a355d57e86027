"""The shared-prefix layout of the packed learner passes (``actor.shared_prefix``).

GRPO scores ``n`` responses per prompt; the packed layout (:mod:`rljax.trainer.packing`) lays
each trajectory's prompt again for every response, so with 190-token prompts and 250-token
responses the learner's tokens are 43% prompt. Here the members of a micro-batch that share a
prompt are laid as one unit: the prompt once (less its last token), then per response its last
prompt token and the response, positions continuing from the prompt (verl's PrefixGrouper idea,
in packed rows). Segment ids carry a group and a branch
(:func:`rljax.models.attention.branch_ids`): a response sees its prompt and itself, never
another response, so every log-prob, the loss, the gradients and the metrics are the unshared
layout's to float rounding. Attention reads only the key blocks a query block can see
(:func:`key_block_lists`, :func:`rljax.models.attention.block_sparse_attention`), so a long
row costs what its groups' attention costs, not its length squared.

Which rows share a prompt is read where the rows lie: :func:`prompt_hash` (two 32-bit hashes
of the prompt's tokens) and the rows' spans are brought to the host, never the tokens; the
plan is :func:`rljax.trainer.packing.plan`'s with ``prompt_keys``. ``"auto"``
(:data:`AUTO_MIN_SAVED`) keeps the unshared layout when sharing saves little.

With the sequence split over ``sp`` the layout is the same and attention reads whole rows
under the same mask (every key block; correct, without the block savings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.attention import visible
from rljax.trainer import packing
from rljax.trainer.packing import PackConfig, bucket, plan


#: Column weights of :func:`prompt_hash` (two odd 32-bit multipliers per column, fixed).
_HASH_SEED = 0x5EED


def prompt_hash(xp, input_ids, attention_mask, prompt_len: int):
    """``[B, 2]`` uint32 keys of each row's prompt (columns ``0..prompt_len-1``, real tokens only):
    two weighted sums of ``token + 1`` with fixed odd 32-bit weights per column, modulo 2**32.
    Rows with the same prompt (same length, same tokens, hence same left padding) get the same
    keys; two different prompts of one length collide with probability about 2**-64. ``xp``: NumPy
    or ``jax.numpy`` (computed where the rows lie: :func:`host_prompt_keys`)."""
    rng = np.random.default_rng(_HASH_SEED)
    w = rng.integers(0, 2**31, size=(2, prompt_len), dtype=np.uint64) * 2 + 1
    ids = input_ids[:, :prompt_len].astype(xp.uint32) + xp.uint32(1)
    ids = xp.where(attention_mask[:, :prompt_len].astype(bool), ids, xp.uint32(0))
    return xp.stack([(ids * xp.asarray(w[i].astype(np.uint32))[None, :]).sum(axis=1, dtype=xp.uint32)
                          for i in range(2)], axis=1)


#: Tokens per block of a shared-prefix row's block-sparse attention (:func:`key_block_lists`).
SPARSE_BLOCK = 128


def block_visibility(segment_ids: np.ndarray, num_blocks: int) -> np.ndarray:
    """``[..., nq, nq]`` bool for rows of ``segment_ids [..., L]`` cut into ``num_blocks`` blocks of
    ``ceil(L / num_blocks)``: True where some query of block ``i`` may see some key of block
    ``j <= i`` (:func:`rljax.models.attention.visible`; padding, id 0, sees and is seen by none)."""
    lead, width = segment_ids.shape[:-1], segment_ids.shape[-1]
    block = -(-width // num_blocks)
    rows = segment_ids.reshape(-1, width)
    out = np.zeros((rows.shape[0], num_blocks, num_blocks), bool)
    causal = np.tril(np.ones((num_blocks, num_blocks), bool))
    for r, row in enumerate(rows):
        ids = np.unique(row[row > 0])
        if not ids.size:
            continue
        padded = np.zeros(num_blocks * block, row.dtype)
        padded[:width] = row
        member = (padded.reshape(num_blocks, block)[:, :, None] == ids).any(1).astype(np.int64)  # [nq, ids]
        sees = visible(ids[:, None], ids[None, :]).astype(np.int64)  # [query id, key id]
        out[r] = (member @ sees @ member.T > 0) & causal
    return out.reshape(lead + (num_blocks, num_blocks))


def key_block_lists(segment_ids: np.ndarray, *, block: Optional[int] = None) -> np.ndarray:
    """``key_blocks [..., nq, J]`` int32 for :func:`rljax.models.attention.block_sparse_attention`
    from packed rows' ``segment_ids [..., L]``: ``nq = ceil(L / block)`` (default
    :data:`SPARSE_BLOCK`), and for each query block
    the key blocks it may see (:func:`block_visibility`), then -1; ``J`` is the bucket
    (:func:`bucket`) of the most any query block needs (at most ``nq``)."""
    nq = max(1, -(-segment_ids.shape[-1] // (block or SPARSE_BLOCK)))
    vis = block_visibility(segment_ids, nq)
    j = min(bucket(int(vis.sum(-1).max(initial=1))), nq)
    order = np.argsort(~vis, axis=-1, kind="stable")[..., :j]
    return np.where(np.take_along_axis(vis, order, -1), order, -1).astype(np.int32)


def shared_config(cfg: PackConfig) -> PackConfig:
    """``cfg`` for the shared-prefix layout: a group's prompt and its responses must share a row, so
    a device's rows of a micro-batch become one row as long as all of them (``rows_per_device``
    rows of the token budget, or ``ceil(micro_batch_size / dp)`` rows); its attention reads only
    the blocks a query can see (:func:`key_block_lists`), so the long row costs no more than the
    short ones."""
    per = cfg.rows_per_device if cfg.use_dynamic_bsz else -(-cfg.micro_batch_size // cfg.dp)
    return dataclasses.replace(cfg, row_len=cfg.row_len * max(per, 1))


#: ``actor.shared_prefix=auto`` lays prompts once when that saves at least this fraction of the
#: pass's real tokens (the unshared layout's). GSM8K-like lengths (190-token prompts, 250-token
#: responses) save 32% at n=4, 38% at n=8; n=2 saves 22%; single samples or
#: mini-batches that split every group save nothing (see docs/benchmarks/shared-prefix.md).
AUTO_MIN_SAVED = 0.2


#: ``actor.shared_prefix`` as :func:`plan_layout` takes it.
MODES = {"on": True, "off": False, "auto": "auto"}


def mode_of(value: str):
    """``actor.shared_prefix`` (``on`` / ``off`` / ``auto``) as :func:`plan_layout`'s ``shared_prefix``."""
    if value not in MODES:
        raise ValueError(f"actor.shared_prefix={value!r}; accepted: {', '.join(MODES)}")
    return MODES[value]


def _considered(shared_prefix, cfg: PackConfig):
    """``"auto"`` considers sharing only with the sequence unsplit (``sp == 1``): over ``sp`` a shared
    row's attention reads every key block of a row ``rows_per_device`` times as long, not measured
    to pay; ``True`` (``on``) shares there too."""
    return False if shared_prefix == "auto" and cfg.sp > 1 else shared_prefix


def plan_layout(first, count, width: int, response_len: int, orders, *, mini_batch_size: int, cfg: PackConfig,
                shared_prefix, prompt_keys=None) -> tuple[dict, dict]:
    """:func:`plan` in the layout ``shared_prefix`` asks for: ``False`` unshared, ``True`` shared
    (``prompt_keys`` required, rows of :func:`shared_config`), ``"auto"`` shared when it saves at
    least :data:`AUTO_MIN_SAVED` of the real tokens (and ``sp == 1``). ``stats["shared_prefix"]``:
    the layout used."""
    if shared_prefix not in (True, False, "auto"):
        raise ValueError(f"shared_prefix={shared_prefix!r}; accepted: True, False, 'auto'")
    shared_prefix = _considered(shared_prefix, cfg)
    common = dict(mini_batch_size=mini_batch_size)
    if shared_prefix:
        if prompt_keys is None:
            raise ValueError("the shared-prefix layout needs prompt_keys (prompt_hash of the batch)")
        shared = shared_config(cfg)
        index, stats = plan(first, count, width, response_len, orders, cfg=shared, prompt_keys=prompt_keys, **common)
        if shared_prefix is True or stats["shared_saved_tokens"] >= AUTO_MIN_SAVED * stats["real_tokens"]:
            if cfg.sp == 1:
                index["key_blocks"] = key_block_lists(index["segment_ids"])
            return index, dict(stats, shared_prefix=True)
    index, stats = plan(first, count, width, response_len, orders, cfg=cfg, **common)
    return index, dict(stats, shared_prefix=False)


def pack(input_ids, attention_mask, positions, response_len: int, orders, *, mini_batch_size: int, cfg: PackConfig,
         shared_prefix=True) -> tuple[dict, dict]:
    """:func:`rljax.trainer.packing.pack` in the layout ``shared_prefix`` asks for (host NumPy)."""
    input_ids, attention_mask = np.asarray(input_ids), np.asarray(attention_mask)
    first, count = packing.row_spans(attention_mask)
    width = input_ids.shape[1]
    keys = prompt_hash(np, input_ids, attention_mask, width - response_len) if shared_prefix else None
    index, stats = plan_layout(first, count, width, response_len, orders, mini_batch_size=mini_batch_size, cfg=cfg,
                               shared_prefix=shared_prefix, prompt_keys=keys)
    return packing.take_rows(input_ids, positions, index), stats


def plan_batch(batch: dict, response_len: int, orders, mini_batch_size: int, pack_cfg,
               shared_prefix) -> tuple[dict, dict]:
    """The packing plan of a learner batch (:func:`plan_layout`) from its rows'
    spans and, for the shared-prefix layout, its prompts' keys (both read where the rows lie);
    the plan's statistics with ``padding_frac`` (of the processed token slots) and ``gathered_bytes``."""
    first, count, nbytes = host_spans(batch["attention_mask"])
    keys = None
    if _considered(shared_prefix, pack_cfg):
        keys, more = host_prompt_keys(batch["input_ids"], batch["attention_mask"],
                                      batch["input_ids"].shape[1] - response_len)
        nbytes += more
    index, stats = plan_layout(first, count, batch["input_ids"].shape[1], response_len, orders,
                               mini_batch_size=mini_batch_size, cfg=pack_cfg, shared_prefix=shared_prefix,
                               prompt_keys=keys)
    return index, dict(stats, padding_frac=1.0 - stats["laid_tokens"] / max(stats["packed_tokens"], 1),
                       gathered_bytes=nbytes)


def learner_layout(fn) -> dict:
    """The layout a learner pass (:class:`~rljax.trainer.step.PackedTrainStep`,
    :class:`~rljax.trainer.step.PackedLogprob`, :class:`~rljax.trainer.packing.AutoPacking` or a
    padded function) used on its last call: ``layout`` (``"padded"``, ``"packed"``,
    ``"shared_prefix"``, or ``"not run"`` before a packing pass's first call) and, packed, ``real_tokens`` (the unshared layout's), ``laid_tokens``,
    ``shared_saved_tokens`` and ``shared_saved_frac`` (of the real tokens; 0 unshared) and
    ``rows`` (the packed rows' shape ``[mini-batches, micro-batches, rows, row length]``)."""
    stats = getattr(fn, "stats", None)
    if stats is not None and not stats:
        return {"layout": "not run"}
    if "laid_tokens" not in (stats or {}):
        return {"layout": "padded"}
    shared = bool(stats.get("shared_prefix"))
    saved = int(stats.get("shared_saved_tokens", 0)) if shared else 0
    return {"layout": "shared_prefix" if shared else "packed", "real_tokens": int(stats["real_tokens"]),
            "laid_tokens": int(stats["laid_tokens"]), "shared_saved_tokens": saved,
            "shared_saved_frac": saved / max(int(stats["real_tokens"]), 1), "rows": list(stats["rows"])}


#: Per row of the learner batch's mask: first real column, real columns, last real column (on its devices).
_spans = jax.jit(functools.partial(packing.span_arrays, jnp))
_prompt_keys = jax.jit(functools.partial(prompt_hash, jnp), static_argnums=2)


def host_prompt_keys(input_ids, attention_mask, prompt_len: int) -> tuple[np.ndarray, int]:
    """``([B, 2] uint32 prompt keys, gathered bytes)``: :func:`prompt_hash` of every row, computed
    where the rows lie and brought to every process's host like :func:`host_spans` (no token
    leaves its device)."""
    keys = _prompt_keys(input_ids, attention_mask, prompt_len)
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(keys)), 0
    from jax.experimental import multihost_utils

    keys = np.asarray(multihost_utils.process_allgather(keys, tiled=True))
    return keys, int(keys.nbytes)


def host_spans(attention_mask) -> tuple[np.ndarray, np.ndarray, int]:
    """``(first, count, gathered bytes)``: every row's real-token span (:func:`rljax.trainer.packing.row_spans`)
    of the learner batch's mask, on the host of every process: computed where the rows lie and,
    with several processes, all-gathered as three ``[B]`` int32 arrays (the bytes this process
    received; 0 on one process). The packing plan needs nothing else: no token array leaves
    its devices for the host. A ``ValueError`` when a row's real tokens are not one span."""
    spans = _spans(attention_mask)
    if jax.process_count() == 1:
        first, count, last = (np.asarray(x) for x in jax.device_get(spans))
        nbytes = 0
    else:
        from jax.experimental import multihost_utils

        first, count, last = (np.asarray(x) for x in multihost_utils.process_allgather(spans, tiled=True))
        nbytes = int(first.nbytes + count.nbytes + last.nbytes)
    packing.check_spans(first, count, last)
    return first, count, nbytes
