"""The producer side of ``trainer.mode=async``: one thread, several batch sources.

A :class:`~rljax.trainer.producers.thread.ProducerThread` runs one
:class:`~rljax.trainer.producers.base.Source` (a strategy), chosen once by :func:`source_for`:

* :class:`~rljax.trainer.producers.batched.Batched`: one batch per call, the producer's
  synchronous stages run as they are (``async_training.streaming=false``, or a rollout
  streaming does not apply to);
* :class:`~rljax.trainer.producers.streaming.Streaming`: streaming admission, later batches'
  prompts in the slots a batch's tail frees;
* :class:`~rljax.trainer.producers.filtered.Filtered`: streaming with DAPO dynamic sampling
  (``algorithm.filter_groups``), batches filled with kept groups.

Each returns complete batch records through one interface: a queue item whose payload is the
:class:`~rljax.trainer.runner.Produced` record of the producer's stages (fields, stage events
with their trace facts, timings) and the data position after the batch. The learner
(:class:`rljax.trainer.async_loop.AsyncSchedule`) replays that record before its own stages.
A new way to produce batches is a new module here with a ``Source`` subclass, one line in
:func:`source_for`, and its test (``docs/development.md``).
"""

from __future__ import annotations

from rljax.trainer.producers.base import (Source, enqueue, partial_mode, producer_stage_names, queue_item,
                                          rollout_state, streaming_limit, streams)
from rljax.trainer.producers.batched import Batched
from rljax.trainer.producers.filtered import Filtered
from rljax.trainer.producers.streaming import Streaming
from rljax.trainer.producers.thread import ProducerThread


def source_for(services, queue, weights, *, first_index: int) -> Source:
    """This run's batch source: streaming where it applies (:func:`streams`), filtered with
    ``algorithm.filter_groups``; else one batch per call."""
    if not streams(services):
        kind = Batched
    elif services.cfg.algorithm.filter_groups.enable:
        kind = Filtered
    else:
        kind = Streaming
    return kind(services, queue, weights, first_index=first_index)


__all__ = ["Batched", "Filtered", "ProducerThread", "Source", "Streaming", "enqueue", "partial_mode",
           "producer_stage_names", "queue_item", "rollout_state", "source_for", "streaming_limit", "streams"]
