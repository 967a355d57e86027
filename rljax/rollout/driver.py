"""The rollout driver: one continuous-batching scheduler over an engine's decode slots.

:class:`Driver` owns the slots, the decode state (the KV cache), prefill / insert / extend /
compaction and the weight installs; clients submit :class:`Request` s and answer
:class:`Event` s. :meth:`rljax.rollout.Sampler.generate` (single-turn) and
:func:`rljax.env.run_episodes` (multi-turn, ``continuation="kv"``) are both thin clients::

    driver = sampler.driver(decode)                         # a fresh decode state, the sampler's weights
    driver.submit(Request(prompt_ids, keys=keys_of_its_n_sessions, results=res, rows=rows))
    while driver.busy:
        for ev in driver.step():                            # one scheduling round (below)
            ...                                             # "finished" / "turn_ended" / "weights_changed"
    tokens, logp = res.fetch()

One :meth:`Driver.step` is one round, in this order:

1. **Weights.** The installed ``(params, version)`` is read from the weight source
   (``snapshot()``, e.g. the :class:`~rljax.rollout.Sampler`, which another thread may update);
   a new version is installed for every slot from this round on (each session in a slot gets
   it as ``max_version``) and raises ``weights_changed``.
2. **Resume.** Parked sessions the client resumed (:meth:`Driver.resume`: an observation and
   the next turn's key) are extended into their own slot's cache
   (:meth:`RljaxEngine.extend_many`, ``prefill_batch_size`` slots a call) and decode on.
3. **Admit.** Free slots take queued sessions in submission order: each request's prompt is
   prefilled once for all its sessions (``prefill_batch_size`` prompts a call, no more prompts
   than the free slots can start) and inserted into as many free slots as it has sessions
   left (:meth:`RljaxEngine.insert_many`); a request's remaining sessions wait for the next
   free slots.
4. **Compact.** Once no session waits and every session in flight is single-turn, the live
   rows move into the smallest decode state on the compaction ladder that holds them
   (:meth:`RljaxEngine.compact`), so rows that ended stop costing a step each.
5. **Decode** one chunk of up to ``steps_per_sync`` steps on device
   (:meth:`RljaxEngine.generate_chunk`), then fetch two ``[slots]`` vectors (done flags,
   lengths). The chunk ends early so the host can act: while multi-turn sessions are in
   flight, once ``refill_batch`` of the decoding ones ended a turn (their environment starts
   sooner); else while sessions wait for a slot, once ``refill_batch`` slots finished; once
   nothing waits, as soon as the live rows fit the next smaller state.
6. **Events**, in slot order: a single-turn session that ended (EOS or length) raises
   ``finished``; its tokens and log-probs are gathered on device into its request's
   :class:`Results` rows and its slot is free. A multi-turn session (``Request.park``) whose
   turn ended (the environment's stop token, EOS or length) raises ``turn_ended`` with the
   turn's tokens and log-probs on the host and *parks*: its slot and cache stay, nothing is
   decoded for it, until the client calls :meth:`Driver.resume` (its observation is extended
   into the cache) or :meth:`Driver.end` (the slot frees; ``finished`` is raised next round).

Tokens. Session ``s`` of a request samples from its own key (``Request.keys[s]``; a resumed
turn from the key given to :meth:`resume`), folded with the token's index, so its tokens do
not depend on its slot, on the other sessions, on chunk boundaries or on compaction: the
same ``(seed, uid, session)`` gives the same tokens however requests are scheduled. Only a
weight install depends on the schedule: it applies from the next chunk on.

The engine boundary. The driver calls only the engine's batched JetStream-style surface:
``init_decode_state``, ``prefill_batch``, ``insert_many``, ``extend_many``,
``generate_chunk``, ``compact``, ``decode_layers`` and reads ``num_slots``,
``prefill_batch_size``, ``replicated()`` and the decode state's ``done`` / ``step`` /
``out_tokens`` / ``out_logp``; another engine with those calls can stand behind it.

Streaming admission (issue 23 item 2) plugs in here without touching the slot logic: a
producer keeps one driver for many batches, :meth:`submit` s the next batch's requests
whenever it likes (between rounds), each with the :class:`Results` of its own batch, and
passes ``admit``: a callable consulted for the request at the head of the queue before its
prompt is prefilled; ``False`` keeps it (and everything behind it) queued for a later
round -- the staleness gate ("may a prompt of this batch still be trained within tau?").
A batch is complete when every session of its requests raised ``finished``. Compaction
shrinks the state only while the queue is empty; a request submitted after that takes the
smaller state's free slots (build the driver with ``compact=False`` to keep the width).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax.rollout.engine import COMPACT_PER_OCTAVE, compact_sizes

EVENT_KINDS = ("finished", "turn_ended", "weights_changed")
#: What a session in flight does at a weight install (``Driver(partial=...)``).
PARTIAL_MODES = ("keep", "recompute")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _collect(res_tokens, res_logp, out_tokens, out_logp, slots, rows):
    t = res_tokens.shape[1]
    res_tokens = res_tokens.at[rows].set(out_tokens[slots, :t], mode="drop")
    res_logp = res_logp.at[rows].set(out_logp[slots, :t], mode="drop")
    return res_tokens, res_logp


#: ``token_version`` at positions that hold no sampled token (padding, observations).
NO_VERSION = -1


class Results:
    """Device buffers ``tokens [rows, width]`` int32 and ``logp [rows, width]`` float32 that
    finished single-turn sessions are gathered into (on device, one gather per round), read
    once with :meth:`fetch`; and on the host ``versions [rows, width]`` int32: the weight
    version each token was sampled with (:data:`NO_VERSION` after a row's last token)."""

    def __init__(self, rows: int, width: int, sharding=None):
        self.rows, self.width = int(rows), int(width)
        self.tokens = jax.device_put(np.zeros((self.rows, self.width), np.int32), sharding)
        self.logp = jax.device_put(np.zeros((self.rows, self.width), np.float32), sharding)
        self.versions = np.full((self.rows, self.width), NO_VERSION, np.int32)

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, logp)`` on the host."""
        return jax.device_get((self.tokens, self.logp))


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and its sessions.

    Args:
      prompt: 1-D token ids (checked by the client: :meth:`RljaxEngine.check_prompt`).
      keys: ``uint32 [n, 2]``: session ``s``'s key for its first turn (``n`` = sessions).
      results: single-turn: the :class:`Results` its finished sessions are gathered into, at
        ``rows[s]``. Ignored with ``park``.
      rows: the results row of each session (default ``0..n-1``).
      park: multi-turn: a session whose turn ends parks (``turn_ended``) and waits for
        :meth:`Driver.resume` or :meth:`Driver.end`, instead of finishing.
      tag: the client's own (e.g. its prompt index); the driver never reads it.
    """

    prompt: Any
    keys: Any
    results: Optional[Results] = None
    rows: Optional[Sequence[int]] = None
    park: bool = False
    tag: Any = None
    sessions: list = dataclasses.field(default_factory=list, repr=False)  # set by Driver.submit

    def __post_init__(self):
        self.keys = np.asarray(self.keys, np.uint32).reshape(-1, 2)
        if self.keys.shape[0] < 1:
            raise ValueError("Request.keys is empty; give one uint32 [2] key per session")
        if self.rows is None:
            self.rows = tuple(range(self.n))
        if len(self.rows) != self.n:
            raise ValueError(f"Request.rows has {len(self.rows)} entries for {self.n} sessions (keys)")
        if not self.park and self.results is None:
            raise ValueError("a single-turn Request needs results (a Results its finished sessions are gathered into)")

    @property
    def n(self) -> int:
        return int(self.keys.shape[0])


@dataclasses.dataclass(eq=False)
class Session:
    """One session of a request, as the driver tracks it (the client reads, never writes)."""

    request: Request
    index: int  # 0..n-1 within its request
    slot: int = -1  # its decode slot while it holds one
    status: str = "queued"  # queued, decoding, parked, finished
    length: int = 0  # tokens generated in its current (or last) turn
    turns: int = 0  # turns started
    min_version: int = 0  # oldest weight version it decoded with (its prefill's included)
    max_version: int = 0  # newest
    #: The current turn's version record: ``(first token index, version)`` spans in order; token
    #: ``i`` was sampled with the version of the last span starting at or before ``i``.
    spans: list = dataclasses.field(default_factory=list)
    recomputed: int = 0  # times its context was re-prefilled at a weight install (partial_rollout=recompute)
    queued_at: float = 0.0  # perf_counter when submitted
    inserted_at: float = 0.0  # when it took a slot
    prefill_s: float = 0.0  # seconds of its prompt's prefill call
    finished_at: float = 0.0  # when its slot freed

    @property
    def row(self) -> int:
        return int(self.request.rows[self.index])

    def token_versions(self, length: Optional[int] = None) -> np.ndarray:
        """``int32 [length]``: the weight version of each token of its current (or last) turn."""
        length = self.length if length is None else int(length)
        out = np.full(length, NO_VERSION, np.int32)
        for start, version in self.spans:
            out[start:] = version
        return out

    def record_version(self, start: int, version: int) -> None:
        """Tokens from index ``start`` on are sampled with ``version`` (the driver calls it)."""
        while self.spans and self.spans[-1][0] >= start:
            self.spans.pop()
        if not self.spans or self.spans[-1][1] != version:
            self.spans.append((int(start), int(version)))


@dataclasses.dataclass(frozen=True)
class Event:
    """What a round raised. ``kind``: ``"finished"`` (a single-turn session ended on EOS or its
    length; or a multi-turn session the client ended), ``"turn_ended"`` (a multi-turn session's
    turn ended: ``tokens`` / ``logp`` hold the turn on the host; the session is parked),
    ``"weights_changed"`` (``version`` installed, ``previous`` before; no session).
    ``versions``: with ``turn_ended``, the weight version of each of the turn's tokens."""

    kind: str
    session: Optional[Session] = None
    length: int = 0
    tokens: Optional[np.ndarray] = None
    logp: Optional[np.ndarray] = None
    versions: Optional[np.ndarray] = None
    version: int = 0
    previous: int = 0


class Driver:
    """The continuous-batching scheduler over ``engine``'s slots; see the module docstring.

    Args:
      engine: an :class:`~rljax.rollout.RljaxEngine` (or an engine with the same batched calls).
      weights: anything with ``snapshot() -> (params, version)`` (the :class:`~rljax.rollout.Sampler`).
      decode: the :class:`~rljax.rollout.DecodeParams` of every request (in the decode state).
      steps_per_sync, refill_batch, compact, compact_min_slots, compact_per_octave: as
        :class:`~rljax.rollout.Sampler` documents them.
      admit: ``admit(request) -> bool``, consulted before the request at the head of the queue
        is prefilled; ``False`` keeps it queued (streaming admission's staleness gate). Default:
        admit all.
      partial: what a session in flight does at a weight install: ``"keep"`` (its cache and
        tokens stay; its next tokens are sampled with the new weights) or ``"recompute"`` (its
        context, prompt and tokens so far, is re-prefilled with the new weights into its slot
        before it decodes on; prompts prefilled but not yet inserted are prefilled again).
        Either way the tokens sampled before keep their version and log-prob. Multi-turn
        (parked) sessions keep.
    """

    def __init__(self, engine, weights, decode, *, steps_per_sync: int = 16, refill_batch: int = 1,
                 compact: bool = True, compact_min_slots: int = 8, compact_per_octave: int = 4,
                 admit: Callable[[Request], bool] | None = None, partial: str = "keep"):
        if compact_per_octave not in COMPACT_PER_OCTAVE:
            raise ValueError(f"compact_per_octave is {compact_per_octave!r}; accepted: "
                             f"{', '.join(map(str, COMPACT_PER_OCTAVE))}")
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial is {partial!r}; accepted: {', '.join(PARTIAL_MODES)}")
        self.partial = partial
        self.engine, self.weights, self.decode = engine, weights, decode
        self.steps_per_sync, self.refill_batch = int(steps_per_sync), int(refill_batch)
        self.compact, self.compact_min_slots = bool(compact), int(compact_min_slots)
        self.compact_per_octave = int(compact_per_octave)
        self.admit = admit
        self.compact_sizes = compact_sizes(engine.num_slots, self.compact_min_slots, self.compact_per_octave)
        self.params, self.version = weights.snapshot()
        #: Version installed when the driver started.
        self.version_start = self.version
        self._layers = engine.decode_layers(self.params)  # per-layer weight copies, once per version
        self.state = engine.init_decode_state(decode)
        self.size = engine.num_slots  # slots of the decode state: fewer once compacted
        self._slot: list[Optional[Session]] = [None] * self.size
        self._free = deque(range(self.size))
        self._queue: deque = deque()  # requests with no session inserted yet
        self._ready: deque = deque()  # [prefix, row, request, next session, version, seconds]: prefilled
        self._resumed: list = []  # (session, tokens, key) to extend
        self._events: list[Event] = []  # raised outside a round (end), delivered with the next
        self._waiting = 0  # sessions not yet in a slot
        self._park = 0  # multi-turn sessions in flight
        #: Totals: seconds in prefill and extend calls, seconds in decode chunks, chunks, steps.
        self.prefill_s = self.decode_s = 0.0
        self.chunks = self.total_steps = 0
        #: ``partial="recompute"``: seconds re-prefilling contexts at installs, contexts re-prefilled, their tokens.
        self.recompute_s, self.recomputed, self.recomputed_tokens = 0.0, 0, 0
        #: The last chunk: steps it ran and its seconds per step.
        self.last_steps, self.last_step_s = 0, 0.0
        #: Slot occupancy: tokens decoded (one per live slot and step) and slot-steps offered
        #: (``engine.num_slots`` per decode step, whatever the compacted size), so
        #: ``live_slot_steps / slot_steps`` is the mean share of the engine's slots decoding.
        self.live_slot_steps = self.slot_steps = 0

    # ----------------------------------------------------------------- client calls

    def submit(self, request: Request) -> list[Session]:
        """Queues ``request``; returns its sessions (in session order)."""
        now = time.perf_counter()
        sessions = [Session(request, s, queued_at=now) for s in range(request.n)]
        request.sessions[:] = sessions
        self._queue.append(request)
        self._waiting += request.n
        self._park += request.n if request.park else 0
        return sessions

    def resume(self, session: Session, tokens, key) -> None:
        """A parked session decodes on: ``tokens`` (its observation; may be empty) are extended
        into its cache after its last token at the next round, and its next turn samples from ``key``."""
        if session.status != "parked":
            raise ValueError(f"resume: session {session.index} of its request is {session.status}; only a parked "
                             "session (after turn_ended) resumes")
        session.status = "resuming"
        self._resumed.append((session, tokens, np.asarray(key, np.uint32).reshape(2)))

    def end(self, session: Session) -> None:
        """A parked session's episode is over: its slot frees now; ``finished`` is raised with the next round's events."""
        if session.status != "parked":
            raise ValueError(f"end: session {session.index} of its request is {session.status}; only a parked "
                             "session (after turn_ended) ends")
        self._release(session)
        self._park -= 1
        self._events.append(Event("finished", session, length=session.length))

    @property
    def busy(self) -> bool:
        """Whether a round has work: a session queued, decoding or resuming, or an event to deliver."""
        return bool(self._waiting or self._resumed or self._events or self.decoding)

    @property
    def in_progress(self) -> bool:
        """Whether a round has work besides admitting queued sessions: one decoding or resuming, or
        an event to deliver (``busy`` without it: every queued request waits for ``admit``)."""
        return bool(self._resumed or self._events or self.decoding)

    @property
    def decoding(self) -> int:
        """Sessions decoding a turn."""
        return sum(1 for s in self._slot if s is not None and s.status == "decoding")

    @property
    def occupied(self) -> int:
        """Slots holding a session (decoding or parked)."""
        return sum(1 for s in self._slot if s is not None)

    @property
    def waiting(self) -> int:
        """Sessions not yet in a slot."""
        return self._waiting

    @property
    def holding(self) -> bool:
        """Whether any session holds weights of the installed version: one in a slot, a prompt
        prefilled but not yet inserted, or a parked one resuming (a weight install now would
        make it span versions)."""
        return bool(self.occupied or self._ready or self._resumed)

    @property
    def slot_occupancy(self) -> float:
        """Live slots / the engine's slots, averaged over the decode steps so far (NaN before any)."""
        return self.live_slot_steps / self.slot_steps if self.slot_steps else float("nan")

    # ----------------------------------------------------------------- the round

    def step(self) -> list[Event]:
        """One round (module docstring): weights, resume, admit, compact, decode, events."""
        events, self._events = self._events, []
        self._install(events)
        self._extend()
        self._fill()
        self._compact()
        if self.decoding:
            self._chunk(events)
        return events

    def _install(self, events):
        params, version = self.weights.snapshot()
        if version == self.version:
            return
        events.append(Event("weights_changed", version=int(version), previous=int(self.version)))
        self.params, self.version = params, version
        self._layers = self.engine.decode_layers(params)
        for s in self._slot:
            if s is not None:
                s.max_version = version
                if s.status == "decoding":  # its tokens from here on are sampled with the new weights
                    s.record_version(s.length, version)
        if self.partial == "recompute":
            self._recompute()

    def _recompute(self):
        """``partial="recompute"``: every single-turn session decoding re-prefills its context
        (prompt + the tokens whose keys / values its cache holds) with the installed weights into
        its own slot; its last sampled token, not yet in the cache, is written by the next decode
        step with them. Prompts prefilled with the old weights and not yet inserted are prefilled again."""
        eng = self.engine
        tp = time.perf_counter()
        live = [s for s in self._slot if s is not None and s.status == "decoding" and not s.request.park]
        if live:
            out_tokens = np.asarray(jax.device_get(self.state.out_tokens))
            for i in range(0, len(live), eng.prefill_batch_size):
                part = live[i : i + eng.prefill_batch_size]
                contexts = [np.concatenate([np.asarray(s.request.prompt, np.int32).reshape(-1),
                                            out_tokens[s.slot, : s.length - 1]]) for s in part]
                self.state = eng.reprefill_many(self.params, self.state, slots=[s.slot for s in part],
                                                contexts=contexts)
                for s, c in zip(part, contexts):
                    s.recomputed += 1
                    self.recomputed_tokens += len(c)
                self.recomputed += len(part)
            jax.block_until_ready(self.state.cache.k[0])
        for entry in self._ready:
            if entry[4] != self.version:  # prefilled with the old weights, not yet inserted: again
                entry[0] = eng.prefill_batch(self.params, [entry[2].prompt])
                entry[1], entry[4] = 0, self.version
                jax.block_until_ready(entry[0].logits)
        took = time.perf_counter() - tp
        self.recompute_s += took
        self.prefill_s += took

    def _extend(self):
        eng, todo, self._resumed = self.engine, self._resumed, []
        tp = time.perf_counter()
        for i in range(0, len(todo), eng.prefill_batch_size):
            part = todo[i : i + eng.prefill_batch_size]
            self.state, logits = eng.extend_many(self.params, self.state, slots=[s.slot for s, _, _ in part],
                                                 tokens=[t for _, t, _ in part], keys=np.stack([k for _, _, k in part]))
            jax.block_until_ready(logits)
            for s, _, _ in part:
                s.status, s.turns, s.length = "decoding", s.turns + 1, 1
                s.max_version = max(s.max_version, self.version)
                s.spans = [(0, int(self.version))]
        self.prefill_s += time.perf_counter() - tp

    def _fill(self):
        eng = self.engine
        pending: dict[int, tuple] = {}  # id(prefix) -> (prefix, rows, slots, keys)
        while self._free and (self._ready or self._queue):
            if not self._ready:
                take, sessions = [], 0
                while (self._queue and len(take) < eng.prefill_batch_size and sessions < len(self._free)
                       and (self.admit is None or self.admit(self._queue[0]))):
                    req = self._queue.popleft()
                    take.append(req)
                    sessions += req.n
                if not take:
                    break  # the head of the queue is not admitted yet
                tp = time.perf_counter()
                prefix = eng.prefill_batch(self.params, [r.prompt for r in take])
                jax.block_until_ready(prefix.logits)
                took = time.perf_counter() - tp
                self.prefill_s += took
                self._ready.extend([prefix, j, r, 0, self.version, took] for j, r in enumerate(take))
            entry = self._ready[0]
            prefix, prow, req, first, pversion, took = entry
            count = min(len(self._free), req.n - first)
            now = time.perf_counter()
            group = pending.setdefault(id(prefix), (prefix, [], [], []))
            for i in range(first, first + count):
                slot = self._free.popleft()
                s = req.sessions[i]
                s.slot, s.status, s.turns, s.length = slot, "decoding", 1, 1
                s.min_version, s.max_version = min(pversion, self.version), self.version
                # token 0 is sampled from the prefill's logits, the next ones by decode steps
                s.spans = [(0, int(pversion))]
                s.record_version(1, int(self.version))
                s.inserted_at, s.prefill_s = now, took
                self._slot[slot] = s
                group[1].append(prow)
                group[2].append(slot)
                group[3].append(req.keys[i])
            entry[3] += count
            self._waiting -= count
            if entry[3] == req.n:
                self._ready.popleft()
        for prefix, rows, slots, keys in pending.values():
            self.state = eng.insert_many(prefix, self.state, rows=rows, slots=slots, keys=np.stack(keys))

    def _smaller(self):
        """The state sizes below the current one that compacting may move into now (none if it would not pay)."""
        live = [s for s in self._slot if s is not None]
        if not (self.compact and live and not self._park):
            return []
        # compacting pays (a gather of the live cache, a compile per new size) only while a live
        # row may still decode for a whole chunk: short responses never compact
        if self.decode.max_new_tokens - min(s.length for s in live) < self.steps_per_sync:
            return []
        return [c for c in self.compact_sizes if c < self.size]

    def _compact(self):
        smaller = self._smaller()
        occupied = [i for i, s in enumerate(self._slot) if s is not None]
        if self._waiting or not smaller or len(occupied) > smaller[-1]:
            return
        # nothing left to insert and the live rows fit a smaller state: move them into the smallest
        # that holds them, so a step computes that many rows, not `size`
        self.state = self.engine.compact(self.state, occupied, min_slots=self.compact_min_slots,
                                         per_octave=self.compact_per_octave)
        self.size = int(self.state.tokens.shape[0])
        self._slot = [self._slot[i] for i in occupied] + [None] * (self.size - len(occupied))
        for i, s in enumerate(self._slot[: len(occupied)]):
            s.slot = i
        self._free = deque(range(len(occupied), self.size))

    def _chunk(self, events):
        eng = self.engine
        log = getattr(self.weights, "digest_log", None)
        if log is not None:  # the weights this chunk decodes with, under the version label it records
            log.chunk(self.params, self.version)
        decoding = self.decoding
        if self._park:
            exit_after = min(decoding, self.refill_batch)  # a turn's environment starts sooner
        elif self._waiting:
            exit_after = min(self._waiting, self.refill_batch)
        else:
            smaller = self._smaller()
            # end the chunk once the rows fit the next smaller state
            exit_after = self.occupied - smaller[-1] if smaller else self.size + 1
        tc = time.perf_counter()
        self.state, steps = eng.generate_chunk(self.params, self.state, num_steps=self.steps_per_sync,
                                               exit_after=exit_after, layers=self._layers)
        done, step, steps = jax.device_get((self.state.done, self.state.step, steps))
        took = time.perf_counter() - tc
        self.decode_s += took
        self.chunks += 1
        self.total_steps += int(steps)
        self.last_steps, self.last_step_s = int(steps), took / max(1, int(steps))
        fin = [i for i, s in enumerate(self._slot) if s is not None and s.status == "decoding"]
        for i in fin:
            self.live_slot_steps += int(step[i]) - self._slot[i].length
            self._slot[i].length = int(step[i])
        self.slot_steps += self.engine.num_slots * int(steps)
        fin = [i for i in fin if done[i]]
        if not fin:
            return
        turns = [i for i in fin if self._slot[i].request.park]
        if turns:
            out_tokens, out_logp = jax.device_get((self.state.out_tokens, self.state.out_logp))
        gathers: dict[int, tuple] = {}  # id(results) -> (results, slots, rows)
        for i in fin:
            s = self._slot[i]
            if s.request.park:
                s.status = "parked"
                events.append(Event("turn_ended", s, length=s.length, tokens=out_tokens[i, : s.length],
                                    logp=out_logp[i, : s.length], versions=s.token_versions()))
            else:
                res = s.request.results
                res.versions[s.row, : s.length] = s.token_versions()
                g = gathers.setdefault(id(res), (res, [], []))
                g[1].append(i)
                g[2].append(s.row)
                self._release(s)
                events.append(Event("finished", s, length=s.length))
        for res, slots, rows in gathers.values():
            pad = self.size - len(slots)
            res.tokens, res.logp = _collect(
                res.tokens, res.logp, self.state.out_tokens, self.state.out_logp,
                jnp.asarray(np.concatenate([slots, np.zeros(pad, np.int64)]), jnp.int32),
                jnp.asarray(np.concatenate([rows, np.full(pad, res.rows, np.int64)]), jnp.int32))

    def _release(self, s: Session):
        self._slot[s.slot] = None
        self._free.append(s.slot)
        s.slot, s.status, s.finished_at = -1, "finished", time.perf_counter()


def results_for(engine, rows: int, width: int) -> Results:
    """A :class:`Results` of ``rows x width`` replicated on ``engine``'s mesh."""
    return Results(rows, width, engine.replicated())


__all__ = ["Driver", "Event", "EVENT_KINDS", "NO_VERSION", "PARTIAL_MODES", "Request", "Results", "Session",
           "results_for"]
