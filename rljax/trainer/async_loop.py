"""Asynchronous training (``trainer.mode=async``): the same stages, scheduled on two threads.

* **Producer** (a rollout thread): ``dataset_item -> rollout_sessions -> reward`` (``reward``
  on the learner with ``reward.model.path``: :func:`producer_stages`; the
  functions of :mod:`rljax.trainer.stages`, run by a :class:`StepRunner` without
  observers, :meth:`StepRunner.produce`), then the complete batch is put into the
  :class:`~rljax.rollout.queue.TrajectoryQueue` with its rows' ``min_version`` /
  ``max_version``. Before it starts a batch it waits for admission (the batch must be
  trainable within ``async_training.max_staleness``) and installs the newest pushed
  weights; with ``async_training.partial_rollout=keep|recompute`` it also installs pushes
  between decode chunks (the rollout stage's ``on_chunk``), so a trajectory may span versions
  (each token's in ``token_version``; ``recompute`` re-prefills the contexts in flight first).
* **Streaming producer** (``async_training.streaming``, the default where it applies:
  :func:`streams`): :class:`StreamingProducer` keeps one rollout driver for the run and admits
  prompts of later batches into the slots a batch's tail frees, each only if its batch can
  still be trained within ``max_staleness``; a batch is queued when all its groups are complete.
  Single-turn rollouts stream through a :class:`~rljax.rollout.stream.RolloutStream`, multi-turn
  episodes (``env.continuation=kv``) through an ``EpisodeStream`` (:meth:`rljax.env.EnvRuntime.stream`):
  a session parked on its environment keeps its slot, an ended episode frees it.
* **Consumer** (the trainer's thread): takes the next batch the staleness gate accepts and
  runs ``dequeue -> trajectory_fields -> old_log_prob -> reference -> values -> advantages
  -> update_critic -> actor_minibatch -> weight_sync -> metrics`` with the trainer's
  runner; the producer's stage events are replayed to the observers first, so the trace
  shows the whole path of a group (``enqueue`` and ``dequeue`` records with versions and
  staleness). ``weight_sync`` advances the learner version every step and pushes weights
  every ``trigger_parameter_sync_step`` steps (resharded to the sampler layout on the
  learner's thread, installed by the producer).

With ``max_staleness=0`` admission lets the producer start batch ``k`` only after the push
of step ``k-1``: the schedule, the random streams and so the metrics are the synchronous
ones.

The two-ratio correction: the PPO ratio is taken against ``old_logp``, recomputed by the
learner at consumption (``old_log_prob``), and ``rollout.correction=token|sequence``
multiplies the loss by the truncated ``pi_old / pi_rollout`` (TIS), which absorbs both
staleness and engine drift. ``algorithm.bypass_mode=true`` (PPO ratio against the
sampler's ``rollout_logp``) stays the cheaper alternative.

Shutdown: an exception on either side closes the queue; the consumer re-raises the
producer's error (a reward error above ``reward.max_error_fraction`` included), the
producer stops at its next wait or after its current batch; :meth:`AsyncSchedule.close`
joins the thread with a bound.

Checkpoints: the trajectories queued or in flight are not saved; the checkpoint records
the data position after the last batch the learner trained on and the producer's next
batch index, so after ``--resume`` the in-flight prompts are replayed (generated again,
with the restored weights). Batches dropped by the gate are not replayed (counted in
``async/dropped_*``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import types
from typing import Any, Optional

import jax
import numpy as np

from rljax.env import episode_scores
from rljax.rollout.queue import QueueClosed, QueueItem, TrajectoryQueue
from rljax.trainer.distribute import check_async_share, version_spans
from rljax.trainer.runner import Stage, StepRunner
from rljax.trainer import dynamic_sampling as ds
from rljax.trainer import stages as S

log = logging.getLogger("rljax")

#: The producer side's stages (the names of the synchronous step).
PRODUCER_STAGES = ("dataset_item", "rollout_sessions", "reward", "enqueue")
JOIN_TIMEOUT_S = 30.0


def producer_stages(cfg) -> tuple[str, ...]:
    """The synchronous stages the producer runs. With ``reward.model.path`` the ``reward`` stage
    runs on the learner instead: it combines the reward model's scores, which the
    ``reward_model`` stage computes on the learner mesh from the learner batch (its weights are
    fixed, so the version it scores with does not matter; the rows keep the versions they were
    generated with), after ``trajectory_fields``."""
    if cfg.reward.model.path is not None:
        return ("dataset_item", "rollout_sessions")
    return ("dataset_item", "rollout_sessions", "reward")


def partial_mode(cfg) -> str:
    """``async_training.partial_rollout`` as ``"false"``, ``"keep"`` or ``"recompute"`` (``true`` is
    the earlier boolean spelling of ``keep``)."""
    mode = cfg.async_training.partial_rollout
    return "keep" if mode == "true" else mode


def staleness_facts(learner_version: int, min_version: np.ndarray, max_version: np.ndarray) -> dict:
    """The staleness of a trained batch's rows (``learner_version - min_version``): max, mean and
    histogram, the version range, and the rows whose generation spanned a weight push."""
    staleness = learner_version - min_version
    return {"staleness_max": int(staleness.max()), "staleness_mean": float(staleness.mean()),
            "min_version": int(min_version.min()), "max_version": int(max_version.max()),
            "spanning_rows": int((min_version < max_version).sum()),
            "staleness_hist": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))}}


def queue_facts(ev, v) -> dict:
    """The ``enqueue`` / ``dequeue`` stage's facts (the batch through the queue: index, depth,
    versions, drops); at ``dequeue`` also the traced group's version range and staleness."""
    facts = dict(ev.writes.get(ev.stage) or {})
    facts.pop("staleness_hist", None)
    if ev.stage == "dequeue":
        learner = facts.get("learner_version")
        traj = v.traj
        vs = [(int(traj.min_version[i]), int(traj.max_version[i])) for i in v.rows]
        facts["group"] = {"min_version": min(x[0] for x in vs) if vs else None,
                          "max_version": max(x[1] for x in vs) if vs else None,
                          "staleness": [learner - x[0] for x in vs] if learner is not None else None}
    return facts


def enqueue_stage(fn) -> Stage:
    """The producer's last stage: ``fn(batch) -> {"enqueue": facts}`` about the batch put into the queue."""
    return Stage("enqueue", fn, "enqueue", reads=("step", "trajectories"), writes=("enqueue",), facts=queue_facts)


class WeightPush:
    """The newest weights the learner pushed, until the producer installs them (its thread
    owns the sampler); ``pushes`` counts them."""

    def __init__(self):
        self._pending: Optional[tuple[Any, int]] = None  # (params in the sampler layout, version)
        self._lock = threading.Lock()
        self.pushes = 0

    def put(self, params, version: int) -> None:
        with self._lock:
            self._pending = (params, version)
        self.pushes += 1

    def latest_version(self, sampler) -> int:
        """The newest weight version the rollout side has or will install before its next batch."""
        with self._lock:
            pending = self._pending
        return pending[1] if pending is not None else int(sampler.version)

    def install(self, sampler) -> None:
        """Installs the pending push; it stays pending (so :meth:`latest_version` names it) until
        the sampler holds it: the learner reads the version while the producer installs."""
        with self._lock:
            pending = self._pending
        if pending is not None and pending[1] > sampler.version:
            sampler.update_weights(*pending)
        with self._lock:
            if self._pending is pending:  # a newer push meanwhile stays pending
                self._pending = None


class Producer:
    """The rollout thread: ``dataset_item -> rollout_sessions -> reward`` per batch (with no run
    state: the learner owns it), then the batch into the queue."""

    def __init__(self, services, queue: TrajectoryQueue, weights: WeightPush, *, first_index: int):
        self.services, self.queue, self.weights = services, queue, weights
        #: Held by the producer while it generates and scores, and by validation.
        self.sampler_lock = threading.RLock()
        #: Set while validation waits for the sampler lock: the streaming producer, which takes the
        #: lock once per round, stays out until it is cleared (a lock is not fair).
        self.pause_requested = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.next_index = first_index
        sampler = services.rollout.sampler
        on_chunk = (lambda info: weights.install(sampler)) if partial_mode(services.cfg) != "false" else None
        sync = {s.name: s for s in S.sync_stages(services, on_chunk=on_chunk)}  # multi-turn ones with env.*

        def item(b):  # the synchronous prompts; the rollout version is the sampler's (not the learner's)
            return dict(S.draw_prompts(services, b), weight_version=sampler.version)

        scoring = [sync["reward"]] if "reward" in producer_stages(services.cfg) else []
        self.runner = StepRunner([dataclasses.replace(sync["dataset_item"], fn=item, updates_state=False),
                                  sync["rollout_sessions"], *scoring, enqueue_stage(self._enqueue_facts)])

    def _enqueue_facts(self, b) -> dict:
        traj = b["trajectories"]
        real = ~np.asarray(traj.is_padding)
        return {"enqueue": {"batch_index": int(b["step"]), "queue_depth_before": len(self.queue),
                            "min_version": int(np.asarray(traj.min_version)[real].min()),
                            "max_version": int(np.asarray(traj.max_version)[real].max()),
                            "version_span_max": int(version_spans(traj).max(initial=0)),
                            "sampler_version": int(self.services.rollout.sampler.version)}}

    def latest_version(self) -> int:
        return self.weights.latest_version(self.services.rollout.sampler)

    def install_pending(self) -> None:
        self.weights.install(self.services.rollout.sampler)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rljax-rollout", daemon=True)
            self._thread.start()

    def _produce_one(self) -> QueueItem:
        """One batch, generated and scored under the sampler lock; ``None`` when stopped."""
        with self.sampler_lock:
            if self._stop.is_set():
                return None
            self.install_pending()
            index = self.next_index
            produced = self.runner.produce(index, {"step": index})
            data_after = self.services.rollout.prompts.state()
            self.next_index += 1
        traj = produced.batch["trajectories"]
        real = ~np.asarray(traj.is_padding)
        return QueueItem(index=index, min_version=np.asarray(traj.min_version)[real].tolist(),
                         max_version=np.asarray(traj.max_version)[real].tolist(),
                         uids=[str(u) for u in np.asarray(traj.uid, dtype=object)[real]],
                         payload=(produced, data_after))

    def _loop(self) -> None:
        q = self.queue
        try:
            while not self._stop.is_set():
                q.wait_admission(self.latest_version)
                try:
                    item = self._produce_one()
                    if item is None:
                        q.abandon()
                        return
                    q.put(item)
                    del item
                except BaseException:
                    q.abandon()
                    raise
        except QueueClosed:
            pass
        except BaseException as e:  # noqa: BLE001 -- the learner re-raises it
            log.error("rljax: the rollout thread failed: %s: %s", type(e).__name__, e)
            q.close(e)

    def close(self, timeout: float) -> None:
        """Stops the thread (it finishes at most its current batch) and joins it."""
        self._stop.set()
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("rljax: the rollout thread did not stop within %.0f s", timeout)


def streams(services) -> bool:
    """Whether this run's producer streams (:class:`StreamingProducer`): ``async_training.streaming``
    and a rollout it applies to (:func:`streaming_limit` is ``None``); else one batch per
    ``generate`` call (:class:`Producer`)."""
    return bool(services.cfg.async_training.streaming) and streaming_limit(services) is None


def streaming_limit(services) -> Optional[str]:
    """Why ``async_training.streaming`` does not apply to this run (the line the log gives), or
    ``None``. It applies to single-turn rollouts and to multi-turn episodes with
    ``env.continuation=kv`` (one stream per process, each over its share of the prompt groups),
    with or without ``algorithm.filter_groups`` (one process: several are refused at launch in
    ``trainer.mode=async``)."""
    env = services.rollout.env
    if env is not None and env.continuation != "kv":
        return "env.continuation=reprefill re-prefills every turn in one generate call per turn"
    return None


@dataclasses.dataclass
class _Drawn:
    """A batch's prompts as drawn, before generation."""

    prompts: list
    uids: list
    data_after: Any  # the data iterator's position after the draw
    t_draw: float  # perf_counter: the draw started
    draw_s: float


def _streamed_item(index: int, produced, traj, *, t_draw: float, draw_s: float, t_submit: float, t_done: float,
                   data_after) -> QueueItem:
    """The queue item of a streamed batch. Its first two stages only hand over what the rounds
    did, so their times (timings and trace events) are the draw's and the batch's generation,
    from its submission to its completion (overlapping other batches')."""
    produced.timings.update(data=draw_s, gen=t_done - t_submit)
    window = {"dataset_item": (t_draw, t_draw + draw_s), "rollout_sessions": (t_submit, t_done)}
    for ev in produced.events:
        if ev.stage in window:
            ev.t_start, ev.t_end = window[ev.stage]
    real = ~np.asarray(traj.is_padding)
    return QueueItem(index=index, min_version=np.asarray(traj.min_version)[real].tolist(),
                     max_version=np.asarray(traj.max_version)[real].tolist(),
                     uids=[str(u) for u in np.asarray(traj.uid, dtype=object)[real]], payload=(produced, data_after))


class StreamingProducer(Producer):
    """Streaming admission (``async_training.streaming``): the rollout thread keeps one
    :class:`~rljax.rollout.stream.RolloutStream` for the run, so the slots a batch's long tail
    frees take the next batches' prompts instead of idling until the batch is complete.

    Each round (under the sampler lock, so validation can pause it between rounds):

    1. **Weights.** A pushed version is installed at once with ``partial_rollout=keep|recompute``
       (the sessions in flight decode on with it, ``recompute`` after re-prefilling their
       contexts with it: their tokens span versions); with ``false`` a push
       holds admission until no session holds the old weights, then is installed (no
       trajectory spans versions; the slots drain once per push).
    2. **Draw.** When every queued session of the submitted batches holds a slot, the next
       batch's prompts are drawn (``dataset_item``) and submitted.
    3. **Admit + decode** one driver round. A prompt of batch ``k`` is admitted only if batch
       ``k`` can still be trained within ``max_staleness``: the learner version it will be
       consumed at (the queue's count, with the batches before it in flight) minus the weight
       version it is prefilled with, by :func:`rljax.loss.staleness_gate`
       (:meth:`TrajectoryQueue.admits`). With ``max_staleness=0`` batch ``k+1`` starts only
       after the push of step ``k``: the synchronous schedule, the same tokens.
    4. **Complete.** A batch whose sessions all finished (whole groups: group advantages see
       every session) is scored (``reward``) and put into the queue, in batch order.

    Idle (every queued prompt refused, nothing decoding) it waits for the learner and counts
    the time in ``async/rollout_wait_s``. Checkpoints: as :class:`Producer` (the data position
    after the last trained batch; the prompts of later batches in flight are generated again
    after ``--resume``, none lost, none trained twice).
    """

    def __init__(self, services, queue: TrajectoryQueue, weights: WeightPush, *, first_index: int):
        super().__init__(services, queue, weights, first_index=first_index)
        self.partial = partial_mode(services.cfg) != "false"
        self.stream = None
        self._drawn: dict[int, _Drawn] = {}
        self._done: Optional[tuple] = None  # (drawn, batch, trajectories) of the batch being completed
        sync = {s.name: s for s in S.sync_stages(services)}
        scoring = [sync["reward"]] if "reward" in producer_stages(services.cfg) else []
        # the synchronous stages' declarations and trace facts, over what the rounds did
        self.runner = StepRunner([dataclasses.replace(sync["dataset_item"], fn=self._drawn_fields, updates_state=False),
                                  dataclasses.replace(sync["rollout_sessions"], fn=self._streamed), *scoring,
                                  enqueue_stage(self._enqueue_facts)])

    def _drawn_fields(self, b) -> dict:
        drawn, _, traj = self._done
        real = ~np.asarray(traj.is_padding)
        return {"prompts": drawn.prompts, "uids": drawn.uids,
                "weight_version": int(np.asarray(traj.min_version)[real].min())}

    def _streamed(self, b) -> dict:
        return {"trajectories": self._done[2]}

    def _enqueue_facts(self, b) -> dict:
        facts = super()._enqueue_facts(b)
        _, batch, traj = self._done
        facts["enqueue"].update(streaming=True, admitted_ahead=int(batch.admitted_ahead),
                                slot_occupancy=float(traj.stats.slot_occupancy))
        return facts

    def _admit(self, batch) -> bool:
        if not self.partial and self.weights.latest_version(self.services.rollout.sampler) > self.stream.driver.version:
            return False  # a push waits for the slots to drain
        return self.queue.admits(self._ahead(batch), self.stream.driver.version)

    def _make_stream(self):
        """The run's stream: single-turn rollouts or multi-turn episodes, gated by :meth:`_admit`."""
        r, n = self.services.rollout, self.services.cfg.rollout.n
        if r.env is None:
            return r.sampler.stream(r.decode, n=n, admit=self._admit)
        return r.env.stream(r.sampler, n=n, decode=r.decode, tokenizer=r.tokenizer, admit=self._admit)

    def _ahead(self, batch) -> int:
        """The batches before ``batch`` in flight, not yet queued."""
        return sum(1 for b in self.stream.batches if b.key < batch.key)

    def _maybe_draw(self) -> None:
        """Draws the next batch once every queued session of the submitted ones holds a slot."""
        if not self.stream.driver.waiting:
            self._draw()

    def _round(self) -> list:
        """One stream round; the queue items of the batches it completed, in batch order."""
        return [self._complete(batch, traj) for batch, traj in self.stream.step()]

    def _install(self) -> None:
        if self.partial or not self.stream.driver.holding:
            self.install_pending()

    def _draw(self) -> None:
        t = time.perf_counter()
        index = self.next_index
        d = S.draw_prompts(self.services, {"step": index})
        self._drawn[index] = _Drawn(d["prompts"], d["uids"], self.services.rollout.prompts.state(), t,
                                    time.perf_counter() - t)
        episodes = self.services.rollout.env is not None  # an episode's environment reads the prompt's text and answer
        self.stream.submit(index, d["prompts"] if episodes else [p.ids for p in d["prompts"]], d["uids"])
        self.next_index += 1

    def _complete(self, batch, traj) -> QueueItem:
        drawn = self._drawn.pop(batch.key)
        t_done = time.perf_counter()
        self._done = (drawn, batch, traj)
        try:
            produced = self.runner.produce(batch.key, {"step": batch.key})
        finally:
            self._done = None
        return _streamed_item(batch.key, produced, traj, t_draw=drawn.t_draw, draw_s=drawn.draw_s,
                              t_submit=batch.t_submit, t_done=t_done, data_after=drawn.data_after)

    def _loop(self) -> None:
        q = self.queue
        try:
            with self.sampler_lock:
                self.install_pending()
                self.stream = self._make_stream()
            while not self._stop.is_set():
                while self.pause_requested.is_set() and not self._stop.is_set():
                    time.sleep(0.005)
                with self.sampler_lock:
                    if self._stop.is_set():
                        break
                    self._install()
                    self._maybe_draw()
                    items = self._round()
                    idle = not items and not self.stream.active
                for item in items:
                    q.put(item)
                del items
                if idle:  # every queued prompt refused: wait for the learner (a taken batch, a push)
                    t = time.perf_counter()
                    q.wait_change(0.05)
                    q.add_rollout_wait(time.perf_counter() - t)
        except QueueClosed:
            pass
        except BaseException as e:  # noqa: BLE001 -- the learner re-raises it
            log.error("rljax: the rollout thread failed: %s: %s", type(e).__name__, e)
            q.close(e)
        finally:
            if self.stream is not None:
                self.stream.close()  # multi-turn: its environment threads


@dataclasses.dataclass(eq=False)
class _Draw:
    """One prompt batch drawn for a batch being filled (``algorithm.filter_groups``), its groups
    scored as they complete."""

    batch: Any  # its StreamBatch
    prompts: list
    uids: list
    data_after: Any  # the data iterator's position after this draw
    groups: "_Groups"  # its prompt groups as they are scored
    shaped: np.ndarray  # per row: the score placed (task + overlong shaping)
    digests: np.ndarray  # per row: the digest of the tokens scored
    traj: Any = None  # the whole draw, once every session finished

    @property
    def complete(self) -> bool:
        return self.traj is not None and all(k is not None for k in self.groups.keep)


@dataclasses.dataclass(eq=False)
class _Groups:
    """A draw's prompt groups as they are scored (:meth:`FilteredStreamingProducer._score`)."""

    keep: list  # per group: None (not yet complete), True, False
    first: np.ndarray  # per group: its first real row's metric value
    count: np.ndarray  # per group: real rows
    reports: dict = dataclasses.field(default_factory=dict)  # group -> its reward report

    @classmethod
    def unscored(cls, num_groups: int) -> "_Groups":
        return cls([None] * num_groups, np.zeros(num_groups, np.float64), np.zeros(num_groups, np.int32))

    def facts(self) -> dict:
        """The keep flags and facts :func:`~rljax.trainer.dynamic_sampling.streamed_rollout` reads."""
        return {"keep": np.asarray(self.keep, bool), "first": self.first, "count": self.count}


@dataclasses.dataclass(eq=False)
class _Filling:
    """A batch being filled with kept groups: its draws, contiguous in the data order."""

    index: int
    draws: list
    t_draw: float
    draw_s: float = 0.0
    marks: tuple = (0, 0)  # the driver's (live slot-steps, slot-steps) when its first draw was submitted


class FilteredStreamingProducer(StreamingProducer):
    """Streaming admission with DAPO dynamic sampling (``algorithm.filter_groups``, one process).

    A batch is filled with kept groups: as each prompt group's sessions all finish it is scored
    (the step's task reward and overlong shaping) and its metric's variance checked
    (:func:`rljax.trainer.dynamic_sampling.group_facts`: the synchronous rule); the batch is queued
    once its first ``data.train_batch_size`` kept groups, in draw and group order, are known and
    every session of its draws finished (:func:`~rljax.trainer.dynamic_sampling.streamed_rollout`:
    the synchronous accounting, dropped and excess uids with their reasons).

    Draws. A batch's prompt batches come from the data iterator in order and stay contiguous: a
    further prompt batch is drawn for it only when even keeping every undecided group would leave
    it short (:func:`~rljax.trainer.dynamic_sampling.fill_state`) -- as soon as a group is dropped,
    not after the whole draw -- and the next batch's first draw only once the batch is full. So
    the draws, their uids (``{batch}-{draw * size + i}``) and the data position after a batch are
    the synchronous filter's, and a resume restarts at the oldest untrained batch's first draw.
    ``max_num_gen_batches`` bounds the draws per batch with the synchronous error. A draw's
    sessions take free slots while the previous draw's tail decodes; the next batch's prompts take
    them while the full batch's excess groups finish, under the staleness gate.
    """

    def __init__(self, services, queue: TrajectoryQueue, weights: WeightPush, *, first_index: int):
        super().__init__(services, queue, weights, first_index=first_index)
        cfg = services.cfg
        self.fg, self.want, self.n = cfg.algorithm.filter_groups, int(cfg.data.train_batch_size), int(cfg.rollout.n)
        self._fill: list[_Filling] = []  # batches being filled, oldest first
        self._out: Optional[dict] = None  # the rollout outputs of the batch being completed

    def _ahead(self, batch) -> int:
        return sum(1 for f in self._fill if f.index < batch.key[0])

    def _make_stream(self):
        stream = super()._make_stream()
        # the next batch is drawn only once a batch is full, so the queue empties at each batch's tail: a
        # compacted decode state would keep its smaller width for every later batch (the driver never grows)
        stream.driver.compact = False
        return stream

    def _maybe_draw(self) -> None:
        if self.stream.driver.waiting:
            return
        f = self._fill[-1] if self._fill else None
        if f is not None:
            full, kept, undecided, zero = ds.fill_state([d.groups.keep for d in f.draws], self.want)
            if not full:
                if kept + undecided >= self.want:
                    return  # the groups in flight may fill it: no further draw yet, the next batch's neither
                if self.fg.max_num_gen_batches and len(f.draws) >= self.fg.max_num_gen_batches:
                    if undecided == 0:
                        raise ds.too_few_kept(f.index, kept, len(f.draws), zero, want=self.want, fg=self.fg)
                    return
                self._draw_for(f)
                return
        self._draw_for(None)

    def _draw_for(self, f: Optional[_Filling]) -> None:
        """A further prompt batch for ``f``, or the first of the next batch."""
        s = self.services
        t = time.perf_counter()
        if f is None:
            d = S.draw_prompts(s, {"step": self.next_index})
            prompts, uids = d["prompts"], d["uids"]
            f = _Filling(self.next_index, [], t, marks=(self.stream.driver.live_slot_steps, self.stream.driver.slot_steps))
            self._fill.append(f)
            self.next_index += 1
        else:
            prompts = list(next(s.rollout.prompts))
            uids = [f"{f.index}-{len(f.draws) * self.want + i}" for i in range(len(prompts))]
        data_after = s.rollout.prompts.state()
        f.draw_s += time.perf_counter() - t
        episodes = s.rollout.env is not None
        batch = self.stream.submit((f.index, len(f.draws)), prompts if episodes else [p.ids for p in prompts], uids)
        g, rows = len(prompts), len(prompts) * self.n
        f.draws.append(_Draw(batch, list(prompts), list(uids), data_after, _Groups.unscored(g), np.zeros(rows, np.float32),
                             np.zeros(rows, np.uint32)))

    def _score(self, d: _Draw, groups: list) -> None:
        """Scores whole groups of a draw (each on its own, so a draw's merged report is the synchronous one)."""
        s, n = self.services, self.n
        sub = ds.take_groups(d.traj, groups) if d.traj is not None else self.stream.take(d.batch, groups)
        for i, g in enumerate(groups):
            traj, prompts = ds.take_groups(sub, [i]), [d.prompts[g]]
            if s.rollout.env is not None:  # the episode's reward; the bound applies to the whole draw (below)
                task, report = episode_scores(traj, s.reward.fn, prompts, max_error_fraction=1.0)
            else:
                task, report = S.score(s, traj, prompts, max_error_fraction=1.0)
            shaped = np.asarray(S.overlong_shaping(s, traj, task), np.float32)
            facts = ds.group_facts(traj, task if self.fg.metric == "acc" else shaped)
            d.groups.keep[g], d.groups.first[g], d.groups.count[g] = (bool(facts["keep"][0]), facts["first"][0],
                                                                      facts["count"][0])
            d.shaped[g * n:(g + 1) * n], d.digests[g * n:(g + 1) * n] = shaped, S.response_digest(traj)
            d.groups.reports[g] = report

    def _round(self) -> list:
        draws = {d.batch.key: d for f in self._fill for d in f.draws}
        for batch, traj in self.stream.step():
            draws[batch.key].traj = traj
        for d in draws.values():
            new = [g for g in d.batch.groups_done if d.groups.keep[g] is None]
            if new:
                self._score(d, new)
                if d.complete:  # the reward bound over the whole draw, as the synchronous filter scores it
                    self._report(d).check(self.s_bound)
        items = []
        while self._fill and all(d.complete for d in self._fill[0].draws) and \
                ds.fill_state([d.groups.keep for d in self._fill[0].draws], self.want)[0]:
            items.append(self._complete_filled(self._fill.pop(0)))
        return items

    @property
    def s_bound(self) -> float:
        return float(self.services.cfg.reward.max_error_fraction)

    @staticmethod
    def _report(d: _Draw):
        return ds.merge_reports([d.groups.reports[g] for g in range(len(d.groups.keep))])

    def _streamed(self, b) -> dict:
        return self._out

    def _complete_filled(self, f: _Filling) -> QueueItem:
        t_done = time.perf_counter()
        out = ds.streamed_rollout(
            [{"traj": d.traj, "facts": d.groups.facts(),
              "shaped": d.shaped, "digests": d.digests, "report": self._report(d), "prompts": d.prompts,
              "uids": d.uids} for d in f.draws], want=self.want, metric=self.fg.metric, share=self.services.rollout.share)
        drv = self.stream.driver
        steps = drv.slot_steps - f.marks[1]
        first = f.draws[0]
        traj = out["trajectories"]
        # the batch's generation: from its first draw's submission to now, its draws overlapping other batches'
        traj = traj.replace(stats=dataclasses.replace(
            traj.stats, wall_s=t_done - first.batch.t_submit,
            slot_occupancy=(drv.live_slot_steps - f.marks[0]) / steps if steps else float("nan")))
        out = dict(out, trajectories=traj)
        ahead = types.SimpleNamespace(admitted_ahead=sum(d.batch.admitted for g in self._fill for d in g.draws))
        self._out, self._done = out, (_Drawn(first.prompts, first.uids, first.data_after, f.t_draw, f.draw_s), ahead,
                                      traj)
        try:
            produced = self.runner.produce(f.index, {"step": f.index})
        finally:
            self._out = self._done = None
        return _streamed_item(f.index, produced, traj, t_draw=f.t_draw, draw_s=f.draw_s, t_submit=first.batch.t_submit,
                              t_done=t_done, data_after=f.draws[-1].data_after)


class AsyncSchedule:
    """The asynchronous scheduler: a :class:`Producer` thread, the queue, and the learner's stage
    list over the :class:`~rljax.trainer.state.RunState` (see the module docstring).

    Args:
      services: the run's services (:func:`rljax.trainer.build.build`).
      state: the state the run starts from (restored or fresh): its weight version starts the
        queue, its ``produced`` index the producer.
      stages: the synchronous stage list (the learner runs all but the producer's stages).
      observers: the learner runner's observers (the trace).
    """

    def __init__(self, services, state, stages, observers=()):
        at = services.cfg.async_training
        check_async_share(services.rollout.share, ",".join(f"{k}{v}" for k, v in services.mesh.shape.items()))
        self.services, self.cfg = services, at
        self.queue = TrajectoryQueue(at.queue_size, at.max_staleness, at.overflow, start_version=state.version)
        self.weights = WeightPush()
        self.streaming = streams(services)
        if at.streaming and not self.streaming:
            log.info("rljax: async_training.streaming does not apply (%s); this run generates one batch per call",
                     streaming_limit(services))
        producer = Producer
        if self.streaming:
            producer = FilteredStreamingProducer if services.cfg.algorithm.filter_groups.enable else StreamingProducer
        self.producer = producer(services, self.queue, self.weights, first_index=state.produced)
        self.runner = StepRunner(self._learner_stages(stages), observers=observers)
        self._rollout_wait_prev = 0.0
        self._dropped_seen = 0  # the queue's dropped batches already reported (rollout_uids.jsonl)
        self._global_facts: Optional[dict] = None

    def _learner_stages(self, stages) -> list[Stage]:
        out = [Stage("dequeue", self._dequeue_facts, "dequeue", reads=("queue_item",), writes=("dequeue",),
                     facts=queue_facts)]
        for s in stages:
            if s.name in producer_stages(self.services.cfg):
                continue
            if s.name == "weight_sync":
                s = dataclasses.replace(s, fn=self._weight_push, writes=(*s.writes, "weight_pushed"))
            if s.name == "gather_rollout":  # several processes: the staleness facts of every process's rows
                s = dataclasses.replace(s, fn=lambda b, fn=s.fn: self._gather_rollout(fn, b),
                                        reads=(*s.reads, "dequeue"), writes=(*s.writes, "dequeue"))
            out.append(s)
        return out

    def _dequeue_facts(self, b) -> dict:
        self._global_facts = None
        return {"dequeue": dict(b["queue_item"])}

    def _gather_rollout(self, fn, b) -> dict:
        """The synchronous ``gather_rollout``, then the dequeue facts over every process's rows
        (each process's queue holds its own share of a batch; the learner trains all of them)."""
        out = dict(fn(b))
        rows = out["rollout_rows"]
        facts = dict(b["dequeue"])
        real = ~np.asarray(rows.is_padding)
        facts.update(staleness_facts(facts["learner_version"], np.asarray(rows.min_version)[real],
                                     np.asarray(rows.max_version)[real]))
        facts["version_span_max"] = int(np.asarray(rows.version_span)[real].max(initial=0))  # every process's rows
        self._global_facts = facts
        out["dequeue"] = facts
        return out

    def _weight_push(self, state, b):
        """``weight_sync``: the learner version advances every step; every
        ``trigger_parameter_sync_step`` versions the weights are resharded here (a copy: the
        learner donates its buffers) and handed to the producer to install."""
        state = state.replace(version=state.version + 1)
        pushed = state.version % self.cfg.trigger_parameter_sync_step == 0
        sync_s = 0.0
        if pushed:
            t = time.perf_counter()
            r = self.services.rollout
            params = r.sampler.engine.load_params(r.to_sampler(state.actor.params))
            jax.block_until_ready(params)
            sync_s = time.perf_counter() - t
            self.weights.put(params, state.version)
        self.queue.set_learner_version(state.version)
        return state, {"weight_version_after": state.version, "sampler_version": self.producer.latest_version(),
                       "weight_pushed": pushed, "weight_sync_s": sync_s}

    # ------------------------------------------------------------------ the learner's step

    def step(self, state, step: int):
        """``(state, metrics, timings)`` of learner step ``step``: the next batch the staleness gate
        accepts, trained; the state records the data position after that batch and the
        producer's index to resume from (in-flight batches are replayed after a resume)."""
        self.producer.start()
        seed, prior, (data_after, index_after) = self._next_batch(step, state.version)
        facts = seed["queue_item"]
        state, metrics, timings = self.runner.run_state(state.replace(step=step), step, seed, prior)
        del prior
        metrics.update(self._metrics(facts))
        return state.replace(data=data_after, produced=index_after), metrics, timings

    def _next_batch(self, step: int, version: int):
        t = time.perf_counter()
        item = self.queue.get(version)
        wait = time.perf_counter() - t
        produced, data_after = item.payload
        item.payload = None
        st = self.queue.stats
        rollout_wait = st.rollout_wait_s - self._rollout_wait_prev
        self._rollout_wait_prev = st.rollout_wait_s
        # the batches dropped since the last one trained, and the data position after this batch's draw:
        # rollout_uids.jsonl records both, so trace check proves every prompt of the data order trained once
        dropped, self._dropped_seen = st.dropped_batches[self._dropped_seen:], len(st.dropped_batches)
        facts = {"batch_index": item.index, "learner_version": version, "max_staleness": self.queue.max_staleness,
                 **staleness_facts(version, np.asarray(item.min_version), np.asarray(item.max_version)),
                 "queue_depth": len(self.queue), "learner_wait_s": wait, "rollout_wait_s": rollout_wait,
                 "dropped_stale": st.dropped_stale, "dropped_overflow": st.dropped_overflow,
                 "generated_rows": st.put_rows, "streaming": self.streaming,
                 "admitted_ahead": int(produced.batch["enqueue"].get("admitted_ahead", 0)),
                 "version_span_max": int(produced.batch["enqueue"].get("version_span_max", 0)),
                 "dropped_batches": [list(d) for d in dropped], "data_after": dict(data_after)}
        return {"step": step, "queue_item": facts}, produced, (data_after, item.index + 1)

    def _metrics(self, facts: dict) -> dict:
        """``async/*`` of the step (staleness over every process's rows; queue and wait times this process's)."""
        facts = self._global_facts or facts
        return {"async/staleness_mean": facts["staleness_mean"], "async/staleness_max": facts["staleness_max"],
                "async/dropped_stale": facts["dropped_stale"], "async/dropped_overflow": facts["dropped_overflow"],
                "async/generated_rows": facts.get("generated_rows"),
                "async/queue_depth": facts["queue_depth"], "async/learner_wait_s": facts["learner_wait_s"],
                "async/rollout_wait_s": facts["rollout_wait_s"], "async/min_version": facts["min_version"],
                "async/max_version": facts["max_version"], "async/spanning_rows": facts["spanning_rows"],
                "async/version_span_max": facts.get("version_span_max", 0),
                "async/batch_index": facts["batch_index"], "async/weight_pushes": self.weights.pushes,
                "async/staleness_hist": facts["staleness_hist"],
                "rollout/admitted_ahead": facts.get("admitted_ahead", 0)}

    # ------------------------------------------------------------------ around the steps

    @contextlib.contextmanager
    def paused(self):
        """Validation: the rollout thread pauses; the newest pushed weights are installed first."""
        self.producer.pause_requested.set()
        try:
            with self.producer.sampler_lock:
                self.producer.install_pending()
                yield
        finally:
            self.producer.pause_requested.clear()

    def checkpoint_meta(self, state) -> dict:
        return {"async": {"policy": "replay", "streaming": self.streaming, "next_index": state.produced,
                          "dropped_stale": self.queue.stats.dropped_stale,
                          "dropped_overflow": self.queue.stats.dropped_overflow}}

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> Optional[dict]:
        """Stops and joins the producer; the queue's totals (for the trace summary)."""
        self.producer.close(timeout)
        self.queue.drain()
        return self.queue.stats.snapshot()
