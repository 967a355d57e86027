"""Streaming admission (``async_training.streaming``, the default where it applies).

The source keeps one stream over the rollout driver for the run (the run's rollout client:
a :class:`~rljax.rollout.stream.RolloutStream` of single-turn rollouts, or an
``EpisodeStream`` of multi-turn episodes with ``env.continuation=kv``: a session parked on its
environment keeps its slot, an ended episode frees it), so the slots a batch's long tail
frees take the next batches' prompts instead of idling until the batch is complete.

Each round (under the sampler lock, so validation can pause it between rounds):

1. **Weights.** A pushed version is installed at once with ``partial_rollout=keep|recompute``
   (the sessions in flight decode on with it, ``recompute`` after re-prefilling their
   contexts with it: their tokens span versions); with ``false`` a push holds admission
   until no session holds the old weights, then is installed (no trajectory spans versions;
   the slots drain once per push).
2. **Draw.** When every queued session of the submitted batches holds a slot, the next
   batch's prompts are drawn (:func:`~rljax.trainer.stages.draw_prompts`) and submitted.
3. **Admit + decode** one driver round. A prompt of batch ``k`` is admitted only if batch
   ``k`` can still be trained within ``max_staleness``: the learner version it will be
   consumed at (the queue's count, with the batches before it in flight) minus the weight
   version it is prefilled with, by :func:`rljax.loss.staleness_gate`
   (:meth:`~rljax.rollout.queue.TrajectoryQueue.admits`). With ``max_staleness=0`` batch
   ``k+1`` starts only after the push of step ``k``: the synchronous schedule, the same tokens.
4. **Complete.** A batch whose sessions all finished (whole groups: group advantages see
   every session) becomes a record: the draw and the generation the rounds did are handed to
   the producer's runner as the ``dataset_item`` and ``rollout_sessions`` stages' outputs
   (:class:`~rljax.trainer.runner.Done`, with their real time windows, overlapping other
   batches'), then ``reward`` runs and the batch is queued, in batch order.

Idle (every queued prompt refused, nothing decoding) the thread waits for the learner.
Checkpoints: the data position after the last trained batch; the prompts of later batches in
flight are generated again after ``--resume``, none lost, none trained twice.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from rljax.trainer.producers.base import Source, partial_mode, queue_item
from rljax.trainer.runner import Done
from rljax.trainer.stages import draw_prompts


@dataclasses.dataclass
class Drawn:
    """A batch's prompts as drawn, before generation."""

    prompts: list
    uids: list
    data_after: Any  # the data iterator's position after the draw
    t_draw: float  # perf_counter: the draw started
    draw_s: float


class StreamSource(Source):
    """What the streaming sources share: the run's stream, gated by the staleness admission."""

    streaming = True

    def __init__(self, services, queue, weights, *, first_index: int):
        super().__init__(services, queue, weights, first_index=first_index)
        self.partial = partial_mode(services.cfg) != "false"
        self.stream = None

    def open(self) -> None:
        self.install_pending()
        self.stream = self.make_stream()

    def make_stream(self):
        r, n = self.services.rollout, self.services.cfg.rollout.n
        return r.client.stream(n=n, decode=r.decode, admit=self.admit)

    def admit(self, batch) -> bool:
        if not self.partial and self.latest_version() > self.stream.driver.version:
            return False  # a push waits for the slots to drain
        return self.queue.admits(self.ahead(batch), self.stream.driver.version)

    def ahead(self, batch) -> int:
        """The batches before ``batch`` in flight, not yet queued."""
        return sum(1 for b in self.stream.batches if b.key < batch.key)

    def round(self) -> list:
        if self.partial or not self.stream.driver.holding:
            self.install_pending()
        self.maybe_draw()
        return self.decode_round()

    def idle(self, items: list) -> bool:
        return not items and not self.stream.active

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()  # multi-turn: its environment threads

    def record(self, index: int, outputs: dict, drawn: Drawn, t_submit: float, t_done: float, *,
               admitted_ahead: int, data_after):
        """The queue item of a completed batch: the rounds' draw and generation as the first two
        stages' outputs, then the rest of the producer's stages."""
        traj = outputs["trajectories"]
        real = ~np.asarray(traj.is_padding)
        done = {"dataset_item": Done({"prompts": drawn.prompts, "uids": drawn.uids,
                                      "weight_version": int(np.asarray(traj.min_version)[real].min())},
                                     drawn.t_draw, drawn.t_draw + drawn.draw_s),
                "rollout_sessions": Done(outputs, t_submit, t_done)}
        produced = self.runner.produce(index, {"step": index, "admitted_ahead": admitted_ahead}, done=done)
        return queue_item(index, produced, data_after)

    def maybe_draw(self) -> None:
        raise NotImplementedError

    def decode_round(self) -> list:
        raise NotImplementedError


class Streaming(StreamSource):
    """Streaming admission of whole batches (see the module docstring)."""

    def __init__(self, services, queue, weights, *, first_index: int):
        super().__init__(services, queue, weights, first_index=first_index)
        self._drawn: dict[int, Drawn] = {}

    def maybe_draw(self) -> None:
        """Draws the next batch once every queued session of the submitted ones holds a slot."""
        if self.stream.driver.waiting:
            return
        t = time.perf_counter()
        index = self.next_index
        d = draw_prompts(self.services, {"step": index})
        self._drawn[index] = Drawn(d["prompts"], d["uids"], self.services.rollout.prompts.state(), t,
                                   time.perf_counter() - t)
        self.stream.submit(index, self.services.rollout.client.submitted(d["prompts"]), d["uids"])
        self.next_index += 1

    def decode_round(self) -> list:
        """One stream round; the queue items of the batches it completed, in batch order."""
        items = []
        for batch, traj in self.stream.step():
            drawn = self._drawn.pop(batch.key)
            items.append(self.record(batch.key, {"trajectories": traj}, drawn, batch.t_submit, time.perf_counter(),
                                     admitted_ahead=int(batch.admitted_ahead), data_after=drawn.data_after))
        return items
