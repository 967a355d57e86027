"""The RL sampler: continuous batching over an :class:`RljaxEngine`, with versioned weights.

::

    sampler = Sampler(engine, params, version=0)
    traj = sampler.generate(prompt_token_lists, uids=uids, n=8, decode=DecodeParams(temperature=1.0))
    ...                                        # learner step(s)
    sampler.update_weights(new_params, version=1)

The scheduling is :class:`rljax.rollout.driver.Driver`'s (``generate`` is a thin client: one
request per prompt, its ``n`` sessions keyed ``(seed, uid, session)``): it prefills waiting
prompts in batches (each prompt once, however large ``n``), inserts each prefix into as many
free slots as it has samples left, runs decode chunks of up to ``steps_per_sync`` steps on
device, and after each chunk fetches two ``[slots]`` vectors (done flags and lengths) to free
finished slots. Tokens and log-probs stay on device until the call returns. When prompts are
waiting, a chunk ends early as soon as ``refill_batch`` slots finish, so a freed slot is
refilled while the others keep decoding. Once none waits, each chunk ends as soon as the live
rows fit a smaller decode state (four sizes an octave: ..., 32, 40, 48, 56, 64, ...), and they
move into it (``compact``), so rows that ended on EOS stop costing a step each.

Versions. Every trajectory records the weight versions it was generated with:
``token_version`` (per token), ``min_version`` (the version of its prompt's prefill) and
``max_version`` (the version of its last decode chunk). New weights are installed only
between decode chunks -- from ``on_chunk`` (called between chunks, e.g. by an async trainer)
or from another thread (picked up at the next chunk boundary) -- and apply to every slot from
then on; ``partial_rollout`` says whether a trajectory in flight keeps its cache (``keep``)
or re-prefills its context with the new weights first (``recompute``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rljax.rollout.driver import NO_VERSION, PARTIAL_MODES, Driver, Request, results_for
from rljax.rollout.engine import COMPACT_PER_OCTAVE, RljaxEngine, compact_sizes
from rljax.rollout.sampling import DecodeParams, trajectory_keys
from rljax.rollout.stream import RolloutStream
from rljax.rollout.trajectory import RolloutStats, Trajectories

TRUNCATION_MODES = ("error", "left", "right")


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """What ``on_chunk`` receives after each decode chunk of a ``generate`` call."""

    chunk: int  # 0-based index of the chunk just run
    steps: int  # decode steps it ran
    total_steps: int  # decode steps so far in this call
    finished: int  # trajectories finished so far
    active: int  # trajectories in slots, unfinished
    waiting: int  # trajectories not yet in a slot
    total: int  # trajectories in this call (prompts x n)
    version: int  # weight version the chunk ran with
    slots: int = 0  # slots of the decode state it ran (fewer than the engine's once compacted)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class Sampler:
    """Generates RL trajectories with an :class:`RljaxEngine` and tracks the weight version.

    Args:
      engine: the engine (its mesh is the sampler layout).
      params: initial weights, in any layout (resharded to the engine's).
      version: their version.
      steps_per_sync: most decode steps per device call (host sync).
      refill_batch: while prompts wait, end a chunk once this many slots have finished
        (default ``max(1, num_slots // 8)``).
      truncation: a prompt longer than ``engine.max_prefill_length`` is an error
        (``"error"``, default), or keeps its last (``"left"``) or first (``"right"``)
        ``max_prefill_length`` tokens.
      pad_id: id written into padding positions (default the model's ``pad_token_id`` or 0).
      compact: once no trajectory waits for a slot, end each decode chunk as soon as the
        rows still decoding fit a smaller state on the ladder of ``compact_per_octave`` sizes
        an octave, and move them into the smallest that holds them (:meth:`RljaxEngine.compact`;
        at least ``compact_min_slots``), so rows that ended (EOS) stop costing decode work;
        only while a live row may decode ``steps_per_sync`` more tokens (short responses never
        compact: the move and the compile would cost more than they save).
        Tokens and log-probs are those of the uncompacted run (each trajectory's key is its
        own); each state size compiles the decode chunk once. Default on.
      compact_min_slots: the smallest state ``compact`` makes (default 8: below that a step
        costs about the same, its weight reads dominate).
      compact_per_octave: state sizes an octave (:func:`rljax.rollout.engine.compact_size`):
        4 (default: multiples of 8 with at most three significant bits, 8, 16, 24, ..., 64,
        80, 96, ...), 2 (8, 16, 24, 32, 48, 64, 96, ...) or 1 (powers of two: fewer compiles,
        more rows computed that ended).
      partial_rollout: at a weight install, a trajectory in flight keeps its KV cache and
        decodes on with the new weights (``"keep"``, default) or its context is re-prefilled
        with them first (``"recompute"``); see :class:`~rljax.rollout.driver.Driver`.
    """

    def __init__(
        self,
        engine: RljaxEngine,
        params: Any,
        *,
        version: int = 0,
        steps_per_sync: int = 16,
        refill_batch: int | None = None,
        truncation: str = "error",
        pad_id: int | None = None,
        compact: bool = True,
        compact_min_slots: int = 8,
        compact_per_octave: int = 4,
        partial_rollout: str = "keep",
    ):
        if not isinstance(engine, RljaxEngine):
            raise ValueError(f"engine must be a RljaxEngine, got {type(engine).__name__}")
        if not _is_int(steps_per_sync) or steps_per_sync < 1:
            raise ValueError(f"steps_per_sync is {steps_per_sync!r}; accepted: an integer >= 1")
        refill_batch = max(1, engine.num_slots // 8) if refill_batch is None else refill_batch
        if not _is_int(refill_batch) or refill_batch < 1:
            raise ValueError(f"refill_batch is {refill_batch!r}; accepted: an integer >= 1")
        if not isinstance(compact, bool):
            raise ValueError(f"compact is {compact!r}; accepted: True or False")
        if not _is_int(compact_min_slots) or compact_min_slots < 1:
            raise ValueError(f"compact_min_slots is {compact_min_slots!r}; accepted: an integer >= 1")
        if compact_per_octave not in COMPACT_PER_OCTAVE or isinstance(compact_per_octave, bool):
            raise ValueError(f"compact_per_octave is {compact_per_octave!r}; accepted: "
                             f"{', '.join(map(str, COMPACT_PER_OCTAVE))}")
        if partial_rollout not in PARTIAL_MODES:
            raise ValueError(f"partial_rollout is {partial_rollout!r}; accepted: {', '.join(PARTIAL_MODES)}")
        self.partial_rollout = partial_rollout
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation is {truncation!r}; accepted: {', '.join(TRUNCATION_MODES)}")
        self.engine = engine
        self.steps_per_sync = int(steps_per_sync)
        self.refill_batch = int(refill_batch)
        self.truncation = truncation
        self.compact = compact
        self.compact_min_slots = int(compact_min_slots)
        self.compact_per_octave = int(compact_per_octave)
        #: Every size the decode state compacts into (ascending, ``num_slots`` last).
        self.compact_sizes = compact_sizes(engine.num_slots, self.compact_min_slots, self.compact_per_octave)
        cfg_pad = engine.config.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else (cfg_pad if cfg_pad is not None else 0))
        self._lock = threading.Lock()
        #: A :class:`rljax._digest.DigestLog` recording the digest of every install and decode chunk's
        #: weights (set by a trainer whose trace ties versions to weights; None: not recorded).
        self.digest_log = None
        self._params = None
        self._version: int | None = None
        #: Seconds spent in :meth:`update_weights`: the last call and the running total.
        self.last_weight_sync_s = 0.0
        self.total_weight_sync_s = 0.0
        self.update_weights(params, version)

    # ----------------------------------------------------------------- weights

    @property
    def version(self) -> int:
        """The version of the installed weights."""
        return self._version

    @property
    def params(self) -> Any:
        """The installed weights (sampler layout)."""
        return self._params

    def update_weights(self, params: Any, version: int) -> float:
        """Reshards ``params`` from any layout (e.g. the learner's) to the sampler's and installs them.

        ``version`` must be an integer greater than the installed one. Safe to call from
        ``on_chunk`` or from another thread while :meth:`generate` runs: the new weights
        are used from the next decode chunk on. Returns the seconds the sync took (also in
        :attr:`last_weight_sync_s`).
        """
        if not _is_int(version):
            raise ValueError(f"version is {version!r}; accepted: an integer greater than the current version {self._version}")
        with self._lock:
            current = self._version
        if current is not None and version <= current:
            raise ValueError(f"weight version must increase: got {version}, current is {current}")
        t0 = time.perf_counter()
        new = self.engine.load_params(params)
        jax.block_until_ready(new)
        elapsed = time.perf_counter() - t0
        if self.digest_log is not None:  # the trace ties each version label to the weights installed under it
            self.digest_log.record("install", version, new)
        with self._lock:
            if self._version is not None and version <= self._version:
                raise ValueError(f"weight version must increase: got {version}, current is {self._version}")
            self._params, self._version = new, int(version)
            self.last_weight_sync_s = elapsed
            self.total_weight_sync_s += elapsed
        return elapsed

    def snapshot(self) -> tuple[Any, int]:
        """``(params, version)`` installed now, read together (a weight push may run in another thread)."""
        with self._lock:
            if self._params is None:
                raise RuntimeError(f"the sampler's weights (version {self._version}) were released "
                                   "(release_weights); install new ones with update_weights before generating")
            return self._params, self._version

    def release_weights(self) -> None:
        """Drops the sampler's copy of the weights until the next :meth:`update_weights` (the
        version stays): the synchronous trainer releases them once generation ends, so the
        learner passes do not hold them; its weight sync installs the updated ones."""
        with self._lock:
            released, self._params = self._params, None
        if self.digest_log is not None and released is not None:
            self.digest_log.forget(released)

    # ----------------------------------------------------------------- input checks

    def check_batch(self, prompts, uids, n, decode, pad_to_multiple=1):
        """``(prompts as checked token arrays, uids as str, decode)``; the ``ValueError`` s of
        :meth:`generate` (also used by :meth:`stream` clients)."""
        if not _is_int(n) or n < 1:
            raise ValueError(f"n is {n!r}; accepted: an integer >= 1 (samples per prompt)")
        if not _is_int(pad_to_multiple) or pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple is {pad_to_multiple!r}; accepted: an integer >= 1")
        decode = DecodeParams() if decode is None else decode
        self.engine.check_decode(decode)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty; pass at least one prompt")
        if isinstance(uids, (str, bytes)) or not isinstance(uids, (Sequence, np.ndarray)):
            raise ValueError(f"uids must be a sequence with one uid (str or int) per prompt, got {type(uids).__name__}")
        uids = list(uids)
        if len(uids) != len(prompts):
            raise ValueError(f"uids has {len(uids)} entries for {len(prompts)} prompts; give one uid per prompt")
        for u in uids:
            if not isinstance(u, (str, int, np.integer)) or isinstance(u, bool):
                raise ValueError(f"uid {u!r} is a {type(u).__name__}; accepted: str or int")
        keys = [str(u) for u in uids]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"uid {dup!r} appears more than once; uids name prompt groups and must be unique per call")
        limit = self.engine.max_prefill_length
        out = []
        for i, (p, u) in enumerate(zip(prompts, uids)):
            arr = np.asarray(p)
            if arr.ndim == 1 and arr.size > limit:
                if self.truncation == "error":
                    raise ValueError(
                        f"prompt {i} (uid {u!r}) has {arr.size} tokens, more than the engine's max_prefill_length "
                        f"({limit}); shorten it or build the Sampler with truncation='left' or 'right'"
                    )
                arr = arr[-limit:] if self.truncation == "left" else arr[:limit]
            out.append(self.engine.check_prompt(arr, name=f"prompt {i} (uid {u!r})"))
        return out, keys, decode

    # ----------------------------------------------------------------- generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        uids: Sequence[str | int],
        n: int = 1,
        decode: DecodeParams | None = None,
        on_chunk: Callable[[ChunkInfo], None] | None = None,
        pad_to_multiple: int = 1,
    ) -> Trajectories:
        """Samples ``n`` trajectories (sessions ``0..n-1``) for each prompt.

        Args:
          prompts: token-id sequences, one per prompt group.
          uids: one unique ``str`` / ``int`` per prompt: the group key. Trajectory
            ``(uid, session)`` draws from the random stream ``(decode.seed, uid, session)``.
          n: samples per prompt (``rollout.n``).
          decode: :class:`DecodeParams` (default ``DecodeParams()``).
          on_chunk: called with a :class:`ChunkInfo` after every decode chunk; it may call
            :meth:`update_weights` (the new version applies from the next chunk).
          pad_to_multiple: append padding rows (``is_padding``) so ``B`` divides this.

        Returns:
          :class:`Trajectories` with rows ordered ``prompt * n + session``.

        Raises:
          ValueError: before anything is generated, for an empty prompt list or prompt,
            a prompt longer than ``max_prefill_length`` (unless truncating), token ids
            outside the vocabulary, ``n < 1``, bad or duplicate uids, or bad decode
            parameters.
        """
        prompts, uids, decode = self.check_batch(prompts, uids, n, decode, pad_to_multiple)
        eng = self.engine
        num_prompts, t_max = len(prompts), decode.max_new_tokens
        total = num_prompts * n
        keys = trajectory_keys(decode.seed, [uids[i // n] for i in range(total)], [i % n for i in range(total)])

        t0 = time.perf_counter()
        sync_before = self.total_weight_sync_s
        stats_before = dict(eng.stats)
        driver = self.driver(decode)
        results = results_for(eng, total, t_max)
        requests = [driver.submit(Request(p, keys=keys[i * n : (i + 1) * n], results=results,
                                          rows=range(i * n, (i + 1) * n), tag=i))
                    for i, p in enumerate(prompts)]
        length = np.zeros(total, np.int32)
        finished = 0
        while driver.busy:
            events = driver.step()
            now = time.perf_counter()
            for ev in events:
                if ev.kind == "finished":
                    length[ev.session.row] = ev.length
                    finished += 1
            if on_chunk is not None:
                on_chunk(ChunkInfo(
                    chunk=driver.chunks - 1, steps=driver.last_steps, total_steps=driver.total_steps,
                    finished=finished, active=driver.occupied, waiting=driver.waiting, total=total,
                    version=driver.version, slots=driver.size,
                ))
        sessions = [s for sessions in requests for s in sessions]
        min_version = np.array([s.min_version for s in sessions], np.int64)
        max_version = np.array([s.max_version for s in sessions], np.int64)
        queue_s = np.array([s.inserted_at - t0 for s in sessions], np.float32)
        prefill_s = np.array([s.prefill_s for s in sessions], np.float32)
        decode_s = np.array([s.finished_at - s.inserted_at for s in sessions], np.float32)

        tokens, logp = results.fetch()
        wall = time.perf_counter() - t0
        stats_after = eng.stats
        stats = RolloutStats(
            wall_s=wall,
            prefill_s=driver.prefill_s,
            decode_s=driver.decode_s,
            weight_sync_s=self.total_weight_sync_s - sync_before,
            generated_tokens=int(length.sum()),
            prefill_calls=stats_after["prefill_calls"] - stats_before.get("prefill_calls", 0),
            prefill_rows=stats_after["prefill_rows"] - stats_before.get("prefill_rows", 0),
            decode_chunks=driver.chunks,
            num_slots=eng.num_slots,
            version_start=driver.version_start,
            version_end=driver.version,
            slot_occupancy=driver.slot_occupancy,
        )
        return self.assemble(
            prompts, n, uids, decode, tokens, logp, length, min_version, max_version, queue_s, prefill_s, decode_s,
            stats, pad_to_multiple, token_version=results.versions,
        )

    def driver(self, decode: DecodeParams, *, admit=None) -> Driver:
        """A :class:`~rljax.rollout.driver.Driver` over this sampler's engine and weights (a fresh
        decode state for ``decode``), with its chunking, refill and compaction settings: the
        scheduler :meth:`generate` and multi-turn episodes (:func:`rljax.env.run_episodes`) drive."""
        return Driver(self.engine, self, decode, steps_per_sync=self.steps_per_sync, refill_batch=self.refill_batch,
                      compact=self.compact, compact_min_slots=self.compact_min_slots,
                      compact_per_octave=self.compact_per_octave, admit=admit, partial=self.partial_rollout)

    def stream(self, decode: DecodeParams, *, n: int, admit=None, pad_to_multiple: int = 1):
        """A :class:`~rljax.rollout.stream.RolloutStream`: one driver kept across many batches
        (streaming admission: the slots a batch's tail frees take the next batches' prompts,
        each admitted by ``admit``)."""
        return RolloutStream(self, decode, n=n, admit=admit, pad_to_multiple=pad_to_multiple)

    def assemble(self, prompts, n, uids, decode, tokens, logp, length, min_version, max_version, queue_s, prefill_s,
                 decode_s, stats, pad_to_multiple, *, token_version) -> Trajectories:
        """The :class:`Trajectories` of ``prompts x n`` finished sessions (rows ``prompt * n +
        session``) from their tokens, log-probs, lengths, versions (``token_version [rows, T]``:
        :attr:`Results.versions <rljax.rollout.driver.Results>`) and timings."""
        total, t_max = tokens.shape
        padded = -(-total // pad_to_multiple) * pad_to_multiple
        extra = padded - total
        s_max = self.engine.max_prefill_length

        def pad_rows(x, value=0):
            return np.concatenate([x, np.full((extra,) + x.shape[1:], value, x.dtype)]) if extra else x

        response_mask = np.arange(t_max)[None, :] < length[:, None]
        eos = np.asarray(self.engine.eos_ids(decode), np.int32)
        last = tokens[np.arange(total), np.maximum(length - 1, 0)]
        truncated = ~np.isin(last, eos)
        prompt_ids = np.full((total, s_max), self.pad_id, np.int32)
        prompt_mask = np.zeros((total, s_max), bool)
        prompt_length = np.zeros(total, np.int32)
        for b in range(total):
            p = prompts[b // n]
            prompt_ids[b, s_max - len(p):] = p
            prompt_mask[b, s_max - len(p):] = True
            prompt_length[b] = len(p)
        response_mask = pad_rows(response_mask, False)
        is_padding = np.arange(padded) >= total
        return Trajectories(
            prompt_ids=pad_rows(prompt_ids, self.pad_id),
            prompt_mask=pad_rows(prompt_mask, False),
            response_ids=pad_rows(np.where(response_mask[:total], tokens, self.pad_id).astype(np.int32), self.pad_id),
            response_mask=response_mask,
            loss_mask=response_mask & ~is_padding[:, None],
            rollout_logp=pad_rows(np.where(response_mask[:total], logp, 0.0).astype(np.float32)),
            prompt_length=pad_rows(prompt_length),
            response_length=pad_rows(length.astype(np.int32)),
            truncated=pad_rows(truncated, False),
            group_id=pad_rows((np.arange(total) // n).astype(np.int32)),
            min_version=pad_rows(min_version.astype(np.int32)),
            max_version=pad_rows(max_version.astype(np.int32)),
            token_version=pad_rows(np.where(response_mask[:total], token_version, NO_VERSION).astype(np.int32),
                                   NO_VERSION),
            is_padding=is_padding,
            queue_s=pad_rows(queue_s),
            prefill_s=pad_rows(prefill_s),
            decode_s=pad_rows(decode_s),
            uid=tuple(uids[b // n] for b in range(total)) + ("",) * extra,
            session=tuple(b % n for b in range(total)) + (-1,) * extra,
            index=(0,) * total + (-1,) * extra,
            decode=decode,
            stats=stats,
            num_groups=len(prompts),
            pad_id=self.pad_id,
        )
