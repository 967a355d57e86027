"""Sequence packing for the learner: packed rows, token-budget micro-batches, dp balancing.

The padded learner layout puts every trajectory in its own ``[S+T]`` row, so a batch whose
real lengths average a fifth of ``S+T`` spends four fifths of its FLOPs and memory on
padding. Here each trajectory's real tokens (prompt and response, padding dropped) are
laid end to end in rows of ``row_len`` tokens; ``segment_ids`` (1, 2, ... per row; 0 on
row padding) keep attention inside each trajectory, and the rotary positions are the
trajectory's own (they restart at 0 in every segment). The learner computes log-probs
on the packed rows and gathers them back to ``[B, T]`` with an index array, so the
losses, advantages, metrics and trace see exactly the padded layout's tensors.

Everything here is host-side NumPy (the traced pass over packed rows is
:func:`rljax.trainer.heads.packed_response_logprobs`). Shapes stay static: the number of
rows per micro-batch, of micro-batches per mini-batch and of trajectories per micro-batch
are rounded up to a small set of buckets (:func:`bucket`: 1, 2, 3, 4, 6, 8, 12, 16, ...), so a run compiles a handful of
programs, not one per batch.

Micro-batches (per mini-batch, after the epoch's shuffle, so the mini-batches are the
padded path's and the loss keeps the mini-batch's global token / sequence counts):

* fixed (``use_dynamic_bsz=False``): ``micro_batch_size`` consecutive trajectories, as
  in the padded path, packed first-fit-decreasing into rows;
* token budget (``use_dynamic_bsz=True``): the mini-batch's trajectories are packed
  first-fit-decreasing into rows and every micro-batch takes ``rows_per_micro`` rows
  (``dp`` x rows per device), i.e. a fixed number of tokens per device.

Both are micro-batch invariant: the gradient is a sum over micro-batches of losses
normalised by mini-batch counts, so how trajectories are grouped changes nothing but
float summation order.

dp balancing (``balance``): the rows of a micro-batch are split over ``dp`` shards
``R/dp`` rows each. Packed first-fit-decreasing, the first rows are the fullest; with
``balance`` the rows are dealt to shards greedily (largest row to the least-loaded shard
that still has room), so every shard holds about the same number of real tokens.
Trajectories never leave the ``[B, T]`` order seen by everything outside the update:
the permutation lives only in the gather indices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.attention import BRANCH_BITS, branch_ids
from rljax.sharding import mesh_batch_axes

#: Keys of a packed micro-batch's row arrays (``[R, L]`` each).
ROW_FIELDS = ("tokens", "positions", "segment_ids", "targets")
#: Row arrays only a shared-prefix plan has (``key_blocks [R, nq, J]``).
SHARED_ROW_FIELDS = ("key_blocks",)
#: Learner-batch fields that are the padded token layout (replaced by the packed rows).
TOKEN_FIELDS = ("input_ids", "attention_mask", "positions")


def bucket(n: int) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) ``>= n``."""
    n = max(int(n), 1)
    p = 1 << max(0, math.ceil(math.log2(n)) - 1)
    for c in (p, 3 * p // 2 if p >= 2 else p, 2 * p):
        if c >= n:
            return c
    return 2 * p


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``) of total length ``<= capacity``, first fit
    over the lengths in decreasing order (ties by index, so the result is deterministic)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > capacity:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a packed row of {capacity}")
    order = sorted(range(lengths.size), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for j, r in enumerate(room):
            if lengths[i] <= r:
                bins[j].append(i)
                room[j] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - int(lengths[i]))
    return bins


def balanced_assignment(loads: Sequence[int], parts: int) -> np.ndarray:
    """Assigns ``len(loads)`` items (a multiple of ``parts``) to ``parts`` equal-size groups
    with about equal total load: largest item first, to the least-loaded group with room
    (greedy LPT with a cardinality bound). Returns the group of each item."""
    loads = np.asarray(loads, np.int64)
    n = loads.size
    if n % parts:
        raise ValueError(f"{n} items do not split into {parts} equal groups")
    cap = n // parts
    group = np.zeros(n, np.int64)
    total = np.zeros(parts, np.int64)
    count = np.zeros(parts, np.int64)
    for i in sorted(range(n), key=lambda i: (-loads[i], i)):
        open_ = np.flatnonzero(count < cap)
        g = open_[np.argmin(total[open_])]
        group[i] = g
        total[g] += loads[i]
        count[g] += 1
    return group


def imbalance(shard_tokens) -> float:
    """``max / mean`` of per-shard token counts (1.0 is perfect balance; 1.0 for no tokens)."""
    shard_tokens = np.asarray(shard_tokens, np.float64)
    mean = shard_tokens.mean() if shard_tokens.size else 0.0
    return float(shard_tokens.max() / mean) if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Static packing parameters.

    Attributes:
      row_len: tokens per packed row (a multiple of ``sp``; at least the longest trajectory).
      dp: data-parallel shards (rows per micro-batch are a multiple of it).
      sp: sequence-parallel shards (``row_len`` must divide by it).
      micro_batch_size: trajectories per micro-batch (fixed mode).
      use_dynamic_bsz: micro-batches by token budget instead of by trajectory count.
      max_token_len_per_device: token budget per device per micro-batch (dynamic mode):
        each device holds ``rows_per_device * row_len / sp`` tokens, with
        ``rows_per_device = max_token_len_per_device * sp // row_len``.
      balance: deal a micro-batch's rows to dp shards by token count (see module doc).
    """

    row_len: int
    dp: int = 1
    sp: int = 1
    micro_batch_size: Optional[int] = None
    use_dynamic_bsz: bool = False
    max_token_len_per_device: Optional[int] = None
    balance: bool = False

    def __post_init__(self):
        if self.row_len < 1 or self.row_len % self.sp:
            raise ValueError(f"packing row_len={self.row_len} must be a positive multiple of sp={self.sp}")
        if self.use_dynamic_bsz:
            if not self.max_token_len_per_device:
                raise ValueError("use_dynamic_bsz needs max_token_len_per_device (tokens per device per micro-batch)")
            if self.max_token_len_per_device * self.sp < self.row_len:
                raise ValueError(
                    f"max_token_len_per_device={self.max_token_len_per_device} holds less than one packed row per "
                    f"device ({self.row_len} tokens / sp={self.sp} = {self.row_len // self.sp}); accepted: at least "
                    f"{self.row_len // self.sp} (max_prompt_length + max_response_length over sp)")
        elif not self.micro_batch_size:
            raise ValueError("fixed micro-batches need micro_batch_size (trajectories per micro-batch)")

    @property
    def rows_per_device(self) -> int:
        return max(1, self.max_token_len_per_device * self.sp // self.row_len)


def row_spans(attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a ``[B, S+T]`` learner mask, its real tokens as one span: ``(first column,
    count)`` ``[B]`` int32 (``(0, 0)`` for an empty row). The learner layout (left-padded prompt,
    then the response from column ``S``) always has one span; a ``ValueError`` otherwise."""
    first, count, last = span_arrays(np, np.asarray(attention_mask))
    check_spans(first, count, last)
    return first, count


def span_arrays(xp, attention_mask):
    """``(first, count, last)`` ``[B]`` int32 per row of a ``[B, W]`` mask: its first real column
    (0 for an empty row), its real columns and its last real column; ``xp``: NumPy on the host,
    ``jax.numpy`` where the rows lie (:func:`rljax.trainer.prefix.host_spans`)."""
    mask = attention_mask.astype(bool)
    count = mask.sum(axis=1).astype(xp.int32)
    first = xp.where(count > 0, xp.argmax(mask, axis=1), 0).astype(xp.int32)
    last = (mask.shape[1] - 1 - xp.argmax(mask[:, ::-1], axis=1)).astype(xp.int32)
    return first, count, last


def check_spans(first, count, last) -> None:
    """A ``ValueError`` naming the first row whose real tokens (``first``..``last`` column,
    ``count`` of them) are not one span."""
    first, count, last = (np.asarray(x, np.int64) for x in (first, count, last))
    gaps = np.flatnonzero((count > 0) & (last - first + 1 != count))
    if gaps.size:
        raise ValueError(f"row {int(gaps[0])} of the learner batch has gaps in its attention mask ({gaps.size} row(s)): "
                         "packing needs each row's real tokens in one span (left-padded prompt, right-padded response)")


class _Units:
    """How a pass's trajectories are laid: a *unit* is a tuple of trajectory ids laid together in
    one row. Unshared, every trajectory is its own unit, packed first-fit-decreasing. Shared
    (``prompt_keys``), the members of a micro-batch with equal prompts form units: the prompt laid
    once, less its last token, then each member's last prompt token and response (a branch;
    :func:`plan`). Rows are filled in turn, group after group; a group that does not fit the rest
    of a row continues in the next one, laying its prompt again (groups are large next to a row:
    a whole-group unit would leave rows part empty)."""

    def __init__(self, first, lengths, prompt_len, row_len: int, prompt_keys=None):
        self.lengths, self.row_len = lengths, row_len
        self.shared = prompt_keys is not None
        # tokens of a row's prompt a unit lays once: all but the last (which starts each branch)
        self.keep = np.maximum(prompt_len - 1, 0) if self.shared else np.zeros_like(lengths)
        self.keys = None if prompt_keys is None else [(int(p),) + tuple(int(x) for x in k)
                                                      for p, k in zip(prompt_len, np.asarray(prompt_keys))]

    def length(self, unit) -> int:
        keep = int(self.keep[unit[0]])
        return keep + sum(int(self.lengths[t]) - keep for t in unit)

    def rows(self, members) -> list[list[tuple]]:
        """``members``' units laid in rows of ``row_len``."""
        members = [int(t) for t in members]
        if not self.shared:
            bins = first_fit_decreasing(self.lengths[members], self.row_len)
            return [[(members[i],) for i in r] for r in bins]
        if members and max(self.lengths[members]) > self.row_len:
            raise ValueError(f"a sequence of {int(max(self.lengths[members]))} tokens does not fit a packed row of "
                             f"{self.row_len}")
        groups: dict = {}
        for t in members:  # equal prompts (length and token hashes), in order of first appearance
            groups.setdefault(self.keys[t] if self.keep[t] > 0 else ("alone", t), []).append(t)
        rows, row, room = [], [], self.row_len
        for ts in groups.values():
            unit: list = []
            for t in ts:
                keep = int(self.keep[t])
                need = int(self.lengths[t]) - (keep if unit else 0)
                if need > room:  # the group continues in a new row, its prompt laid again
                    if unit:
                        row.append(tuple(unit))
                    rows.append(row)
                    row, unit, room, need = [], [], self.row_len, int(self.lengths[t])
                unit.append(t)
                room -= need
            row.append(tuple(unit))
        return [r for r in rows + [row] if r]


def _micro_batches(members: np.ndarray, units: _Units, cfg: PackConfig) -> list[list[list[tuple]]]:
    """A mini-batch's trajectories -> micro-batches, each a list of rows (lists of units)."""
    if cfg.use_dynamic_bsz:
        rows = units.rows(members)
        per = cfg.dp * cfg.rows_per_device
        return [rows[i:i + per] for i in range(0, len(rows), per)]
    return [units.rows(members[i:i + cfg.micro_batch_size]) for i in range(0, members.size, cfg.micro_batch_size)]


def _order_rows(rows: list[list[tuple]], units: _Units, num_rows: int, cfg: PackConfig) -> list[list[tuple]]:
    """Pads ``rows`` with empty rows to ``num_rows`` and orders them so that row ``i`` lands
    on dp shard ``i // (num_rows / dp)``; with ``balance`` shards get about equal tokens."""
    rows = rows + [[] for _ in range(num_rows - len(rows))]
    if not cfg.balance or cfg.dp == 1:
        return rows
    loads = [sum(units.length(u) for u in r) for r in rows]
    group = balanced_assignment(loads, cfg.dp)
    return [rows[i] for g in range(cfg.dp) for i in np.flatnonzero(group == g)]


def plan(first: np.ndarray, count: np.ndarray, width: int, response_len: int, orders: Sequence[np.ndarray], *,
         mini_batch_size: int, cfg: PackConfig, shape: Optional[tuple[int, int, int]] = None,
         prompt_keys: Optional[np.ndarray] = None) -> tuple[dict, dict]:
    """The packing of a ``[B, width]`` learner batch from its rows' spans alone (:func:`row_spans`;
    no token is read, so several processes plan from all-gathered ``[B]`` spans). Returns
    ``(index, stats)``: ``source [M, U, R, L]`` int32 (the flat index into the ``[B * width]``
    batch of each packed slot's token, -1: empty), ``segment_ids``, ``traj_index`` and ``gather``
    (see :func:`pack`), and :func:`pack`'s ``stats``; :func:`take_rows` (host) or
    :func:`take_rows_on_mesh` (devices) turn ``source`` into ``tokens``, ``positions``, ``targets``.

    ``prompt_keys [B, k]`` (:func:`rljax.trainer.prefix.prompt_hash`): the shared-prefix layout. Members of a
    micro-batch whose prompts have the same length and keys are laid as one unit: the prompt
    but its last token once (segment id :func:`~rljax.models.attention.branch_ids` ``(g, 0)``),
    then per member its last prompt token and its response (``(g, k)``), each at the positions
    of its own padded row, which continue from the prompt. Every response token is predicted
    by the same tokens at the same positions as unshared, so the numbers are the unshared
    layout's to float rounding (:mod:`rljax.trainer.prefix` adds the attention's key-block lists).
    Stats: ``laid_tokens`` (tokens the rows hold), and shared, ``shared_saved_tokens``
    (``real_tokens - laid_tokens``) and ``shared_units`` (units of two members or more)."""
    first = np.asarray(first, np.int64)
    lengths = np.asarray(count, np.int64)
    b = lengths.size
    s = width - response_len
    if s < 1:
        raise ValueError(f"response_len={response_len} leaves no prompt column in a row of {width}")
    if b % mini_batch_size:
        raise ValueError(f"batch of {b} trajectories does not divide into mini-batches of {mini_batch_size}")
    units = _Units(first, lengths, np.clip(s - first, 0, lengths), cfg.row_len, prompt_keys)

    mini = []  # per mini-batch: list of micro-batches (lists of rows of units)
    for order in orders:
        order = np.asarray(order)
        if sorted(order.tolist()) != list(range(b)):
            raise ValueError(f"each order must be a permutation of range({b})")
        for m in range(0, b, mini_batch_size):
            mini.append(_micro_batches(order[m:m + mini_batch_size], units, cfg))
    u, r_rows, bm = _shape(mini, cfg, mini_batch_size, shape)
    big_m, el = len(mini), cfg.row_len
    index = {"source": np.full((big_m, u, r_rows, el), -1, np.int32),
             "segment_ids": np.zeros((big_m, u, r_rows, el), np.int32),
             "traj_index": np.full((big_m, u, bm), b, np.int32),
             "gather": np.zeros((big_m, u, bm, response_len), np.int32)}
    ratios, laid, joint = _lay_all(index, mini, units, first, r_rows, width, s, cfg)
    real = int(lengths.sum()) * len(orders)
    stats = {
        "real_tokens": real,
        "laid_tokens": laid,
        "packed_tokens": int(big_m * u * r_rows * el),
        "padded_tokens": int(len(orders) * b * width),
        "dp_token_imbalance": float(np.mean(ratios)),
        "shape": (u, r_rows, bm),
        "rows": (big_m, u, r_rows, el),
    }
    if units.shared:
        stats.update(shared_saved_tokens=real - laid, shared_units=joint)
    return index, stats


def _lay_all(index: dict, mini: list, units: _Units, first, r_rows: int, width: int, s: int,
             cfg: PackConfig) -> tuple[list[float], int, int]:
    """Lays every micro-batch of ``mini`` into ``index``; returns the per-micro-batch dp token
    imbalances, the tokens laid and the number of units of two members or more."""
    ratios, laid, joint = [], 0, 0
    for mi, micro_batches in enumerate(mini):
        for ui, rows in enumerate(micro_batches):
            rows = _order_rows(rows, units, r_rows, cfg)
            slot = 0
            shard = np.zeros(cfg.dp, np.int64)
            for ri, row in enumerate(rows):
                off = 0
                for seg, unit in enumerate(row, start=1):
                    off, slot = _lay(index, (mi, ui, ri), seg, unit, units, first, off, slot, width, s, cfg.row_len)
                    joint += len(unit) > 1
                shard[ri // (r_rows // cfg.dp)] += off
                laid += off
            ratios.append(imbalance(shard))
    return ratios, laid, joint


def _lay(index: dict, at: tuple, seg: int, unit: tuple, units: _Units, first, off: int, slot: int, width: int,
         s: int, el: int) -> tuple[int, int]:
    """Lays ``unit`` in row ``at = (mi, ui, ri)`` from column ``off`` as segment ``seg``; returns the
    next free column and micro-batch slot. Unshared, a trajectory's span is one segment id ``seg``;
    shared, its kept prompt is branch 0 of group ``seg`` and each member a branch after it."""
    mi, ui, ri = at
    source, segment_ids = index["source"][at], index["segment_ids"][at]
    keep = int(units.keep[unit[0]])
    if seg >= 1 << (31 - BRANCH_BITS) or len(unit) >= 1 << BRANCH_BITS:
        raise ValueError(f"a packed row of {seg} segments or a unit of {len(unit)} members exceeds the segment ids")
    prompt_at = np.arange(0)
    if units.shared:  # the shared prompt, less its last token, from the unit's first member
        c0 = int(first[unit[0]])
        source[off:off + keep] = unit[0] * width + c0 + np.arange(keep)
        segment_ids[off:off + keep] = branch_ids(seg, 0)
        prompt_at = ri * el + off + np.arange(keep)
        off += keep
    for k, t in enumerate(unit, start=1):
        c0 = int(first[t]) + keep
        n = int(units.lengths[t]) - keep
        source[off:off + n] = t * width + c0 + np.arange(n)
        segment_ids[off:off + n] = branch_ids(seg, k) if units.shared else seg
        # response token j is predicted at padded column s-1+j
        where = np.full(width, -1, np.int64)
        where[c0 - keep:c0] = prompt_at
        where[c0:c0 + n] = ri * el + off + np.arange(n)
        index["traj_index"][mi, ui, slot] = t
        index["gather"][mi, ui, slot] = np.maximum(where[s - 1: s - 1 + index["gather"].shape[-1]], 0)
        slot += 1
        off += n
    return off, slot


def _shape(mini: list, cfg: PackConfig, mini_batch_size: int, shape) -> tuple[int, int, int]:
    """``(U, R, Bm)`` of a plan's mini-batches: the buckets of what they need, or ``shape``."""
    need_u = max(len(mb) for mb in mini)
    need_r = max(len(rows) for mb in mini for rows in mb)
    need_b = max(sum(len(unit) for r in rows for unit in r) for mb in mini for rows in mb)
    if shape is not None:
        if shape[0] < need_u or shape[1] < need_r or shape[1] % cfg.dp or shape[2] < need_b:
            raise ValueError(f"packing shape {shape} is smaller than this batch needs ({need_u}, {need_r}, {need_b}) "
                             f"or its rows do not divide by dp={cfg.dp}")
        return tuple(shape)
    per = cfg.dp * cfg.rows_per_device if cfg.use_dynamic_bsz else None
    return bucket(need_u), per if per else cfg.dp * bucket(-(-need_r // cfg.dp)), min(bucket(need_b), mini_batch_size)


def _take(xp, input_ids, positions, source):
    """``tokens, positions, targets`` of the packed slots ``source`` (flat indices into the
    ``[B, W]`` batch, -1 empty): the token, its position, and the next column's token (0 past a
    row's last column), as the padded layout has them; 0 on empty slots."""
    width = input_ids.shape[1]
    live = source >= 0
    src = xp.where(live, source, 0)
    ids, pos = input_ids.reshape(-1), positions.reshape(-1)
    nxt = live & (src % width != width - 1)
    return {"tokens": xp.where(live, xp.take(ids, src), 0).astype(xp.int32),
            "positions": xp.where(live, xp.take(pos, src), 0).astype(xp.int32),
            "targets": xp.where(nxt, xp.take(ids, xp.where(nxt, src + 1, 0)), 0).astype(xp.int32)}


def take_rows(input_ids: np.ndarray, positions: np.ndarray, index: dict) -> dict:
    """The packed arrays (:func:`pack`'s) of a :func:`plan` from host token arrays."""
    rows = _take(np, np.asarray(input_ids), np.asarray(positions), index["source"])
    return {**rows, **{k: v for k, v in index.items() if k != "source"}}


@functools.partial(jax.jit, static_argnames=("out_sharding",))
def _take_on_mesh(input_ids, positions, source, out_sharding=None):
    rows = _take(jnp, input_ids, positions, source)
    if out_sharding is not None:
        rows = {k: jax.lax.with_sharding_constraint(v, out_sharding) for k, v in rows.items()}
    return rows


def take_rows_on_mesh(input_ids: jax.Array, positions: jax.Array, index: dict, mesh) -> dict:
    """The packed arrays of a :func:`plan` as global arrays on ``mesh`` (:func:`place_packed`'s
    layout), the tokens taken on the devices from the learner batch where it lies: no host,
    and no process, holds the batch's tokens; only the index arrays travel from the host."""
    placed = place_packed(index, mesh)
    sharding = None if mesh is None else placed["segment_ids"].sharding
    rows = _take_on_mesh(input_ids, positions, placed.pop("source"), out_sharding=sharding)
    return {**rows, **placed}


def pack(input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray, response_len: int,
         orders: Sequence[np.ndarray], *, mini_batch_size: int, cfg: PackConfig,
         shape: Optional[tuple[int, int, int]] = None) -> tuple[dict, dict]:
    """Packs a padded learner batch into micro-batches of rows (host NumPy: :func:`plan` from
    the rows' spans, then :func:`take_rows`).

    Args:
      input_ids, attention_mask, positions: ``[B, S+T]`` host arrays of the padded learner
        batch (left-padded prompt then right-padded response; see
        :mod:`rljax.trainer.step`).
      response_len: ``T``; hidden state at column ``S-1+t`` predicts response token ``t``.
      orders: one permutation of ``range(B)`` per pass (epoch); each is cut into
        consecutive mini-batches of ``mini_batch_size`` (as the padded update does).
      cfg: :class:`PackConfig`.
      shape: force ``(micro-batches per mini-batch U, rows per micro-batch R,
        trajectories per micro-batch Bm)`` (each at least what the batch needs) instead of
        the buckets of the needed sizes, e.g. to share one compiled program between calls.

    Returns:
      ``(arrays, stats)``. ``arrays``: ``tokens, positions, segment_ids, targets``
      ``[M, U, R, L]`` int32 (``M`` = passes x mini-batches), ``traj_index [M, U, Bm]``
      (row of the ``[B, T]`` batch, or ``B`` for an empty slot) and ``gather [M, U, Bm, T]``
      (flat index into the micro-batch's ``R*L`` packed positions of the hidden state that
      predicts each response token; 0 where the padded column is not a real token).
      ``stats``: ``real_tokens``, ``packed_tokens`` (``M*U*R*L``), ``padded_tokens``
      (``passes*B*(S+T)``), ``dp_token_imbalance`` (mean over micro-batches of max/mean
      shard tokens) and ``shape`` ``(U, R, Bm)``.
    """
    input_ids = np.asarray(input_ids)
    first, count = row_spans(attention_mask)
    index, stats = plan(first, count, input_ids.shape[1], response_len, orders, mini_batch_size=mini_batch_size,
                        cfg=cfg, shape=shape)
    return take_rows(input_ids, positions, index), stats


def epoch_orders(key: jax.Array, batch_size: int, epochs: int, shuffle: bool = True) -> list[np.ndarray]:
    """The per-epoch trajectory orders the padded update uses for ``key`` (same bits):
    a permutation per epoch, or the batch order when ``shuffle`` is off."""
    if not shuffle:
        return [np.arange(batch_size) for _ in range(epochs)]
    return [np.asarray(jax.random.permutation(k, batch_size)) for k in jax.random.split(key, epochs)]


def pack_logprob_batch(input_ids, attention_mask, positions, response_len: int, *, cfg: PackConfig,
                       shape=None) -> tuple[dict, dict]:
    """Packing for a log-prob pass over the whole batch in its own order: ``[1, U, R, L]``
    rows (one "mini-batch"), ``gather`` indices into the flat ``U*R*L`` positions."""
    b = np.asarray(input_ids).shape[0]
    arrays, stats = pack(input_ids, attention_mask, positions, response_len, [np.arange(b)],
                         mini_batch_size=b, cfg=cfg, shape=shape)
    return arrays, stats


# --------------------------------------------------------------------------- traced


def place_packed(arrays: dict, mesh) -> dict:
    """Packed arrays -> global arrays on ``mesh``: rows ``[..., R, L]`` (and :func:`plan`'s
    ``source``) with ``R`` on ``dp`` x ``fsdp`` and ``L`` on ``sp``; index arrays replicated (they are small)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if mesh is None:
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    out = {}
    for k, v in arrays.items():
        lead = (None,) * (v.ndim - 2)
        spec = PartitionSpec(*lead, mesh_batch_axes(mesh) or None, "sp") if k in ROW_FIELDS or k == "source" \
            else PartitionSpec()
        if k == "key_blocks":  # [..., R, nq, J]: rows on the batch axes, like the rows they index
            spec = PartitionSpec(*(None,) * (v.ndim - 3), mesh_batch_axes(mesh) or None)
        sharding = NamedSharding(mesh, spec)
        out[k] = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
    return out


def pack_configs(cfg, *, dp: int, sp: int, row_len: int, micro_batch_size: int) -> tuple[PackConfig, PackConfig]:
    """``(update, log-prob)`` :class:`PackConfig` from a run configuration (``actor.*``,
    ``trainer.balance_batch``). ``row_len``: the learner's ``S + T`` (every trajectory fits
    one row). Without a token budget a device holds the padded micro-batch's tokens
    (``ceil(micro_batch_size / dp)`` rows of ``row_len / sp``): the packed passes never hold
    more activations than the padded ones, and need fewer, fuller micro-batches."""
    a = cfg.actor
    one_row = row_len // sp
    budget = a.ppo_max_token_len_per_device or -(-micro_batch_size // dp) * one_row
    update = PackConfig(row_len=row_len, dp=dp, sp=sp, micro_batch_size=micro_batch_size,
                        use_dynamic_bsz=a.use_dynamic_bsz, max_token_len_per_device=budget,
                        balance=cfg.trainer.balance_batch)
    logprob = PackConfig(row_len=row_len, dp=dp, sp=sp, micro_batch_size=micro_batch_size,
                         use_dynamic_bsz=a.log_prob_use_dynamic_bsz,
                         max_token_len_per_device=a.log_prob_max_token_len_per_device or budget,
                         balance=cfg.trainer.balance_batch)
    return update, logprob


#: ``actor.use_remove_padding=auto`` packs a batch when its real tokens fill at most this
#: fraction of the padded ``[B, S+T]`` layout, i.e. a packed row holds two trajectories or
#: more on average. Measured (README, bench/throughput.py): the embedded task fills 0.73
#: (a trajectory per row whether packed or not; packed is slower by its host-side packing
#: and gathers), GSM8K-like lengths fill ~0.17 and agent-like ~0.46 (packed 2-4x faster).
AUTO_MAX_FILL = 0.5


class AutoPacking:
    """``actor.use_remove_padding=auto``: per call, the packed or the padded version of a
    learner pass, chosen from the batch's lengths.

    ``padded`` and ``packed`` take the same arguments, ``(state_or_params, fields, *rest)``
    with ``fields["attention_mask"] [B, S+T]``; the packed one is used when the mask's mean
    (the fraction of the padded layout that is real tokens) is at most ``max_fill``. Both
    give the same numbers to float tolerance (tests/trainer/test_trainer_packing.py), so the choice
    only moves time; it is a pure function of the batch, so a resumed run chooses the same.
    ``last_packed`` / ``fill`` describe the last call; ``compiles`` counts the programs of
    both (a padded program once per batch width used: ``data.trim_prompt_padding`` varies it).
    """

    def __init__(self, padded, packed, *, max_fill: float = AUTO_MAX_FILL):
        if not 0.0 <= max_fill <= 1.0:
            raise ValueError(f"max_fill={max_fill} must be in [0, 1] (a fraction of the padded layout)")
        self.padded, self.packed, self.max_fill = padded, packed, max_fill
        self.last_packed: Optional[bool] = None
        self.fill: Optional[float] = None
        self._padded_widths: set = set()

    def choose(self, fields: dict):
        self.fill = float(jnp.mean(jnp.asarray(fields["attention_mask"], jnp.float32)))
        self.last_packed = self.fill <= self.max_fill
        if not self.last_packed:
            self._padded_widths.add(tuple(fields["attention_mask"].shape))
        return self.packed if self.last_packed else self.padded

    @property
    def stats(self) -> dict:
        """The packed pass's statistics after a packed call; after a padded one its padding."""
        if self.last_packed:
            return getattr(self.packed, "stats", {})
        return {} if self.fill is None else {"padding_frac": 1.0 - self.fill}

    @property
    def compiles(self) -> int:
        return getattr(self.packed, "compiles", 0) + len(self._padded_widths)

    def __call__(self, first, fields: dict, *rest):
        return self.choose(fields)(first, fields, *rest)

    def lower(self, first, fields: dict, *rest):
        """Lowers the version the last call ran (choosing reads the batch: with several
        processes a collective, and the ledgers lower on the main process only)."""
        if self.last_packed is None:
            return self.choose(fields).lower(first, fields, *rest)
        return (self.packed if self.last_packed else self.padded).lower(first, fields, *rest)
