"""What every batch source shares: the producer's stage list, the ``enqueue`` stage, the queue item.

A source (:mod:`~rljax.trainer.producers.batched`, :mod:`~rljax.trainer.producers.streaming`,
:mod:`~rljax.trainer.producers.filtered`) is driven by the producer thread
(:class:`~rljax.trainer.producers.thread.ProducerThread`) through :class:`Source`'s methods and
returns complete batch records: :class:`~rljax.rollout.queue.QueueItem` whose payload is the
:class:`~rljax.trainer.runner.Produced` record of the producer's stages (fields, stage events,
timings) and the data position after the batch's draws.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from rljax.rollout.queue import QueueItem, TrajectoryQueue
from rljax.trainer.distribute import version_spans
from rljax.trainer.runner import Produced, StepRunner, stage
from rljax.trainer.staleness import queue_facts
from rljax.trainer.stages import sync_stages
from rljax.trainer.state import RunState
from rljax.trainer.weights import WeightPush


def producer_stage_names(cfg) -> tuple[str, ...]:
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


def rollout_state(version: int) -> RunState:
    """The run state as the producer sees it: the weight version its sampler holds (what
    ``dataset_item`` records as the batch's); the train states are the learner's."""
    return RunState(actor=None, critic=None, key=None, version=int(version))


@stage("enqueue", timing="enqueue", reads=("step", "trajectories", "admitted_ahead"), writes=("enqueue",),
       facts=queue_facts, options=("queue", "streaming"), only="trainer.mode=async, producer",
       summary="trajectories -> enqueue (the batch into the queue: index, depth, versions)")
def enqueue(s, b, *, queue: TrajectoryQueue, streaming: bool = False) -> dict:
    """The producer's last stage: facts about the batch put into the queue (streaming: the prompts
    of later batches admitted while it decoded, ``admitted_ahead`` in the seed, and its slot
    occupancy)."""
    traj = b["trajectories"]
    real = ~np.asarray(traj.is_padding)
    facts = {"batch_index": int(b["step"]), "queue_depth_before": len(queue),
             "min_version": int(np.asarray(traj.min_version)[real].min()),
             "max_version": int(np.asarray(traj.max_version)[real].max()),
             "version_span_max": int(version_spans(traj).max(initial=0)),
             "sampler_version": int(s.rollout.sampler.version)}
    if streaming:
        facts.update(streaming=True, admitted_ahead=int(b["admitted_ahead"]),
                     slot_occupancy=float(traj.stats.slot_occupancy))
    return {"enqueue": facts}


def queue_item(index: int, produced: Produced, data_after) -> QueueItem:
    """The queue item of a produced batch: its real rows' versions and uids, the record as payload."""
    traj = produced.batch["trajectories"]
    real = ~np.asarray(traj.is_padding)
    return QueueItem(index=index, min_version=np.asarray(traj.min_version)[real].tolist(),
                     max_version=np.asarray(traj.max_version)[real].tolist(),
                     uids=[str(u) for u in np.asarray(traj.uid, dtype=object)[real]],
                     payload=(produced, data_after))


class Source:
    """A batch source: what the producer thread calls, in this order, on its thread.

    ``open()`` once, under the sampler lock; then per round ``wait_turn()`` (outside the lock:
    admission), ``round()`` (under the lock: the queue items the round completed, in batch
    order), ``idle(items)`` (nothing to do until the learner moves); ``abandon()`` when a round
    is not run or fails after ``wait_turn`` admitted it; ``close()`` at the end.
    """

    streaming = False

    def __init__(self, services, queue: TrajectoryQueue, weights: WeightPush, *, first_index: int):
        self.services, self.queue, self.weights = services, queue, weights
        self.next_index = first_index
        sampler = services.rollout.sampler
        on_chunk = (lambda info: weights.install(sampler)) if partial_mode(services.cfg) != "false" else None
        names = producer_stage_names(services.cfg)
        stages = [st for st in sync_stages(services, on_chunk=on_chunk) if st.name in names]
        self.runner = StepRunner([*stages, enqueue.stage.bind(services, queue=queue, streaming=self.streaming)])

    def latest_version(self) -> int:
        return self.weights.latest_version(self.services.rollout.sampler)

    def install_pending(self) -> None:
        self.weights.install(self.services.rollout.sampler)

    def open(self) -> None:
        pass

    def wait_turn(self) -> None:
        pass

    def round(self) -> list:
        raise NotImplementedError

    def idle(self, items: list) -> bool:
        return False

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


def streaming_limit(services) -> Optional[str]:
    """Why ``async_training.streaming`` does not apply to this run (the line the log gives), or
    ``None``: the run's rollout client says (single-turn rollouts and multi-turn episodes with
    ``env.continuation=kv`` stream)."""
    return services.rollout.client.streaming_limit


def streams(services) -> bool:
    """Whether this run's producer streams: ``async_training.streaming`` and a rollout it applies
    to; else one batch per ``generate`` call."""
    return bool(services.cfg.async_training.streaming) and streaming_limit(services) is None


__all__ = ["Source", "enqueue", "partial_mode", "producer_stage_names", "queue_item", "rollout_state",
           "streaming_limit", "streams"]
