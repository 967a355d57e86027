"""Streaming admission: one :class:`~rljax.rollout.driver.Driver` kept across many batches.

``Sampler.generate`` serves one batch per call: the call returns when the batch's longest
trajectory ends, and the slots its tail frees stay empty until the next call. A
:class:`RolloutStream` keeps the driver (its slots, decode state and weights) for the
whole run: the client :meth:`~RolloutStream.submit` s batches of prompts whenever it likes,
a slot freed by one batch's tail takes the next queued prompt at once, also one of a later
batch, and :meth:`~RolloutStream.step` returns each batch, as :class:`Trajectories`, when
every session of it finished, in submission order (a later batch that ends first waits
for the earlier ones, so a consumer sees batches in data order)::

    stream = sampler.stream(decode, n=8, admit=lambda batch: ok_to_start(batch.key))
    stream.submit(0, prompts_0, uids_0)
    stream.submit(1, prompts_1, uids_1)               # its prompts start as batch 0's tail frees slots
    while stream.busy:
        for batch, traj in stream.step():             # one driver round; complete batches
            ...

This is what verl's fully-async rollouter and AReaL's asynchronous rollout call streaming
or continuous rollout across batch boundaries. ``admit(batch)`` is asked before each
prompt at the head of the queue is prefilled (the driver's ``admit`` gate): the
asynchronous trainer's staleness gate (:mod:`rljax.trainer.async_loop`) answers whether
the batch can still be trained within ``async_training.max_staleness``. A refused prompt
and everything behind it stay queued; the client may install new weights between rounds
(the sampler's ``update_weights``), which apply to every slot from the next round on.

Tokens: session ``s`` of a prompt with uid ``u`` samples from ``(decode.seed, u, s)``
(:func:`~rljax.rollout.sampling.trajectory_keys`), exactly as in ``generate``: the same
prompts and weights give the same tokens however batches overlap.

Groups: a batch's ``groups_done`` lists each prompt once all its sessions finished (in the order
they did), and :meth:`~RolloutStream.take` gives those groups' trajectories before the batch is
complete: dynamic sampling in the asynchronous producer scores each group as it completes.

Per batch (its :class:`~rljax.rollout.trajectory.RolloutStats`): ``wall_s`` runs from its
first admission to its last finished session; ``prefill_s``, ``decode_s``, the prefill
counts and ``slot_occupancy`` are the driver's over that window (windows of overlapping
batches overlap, so they do not add up across batches).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from rljax.rollout.driver import Request, Session, results_for
from rljax.rollout.sampling import DecodeParams, trajectory_keys
from rljax.rollout.trajectory import RolloutStats, Trajectories

#: The engine's counters a batch's window reads (``engine.stats``).
ENGINE_COUNTS = ("prefill_calls", "prefill_rows", "prefill_tokens", "extend_calls", "extended_tokens")


@dataclasses.dataclass(eq=False)
class StreamBatch:
    """One submitted batch, as the stream tracks it (the client reads, never writes)."""

    key: Any  # the client's (e.g. the producer's batch index)
    prompts: list
    uids: list
    sessions: list = dataclasses.field(default_factory=list, repr=False)  # row order: prompt * n + session
    results: Any = None
    admitted: int = 0  # prompts admitted (prefilled) so far
    finished: int = 0  # sessions finished
    t_submit: float = 0.0
    t_first: Optional[float] = None  # first admission
    marks: Optional[dict] = None  # the driver's counters at the first admission
    #: When it was returned: prompts of later batches admitted by then (in flight or finished).
    admitted_ahead: int = 0
    #: Per prompt (group), its sessions finished; and the prompts whose every session finished,
    #: in the order they completed (a client may score whole groups before the batch completes).
    group_finished: list = dataclasses.field(default_factory=list, repr=False)
    groups_done: list = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finished == len(self.sessions)

    @property
    def in_flight(self) -> bool:
        """Some prompt admitted, some session not finished."""
        return self.admitted > 0 and not self.done


class RolloutStream:
    """See the module docstring. Build it with :meth:`rljax.rollout.Sampler.stream`.

    Args:
      sampler: the :class:`~rljax.rollout.Sampler` (engine, weights, driver settings).
      decode: the decode parameters of every batch.
      n: sessions per prompt.
      admit: ``admit(batch: StreamBatch) -> bool``, asked before a prompt of ``batch`` at the
        head of the queue is prefilled. Default: admit all.
      pad_to_multiple: padding rows so each batch's ``B`` divides this.
    """

    def __init__(self, sampler, decode, *, n: int, admit: Callable[[StreamBatch], bool] | None = None,
                 pad_to_multiple: int = 1):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n is {n!r}; accepted: an integer >= 1 (samples per prompt)")
        self.sampler, self.n, self.pad_to_multiple = sampler, int(n), int(pad_to_multiple)
        self.decode = DecodeParams() if decode is None else decode
        sampler.engine.check_decode(self.decode)
        self._admit_fn = admit
        self.driver = sampler.driver(self.decode, admit=self._admit)
        self._batches: list[StreamBatch] = []  # submitted, not yet returned (submission order)

    # ----------------------------------------------------------------- client calls

    def submit(self, key, prompts, uids) -> StreamBatch:
        """Queues a batch of prompts (each with its ``n`` sessions) behind those already queued.
        Raises the ``ValueError`` s of ``Sampler.generate`` before anything is queued."""
        prompts, uids, _ = self.sampler.check_batch(prompts, uids, self.n, self.decode, self.pad_to_multiple)
        n, total = self.n, len(prompts) * self.n
        batch = StreamBatch(key=key, prompts=prompts, uids=uids, t_submit=time.perf_counter(),
                            results=results_for(self.sampler.engine, total, self.decode.max_new_tokens))
        keys = trajectory_keys(self.decode.seed, [uids[i // n] for i in range(total)], [i % n for i in range(total)])
        for i, p in enumerate(prompts):
            batch.sessions += self.driver.submit(Request(p, keys=keys[i * n:(i + 1) * n], results=batch.results,
                                                         rows=range(i * n, (i + 1) * n), tag=batch))
        self._batches.append(batch)
        return batch

    @property
    def busy(self) -> bool:
        """Whether a round has work (a prompt queued or a session decoding)."""
        return self.driver.busy

    @property
    def active(self) -> bool:
        """Whether a round would do work without admitting a queued prompt (a session decoding);
        ``False`` while ``busy``: every queued prompt is refused by ``admit``."""
        return self.driver.in_progress

    @property
    def batches(self) -> tuple[StreamBatch, ...]:
        """The batches submitted and not yet returned, in submission order."""
        return tuple(self._batches)

    # ----------------------------------------------------------------- the round

    def _marks(self) -> dict:
        d, stats = self.driver, self.sampler.engine.stats
        return {"prefill_s": d.prefill_s, "decode_s": d.decode_s, "chunks": d.chunks, "live": d.live_slot_steps,
                "slot_steps": d.slot_steps, "sync_s": self.sampler.total_weight_sync_s,
                **{k: stats.get(k, 0) for k in ENGINE_COUNTS}, "version": self.driver.version}

    def _admit(self, request: Request) -> bool:
        batch = request.tag
        if self._admit_fn is not None and not self._admit_fn(batch):
            return False
        if batch.t_first is None:
            batch.t_first, batch.marks = time.perf_counter(), self._marks()
        batch.admitted += 1
        return True

    def step(self) -> list[tuple[StreamBatch, Trajectories]]:
        """One driver round; the batches it completed, in submission order, as trajectories (a
        batch complete before an earlier one is returned after it)."""
        for ev in self.driver.step():
            if ev.kind == "finished":
                self._finished(ev.session)
        return self._completed()

    def _finished(self, session: Session) -> None:
        batch, g = session.request.tag, session.row // self.n
        batch.finished += 1
        if not batch.group_finished:
            batch.group_finished = [0] * len(batch.prompts)
        batch.group_finished[g] += 1
        if batch.group_finished[g] == self.n:
            batch.groups_done.append(g)

    def take(self, batch: StreamBatch, groups) -> Trajectories:
        """The trajectories of ``groups`` (prompt indices of ``batch``, each of whose sessions
        finished: :attr:`StreamBatch.groups_done`), in that order, group ids ``0..``, before the batch
        is complete (e.g. to score whole groups as they complete). Their stats are empty."""
        groups = [int(g) for g in groups]
        rows = np.array([g * self.n + s for g in groups for s in range(self.n)], np.int64)
        sessions = [batch.sessions[r] for r in rows]
        if any(s.status != "finished" for s in sessions):
            raise ValueError(f"take: a session of groups {groups} of batch {batch.key!r} has not finished")
        tokens, logp = batch.results.fetch()
        return self.sampler.assemble(
            [batch.prompts[g] for g in groups], self.n, [batch.uids[g] for g in groups], self.decode, tokens[rows],
            logp[rows], np.array([s.length for s in sessions], np.int32),
            np.array([s.min_version for s in sessions], np.int64), np.array([s.max_version for s in sessions], np.int64),
            np.zeros(len(rows), np.float32), np.zeros(len(rows), np.float32), np.zeros(len(rows), np.float32),
            empty_stats(self.sampler.engine.num_slots), 1, token_version=batch.results.versions[rows])

    def close(self) -> None:
        """Releases what the stream holds beside the driver (nothing here; a client's threads in subclasses)."""

    def _completed(self) -> list[tuple[StreamBatch, Trajectories]]:
        """The batches at the head whose sessions all finished, assembled, in submission order."""
        out = []
        while self._batches and self._batches[0].done:
            batch = self._batches.pop(0)
            batch.admitted_ahead = sum(b.admitted for b in self._batches)
            out.append((batch, self._assemble(batch)))
        return out

    def _assemble(self, batch: StreamBatch) -> Trajectories:
        sessions: list[Session] = batch.sessions
        t0 = batch.t_submit
        length = np.array([s.length for s in sessions], np.int32)
        min_version = np.array([s.min_version for s in sessions], np.int64)
        max_version = np.array([s.max_version for s in sessions], np.int64)
        queue_s = np.array([s.inserted_at - t0 for s in sessions], np.float32)
        prefill_s = np.array([s.prefill_s for s in sessions], np.float32)
        decode_s = np.array([s.finished_at - s.inserted_at for s in sessions], np.float32)
        tokens, logp = batch.results.fetch()
        token_version = batch.results.versions
        batch.results = None
        m0, m1 = batch.marks, self._marks()
        slot_steps = m1["slot_steps"] - m0["slot_steps"]
        stats = RolloutStats(
            wall_s=max(s.finished_at for s in sessions) - batch.t_first,
            prefill_s=m1["prefill_s"] - m0["prefill_s"], decode_s=m1["decode_s"] - m0["decode_s"],
            weight_sync_s=m1["sync_s"] - m0["sync_s"], generated_tokens=int(length.sum()),
            prefill_calls=m1["prefill_calls"] - m0["prefill_calls"], prefill_rows=m1["prefill_rows"] - m0["prefill_rows"],
            decode_chunks=m1["chunks"] - m0["chunks"], num_slots=self.sampler.engine.num_slots,
            version_start=int(m0["version"]), version_end=int(max_version.max()),
            slot_occupancy=(m1["live"] - m0["live"]) / slot_steps if slot_steps else float("nan"))
        return self.sampler.assemble(batch.prompts, self.n, batch.uids, self.decode, tokens, logp, length, min_version,
                                     max_version, queue_s, prefill_s, decode_s, stats, self.pad_to_multiple,
                                     token_version=token_version)


def empty_stats(num_slots: int) -> RolloutStats:
    """The stats of trajectories taken out of a batch in flight (their work counts in the batch's)."""
    return RolloutStats(wall_s=0.0, prefill_s=0.0, decode_s=0.0, weight_sync_s=0.0, generated_tokens=0,
                        prefill_calls=0, prefill_rows=0, decode_chunks=0, num_slots=int(num_slots), version_start=0,
                        version_end=0)


__all__ = ["RolloutStream", "StreamBatch", "empty_stats"]
