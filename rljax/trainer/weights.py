"""Publishing the learner's weights to the rollout side, a service of the run.

The ``weight_sync`` stage advances the learner's version and hands the state to
``services.rollout.weights.publish(state)``:

* :class:`WeightSync` (``trainer.mode=sync``): the sampler installs the new weights now;
* :class:`WeightPush` (``trainer.mode=async``): every ``trigger_parameter_sync_step``
  versions the weights are resharded to the sampler layout on the learner's thread (a copy:
  the learner donates its buffers) and left for the producer thread, which owns the sampler,
  to install (:meth:`WeightPush.install`: before its next batch, or between decode chunks
  with ``async_training.partial_rollout``); the queue learns the learner's version.

``publish`` returns the fields ``weight_sync`` writes besides the version.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import jax

from rljax.trace import faults


class WeightSync:
    """Synchronous: the sampler installs each new version at once."""

    def __init__(self, sampler, to_sampler):
        self.sampler, self.to_sampler = sampler, to_sampler

    def publish(self, state) -> dict:
        self.sampler.update_weights(faults.sampler_weights(self.to_sampler(state.actor.params)), state.version)
        return {"sampler_version": int(self.sampler.version),
                "weight_sync_s": float(getattr(self.sampler, "last_weight_sync_s", 0.0))}


class WeightPush:
    """Asynchronous: the newest weights the learner pushed, until the producer installs them (its
    thread owns the sampler); ``pushes`` counts them. ``queue`` / ``rollout`` / ``trigger``: what
    :meth:`publish` needs (the trajectory queue, the run's rollout services,
    ``async_training.trigger_parameter_sync_step``)."""

    def __init__(self, *, queue=None, rollout=None, trigger: int = 1):
        self._pending: Optional[tuple[Any, int]] = None  # (params in the sampler layout, version)
        self._lock = threading.Lock()
        self.pushes = 0
        self.queue, self.rollout, self.trigger = queue, rollout, int(trigger)

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

    def publish(self, state) -> dict:
        """The learner version advanced to ``state.version``: every ``trigger`` versions the
        weights are resharded here and pushed; the queue's learner version follows."""
        pushed = state.version % self.trigger == 0
        sync_s = 0.0
        r = self.rollout
        if pushed:
            t = time.perf_counter()
            params = r.sampler.engine.load_params(r.to_sampler(state.actor.params))
            jax.block_until_ready(params)
            sync_s = time.perf_counter() - t
            self.put(params, state.version)
        self.queue.set_learner_version(state.version)
        return {"sampler_version": self.latest_version(r.sampler), "weight_pushed": pushed, "weight_sync_s": sync_s,
                "weight_pushes": self.pushes}
