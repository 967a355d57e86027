"""The trajectory batch the sampler returns (DESIGN.md, "Data contract").

``B = prompts x n (+ padding rows)``, ``S`` the padded prompt length, ``T`` the padded
response length (``decode.max_new_tokens``). Row ``b = prompt * n + session``.

Padding conventions: prompts are **left**-padded and responses **right**-padded, so
``concatenate([prompt_ids, response_ids], axis=1)`` is each trajectory's full sequence
with the prompt ending at column ``S`` and the response starting there. Padding ids are
``pad_id`` (the model's ``pad_token_id``, or 0); only the masks say what is real.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax
import numpy as np

from rljax.rollout.sampling import DecodeParams


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """Totals of one ``Sampler.generate`` call (host-side, hashable).

    ``timing_s/gen`` in verl's naming is ``wall_s``; ``prefill_s`` and ``decode_s`` split
    it (the remainder is host scheduling and result assembly); ``weight_sync_s`` is the
    time spent in ``update_weights`` while this call ran (e.g. from ``on_chunk``).
    """

    wall_s: float
    prefill_s: float
    decode_s: float
    weight_sync_s: float
    generated_tokens: int
    prefill_calls: int
    prefill_rows: int
    decode_chunks: int
    num_slots: int
    version_start: int
    version_end: int
    #: Live slots / the engine's slots averaged over this call's decode steps (None where the
    #: producer of the stats does not measure it).
    slot_occupancy: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        return d


@flax.struct.dataclass
class Trajectories:
    """One rollout batch: arrays (a pytree) plus host-side keys and decode parameters.

    Array fields (numpy, on the host; ``B`` rows):
      prompt_ids ``[B,S]`` int32, prompt_mask ``[B,S]`` bool: left-padded prompts.
      response_ids ``[B,T]`` int32: generated tokens, right-padded with ``pad_id``.
      response_mask ``[B,T]`` bool: 1 exactly on generated tokens (EOS included).
      loss_mask ``[B,T]`` bool: ``response_mask`` with padding rows zeroed.
      rollout_logp ``[B,T]`` float32: log-prob of each token under the sampling
        distribution (``rljax.rollout.sampling``); 0 where ``response_mask`` is 0.
      prompt_length, response_length ``[B]`` int32.
      truncated ``[B]`` bool: stopped by ``max_new_tokens`` rather than an EOS id.
      group_id ``[B]`` int32: the prompt's index in the call (dense, ``num_groups`` values).
      min_version, max_version ``[B]`` int32: weight versions the trajectory was
        generated with (its prefix's prefill included).
      token_version ``[B,T]`` int32: the weight version each response token was sampled with
        (token 0: its prompt's prefill; a weight install between decode chunks applies from
        the next token on); ``-1`` (``rljax.rollout.driver.NO_VERSION``) where no token was
        sampled: padding, padding rows, tool observations. ``min_version`` is its minimum
        over the row's sampled tokens.
      is_padding ``[B]`` bool: rows added by ``pad_to_multiple``; all their masks are 0.
      queue_s, prefill_s, decode_s ``[B]`` float32: seconds from the ``generate`` call
        to the row's insert into a slot, of its prompt's prefill call, and from insert
        to the host seeing it finished.

    Host fields (static in the pytree):
      uid, session, index: per-row trace keys (``trajectory_keys``); padding rows have
        uid ``""`` and session / index ``-1``.
      decode: the :class:`DecodeParams` used. stats: :class:`RolloutStats`.
      num_groups: number of prompts. pad_id: the padding id.

    Pass :meth:`arrays` (not the dataclass) into jitted code: the host fields change with
    every batch and would retrace.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    loss_mask: np.ndarray
    rollout_logp: np.ndarray
    prompt_length: np.ndarray
    response_length: np.ndarray
    truncated: np.ndarray
    group_id: np.ndarray
    min_version: np.ndarray
    max_version: np.ndarray
    is_padding: np.ndarray
    queue_s: np.ndarray
    prefill_s: np.ndarray
    decode_s: np.ndarray
    uid: tuple = flax.struct.field(pytree_node=False)
    session: tuple = flax.struct.field(pytree_node=False)
    index: tuple = flax.struct.field(pytree_node=False)
    decode: DecodeParams = flax.struct.field(pytree_node=False)
    stats: RolloutStats = flax.struct.field(pytree_node=False)
    num_groups: int = flax.struct.field(pytree_node=False)
    pad_id: int = flax.struct.field(pytree_node=False, default=0)
    token_version: np.ndarray = None  # [B,T] int32 (documented above; last: it was added after the host fields)

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def trajectory_keys(self) -> tuple[str, ...]:
        """``{uid}_{session}_{index}`` per row (the trace key)."""
        return tuple(f"{u}_{s}_{i}" for u, s, i in zip(self.uid, self.session, self.index))

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields that are set, as a dict (what a jitted train step should take; a
        trajectory built by hand may leave ``token_version`` unset)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("pytree_node", True) and getattr(self, f.name) is not None}

    def version_spans(self, row: int) -> Optional[list[list[int]]]:
        """Row ``row``'s ``token_version`` as spans ``[[first token index, version], ...]`` (a new span
        where the version changes; positions with no sampled token skipped): the trace's compact form
        (``None`` when ``token_version`` is unset)."""
        if self.token_version is None:
            return None
        tv = np.asarray(self.token_version[row])
        if tv.dtype.kind in "iu" and tv.shape[0] <= 64:  # a short row: one pass over its list (the trace
            spans, last = [], None  # reads a traced group's rows each step; numpy's calls cost more here)
            for i, v in enumerate(tv.tolist()):
                if v >= 0 and v != last:
                    spans.append([i, v])
                    last = v
            return spans
        idx = np.flatnonzero(tv >= 0)
        v = tv[idx]
        new = np.ones(len(idx), bool)
        new[1:] = v[1:] != v[:-1]
        return [[int(i), int(x)] for i, x in zip(idx[new], v[new])]

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [B,S+T], attention_mask [B,S+T])``: prompt and response concatenated."""
        ids = np.concatenate([self.prompt_ids, self.response_ids], axis=1)
        mask = np.concatenate([self.prompt_mask, self.response_mask], axis=1)
        return ids, mask
