"""Asynchronous training (``trainer.mode=async``): the same stages, scheduled on two threads.

* **Producer** (a rollout thread, :mod:`rljax.trainer.producers`): a batch source (one batch
  per call, streaming, or streaming with dynamic sampling) runs ``dataset_item ->
  rollout_sessions -> reward -> enqueue`` (``reward`` on the learner with
  ``reward.model.path``: :func:`~rljax.trainer.producers.producer_stage_names`) and puts the
  complete batch record into the :class:`~rljax.rollout.queue.TrajectoryQueue` with its rows'
  ``min_version`` / ``max_version``. Before it starts a batch it waits for admission (the
  batch must be trainable within ``async_training.max_staleness``) and installs the newest
  pushed weights; with ``async_training.partial_rollout=keep|recompute`` it also installs
  pushes between decode chunks, so a trajectory may span versions (each token's in
  ``token_version``; ``recompute`` re-prefills the contexts in flight first).
* **Consumer** (the trainer's thread): takes the next batch the staleness gate accepts and
  runs ``dequeue`` then the synchronous stage list minus the producer's stages
  (``trajectory_fields -> old_log_prob -> ... -> weight_sync -> metrics``), bound to the
  run's services with the weight push as the weight publisher
  (:class:`~rljax.trainer.weights.WeightPush`): ``weight_sync`` advances the learner version
  every step and pushes weights every ``trigger_parameter_sync_step`` steps (resharded to the
  sampler layout on the learner's thread, installed by the producer). The producer's stage
  events are replayed to the observers first, so the trace shows the whole path of a group
  (``enqueue`` and ``dequeue`` records with versions and staleness).

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
producer stops at its next wait or after its current round; :meth:`AsyncSchedule.close`
joins the thread with a bound.

Checkpoints: the trajectories queued or in flight are not saved; the checkpoint records
the data position after the last batch the learner trained on and the producer's next
batch index, so after ``--resume`` the in-flight prompts are replayed (generated again,
with the restored weights). Batches dropped by the gate are not replayed (counted in
``async/dropped_*``). The checkpoint also holds the run's counters (``generated_rows``: the
rows put and no longer queued; ``weight_pushes``; ``dropped_stale`` / ``dropped_overflow``:
the rows of the batches before the producer's index dropped), which ``async/*`` continue from
after a resume; the rows of a batch from that index on (queued, or dropped after the last
trained batch) are not counted, as the resume generates that batch again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Optional

import numpy as np

from rljax.rollout.queue import TrajectoryQueue
from rljax.trainer.distribute import check_async_share
from rljax.trainer.producers import (ProducerThread, partial_mode, producer_stage_names, source_for,
                                     streaming_limit, streams)
from rljax.trainer.runner import Stage, StepRunner, stage
from rljax.trainer.staleness import queue_facts, staleness_facts
from rljax.trainer.stages import sync_stages
from rljax.trainer.weights import WeightPush

log = logging.getLogger("rljax")

JOIN_TIMEOUT_S = 30.0


@stage("dequeue", timing="dequeue", reads=("queue_item",), writes=("dequeue",), facts=queue_facts,
       only="trainer.mode=async, learner",
       summary="queue_item -> dequeue (the batch the staleness gate accepted: index, versions, staleness)")
def dequeue(s, b) -> dict:
    """The learner's first stage: the facts of the batch taken from the queue."""
    return {"dequeue": dict(b["queue_item"])}


class AsyncSchedule:
    """The asynchronous scheduler: a producer thread over the run's batch source, the queue, and
    the learner's stage list over the :class:`~rljax.trainer.state.RunState` (see the module
    docstring).

    Args:
      services: the run's services (:func:`rljax.trainer.build.build`).
      state: the state the run starts from (restored or fresh): its weight version starts the
        queue, its ``produced`` index the producer.
      observers: the learner runner's observers (the trace).
    """

    def __init__(self, services, state, observers=()):
        at, cfg = services.cfg.async_training, services.cfg
        check_async_share(services.rollout.share, ",".join(f"{k}{v}" for k, v in services.mesh.shape.items()),
                          filter_groups=bool(cfg.algorithm.filter_groups.enable))
        self.cfg = at
        self.queue = TrajectoryQueue(at.queue_size, at.max_staleness, at.overflow, start_version=state.version)
        self.weights = WeightPush(queue=self.queue, rollout=services.rollout, trigger=at.trigger_parameter_sync_step)
        # a resume continues the run's counters: the pushes (an older checkpoint: one per trigger versions) and the
        # rows generated before it (the queue counts this launch's)
        counts = state.async_counts or {}
        self.weights.pushes = counts.get("weight_pushes", state.version // self.weights.trigger)
        self._restored = {k: counts.get(k, 0) for k in ("generated_rows", "dropped_stale", "dropped_overflow")}
        self.services = dataclasses.replace(services, rollout=dataclasses.replace(services.rollout,
                                                                                  weights=self.weights))
        self.streaming = streams(services)
        if at.streaming and not self.streaming:
            log.info("rljax: async_training.streaming does not apply (%s); this run generates one batch per call",
                     streaming_limit(services))
        self.producer = ProducerThread(source_for(self.services, self.queue, self.weights, first_index=state.produced))
        self.runner = StepRunner(self.learner_stages(), observers=observers)
        self._rollout_wait_prev = 0.0
        self._dropped_seen = 0  # the queue's dropped batches already reported (rollout_uids.jsonl)

    def learner_stages(self) -> list[Stage]:
        """``dequeue``, then the synchronous stages the producer does not run."""
        produced = producer_stage_names(self.services.cfg)
        return [dequeue.stage.bind(self.services),
                *(st for st in sync_stages(self.services) if st.name not in produced)]

    # ------------------------------------------------------------------ the learner's step

    def step(self, state, step: int):
        """``(state, metrics, timings)`` of learner step ``step``: the next batch the staleness gate
        accepts, trained; the state records the data position after that batch and the
        producer's index to resume from (in-flight batches are replayed after a resume)."""
        self.producer.start()
        seed, prior, (data_after, index_after) = self._next_batch(step, state.version)
        state, metrics, timings = self.runner.run_state(state.replace(step=step), step, seed, prior)
        del prior
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
                 "generated_rows": st.put_rows, "generated_rows_restored": self._restored["generated_rows"],
                 "dropped_stale_restored": self._restored["dropped_stale"],
                 "dropped_overflow_restored": self._restored["dropped_overflow"],
                 "streaming": self.streaming,
                 "admitted_ahead": int(produced.batch["enqueue"].get("admitted_ahead", 0)),
                 "version_span_max": int(produced.batch["enqueue"].get("version_span_max", 0)),
                 "dropped_batches": [list(d) for d in dropped], "data_after": dict(data_after)}
        return {"step": step, "queue_item": facts}, produced, (data_after, item.index + 1)

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
        """The producer's position and the run's counters (the rows still queued, and those of the batches
        from the producer's position on dropped, are not counted: they are generated again after a resume)."""
        dropped = self.queue.dropped_rows(before=state.produced)
        return {"async": {"policy": "replay", "streaming": self.streaming, "next_index": state.produced,
                          "dropped_stale": self._restored["dropped_stale"] + dropped["stale"],
                          "dropped_overflow": self._restored["dropped_overflow"] + dropped["overflow"],
                          "generated_rows": self._restored["generated_rows"] + self.queue.rows_out(before=state.produced),
                          "weight_pushes": self.weights.pushes}}

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> Optional[dict]:
        """Stops and joins the producer; the queue's totals (for the trace summary)."""
        self.producer.close(timeout)
        self.queue.drain()
        return self.queue.stats.snapshot()


__all__ = ["AsyncSchedule", "JOIN_TIMEOUT_S", "WeightPush", "dequeue", "partial_mode"]
