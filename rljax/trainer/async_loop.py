"""Asynchronous training (``trainer.mode=async``): the same stages, scheduled on two threads.

* **Producer** (a rollout thread): ``dataset_item -> rollout_sessions -> reward`` (the
  functions of :mod:`rljax.trainer.stages`, run by a :class:`StepRunner` without
  observers, :meth:`StepRunner.produce`), then the complete batch is put into the
  :class:`~rljax.rollout.queue.TrajectoryQueue` with its rows' ``min_version`` /
  ``max_version``. Before it starts a batch it waits for admission (the batch must be
  trainable within ``async_training.max_staleness``) and installs the newest pushed
  weights; with ``async_training.partial_rollout`` it also installs pushes between decode
  chunks (``Components.on_chunk``), so a trajectory may span versions.
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

import dataclasses
import logging
import threading
import time
from typing import Any, Optional

import numpy as np

from rljax.rollout.queue import QueueClosed, QueueItem, TrajectoryQueue
from rljax.trainer.distribute import check_async_share
from rljax.trainer.runner import Stage, StepRunner
from rljax.trainer import stages as S

log = logging.getLogger("rljax")

#: The producer side's stages (the names of the synchronous step).
PRODUCER_STAGES = ("dataset_item", "rollout_sessions", "reward", "enqueue")
JOIN_TIMEOUT_S = 30.0


def staleness_facts(learner_version: int, min_version: np.ndarray, max_version: np.ndarray) -> dict:
    """The staleness of a trained batch's rows (``learner_version - min_version``): max, mean and
    histogram, the version range, and the rows whose generation spanned a weight push."""
    staleness = learner_version - min_version
    return {"staleness_max": int(staleness.max()), "staleness_mean": float(staleness.mean()),
            "min_version": int(min_version.min()), "max_version": int(max_version.max()),
            "spanning_rows": int((min_version < max_version).sum()),
            "staleness_hist": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))}}


@dataclasses.dataclass
class _Pending:
    params: Any  # already in the sampler layout
    version: int


class AsyncSchedule:
    """The producer thread, the queue and the consumer stage list of one trainer."""

    def __init__(self, trainer):
        self.trainer = trainer
        c = self.c = trainer.c
        at = trainer.cfg.async_training
        self.cfg = at
        check_async_share(S.rollout_share(c), ",".join(f"{k}{v}" for k, v in c.mesh.shape.items()))
        self.queue = TrajectoryQueue(at.queue_size, at.max_staleness, at.overflow, start_version=c.version)
        self._pending: Optional[_Pending] = None
        self._pending_lock = threading.Lock()
        #: Held by the producer while it generates and scores, and by validation.
        self.sampler_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.next_index = trainer.step + 1
        self.data_state = c.data.state()  # the data position after the last trained batch
        self._rollout_wait_prev = 0.0
        self.pushes = 0
        if at.partial_rollout:
            c.on_chunk = lambda info: self.install_pending()
        self.producer = StepRunner(self._producer_stages())
        self.stages = self._consumer_stages()

    # ------------------------------------------------------------------ stage lists

    def _producer_stages(self) -> list[Stage]:
        c = self.c

        def item(b):  # the synchronous dataset_item; the rollout version is the sampler's (not the learner's)
            return dict(S.dataset_item(c, b), weight_version=c.sampler.version)

        sync = {s.name: s for s in S.sync_stages(c)}  # the synchronous rollout and reward (multi-turn ones with env.*)
        return [Stage("dataset_item", item, "data"), sync["rollout_sessions"], sync["reward"],
                Stage("enqueue", self._enqueue_facts, "enqueue")]

    def _consumer_stages(self) -> list[Stage]:
        sync = {s.name: s for s in S.sync_stages(self.c)}
        out = [Stage("dequeue", self._dequeue_facts, "dequeue")]
        for s in sync.values():
            if s.name in ("dataset_item", "rollout_sessions", "reward"):
                continue
            if s.name == "weight_sync":
                s = Stage("weight_sync", self._weight_push, "update_weights")
            if s.name == "gather_rollout":  # several processes: the staleness facts of every process's rows
                s = Stage("gather_rollout", lambda b, fn=s.fn: self._gather_rollout(fn, b), s.timing)
            out.append(s)
        return out

    def _enqueue_facts(self, b) -> dict:
        traj = b["trajectories"]
        real = ~np.asarray(traj.is_padding)
        return {"enqueue": {"batch_index": int(b["step"]), "queue_depth_before": len(self.queue),
                            "min_version": int(np.asarray(traj.min_version)[real].min()),
                            "max_version": int(np.asarray(traj.max_version)[real].max()),
                            "sampler_version": int(self.c.sampler.version)}}

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
        self._global_facts = facts
        out["dequeue"] = facts
        return out

    def _weight_push(self, b) -> dict:
        c = self.c
        c.version += 1
        pushed = c.version % self.cfg.trigger_parameter_sync_step == 0
        sync_s = 0.0
        if pushed:
            t = time.perf_counter()
            params = c.sampler.engine.load_params(c.sampler_weights(c.actor.params))  # a copy: the learner donates
            import jax

            jax.block_until_ready(params)
            sync_s = time.perf_counter() - t
            with self._pending_lock:
                self._pending = _Pending(params, c.version)
            self.pushes += 1
        self.queue.set_learner_version(c.version)
        return {"weight_version_after": c.version, "sampler_version": self.latest_version(), "weight_pushed": pushed,
                "weight_sync_s": sync_s}

    # ------------------------------------------------------------------ weights

    def latest_version(self) -> int:
        """The newest weight version the rollout side has or will install before its next batch."""
        with self._pending_lock:
            pending = self._pending
        return pending.version if pending is not None else int(self.c.sampler.version)

    def install_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None and pending.version > self.c.sampler.version:
            self.c.sampler.update_weights(pending.params, pending.version)

    # ------------------------------------------------------------------ producer

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce_loop, name="rljax-rollout", daemon=True)
            self._thread.start()

    def _produce_loop(self) -> None:
        q = self.queue
        try:
            while not self._stop.is_set():
                q.wait_admission(self.latest_version)
                try:
                    with self.sampler_lock:
                        if self._stop.is_set():
                            q.abandon()
                            return
                        self.install_pending()
                        index = self.next_index
                        produced = self.producer.produce(index, {"step": index})
                        data_after = self.c.data.state()
                        self.next_index += 1
                    traj = produced.batch["trajectories"]
                    real = ~np.asarray(traj.is_padding)
                    item = QueueItem(index=index, min_version=np.asarray(traj.min_version)[real].tolist(),
                                     max_version=np.asarray(traj.max_version)[real].tolist(),
                                     uids=[str(u) for u in np.asarray(traj.uid, dtype=object)[real]],
                                     payload=(produced, data_after))
                    del traj, produced
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

    # ------------------------------------------------------------------ consumer

    def next_batch(self, step: int):
        """``(seed, prior)`` of learner step ``step``: the next batch the gate accepts."""
        self.start()
        t = time.perf_counter()
        version = self.c.version
        item = self.queue.get(version)
        wait = time.perf_counter() - t
        produced, data_after = item.payload
        item.payload = None
        st = self.queue.stats
        rollout_wait = st.rollout_wait_s - self._rollout_wait_prev
        self._rollout_wait_prev = st.rollout_wait_s
        facts = {"batch_index": item.index, "learner_version": version, "max_staleness": self.queue.max_staleness,
                 **staleness_facts(version, np.asarray(item.min_version), np.asarray(item.max_version)),
                 "queue_depth": len(self.queue), "learner_wait_s": wait, "rollout_wait_s": rollout_wait,
                 "dropped_stale": st.dropped_stale, "dropped_overflow": st.dropped_overflow,
                 "generated_rows": st.put_rows}
        self._data_after = data_after
        self._index_after = item.index + 1
        return {"step": step, "queue_item": facts}, produced

    def trained(self) -> None:
        """The step that consumed the last batch finished: it is what a checkpoint records."""
        self.data_state = self._data_after
        self.resume_index = self._index_after

    def metrics(self, facts: dict) -> dict:
        """``async/*`` of the step (staleness over every process's rows; queue and wait times this process's)."""
        facts = getattr(self, "_global_facts", None) or facts
        return {"async/staleness_mean": facts["staleness_mean"], "async/staleness_max": facts["staleness_max"],
                "async/dropped_stale": facts["dropped_stale"], "async/dropped_overflow": facts["dropped_overflow"],
                "async/generated_rows": facts.get("generated_rows"),
                "async/queue_depth": facts["queue_depth"], "async/learner_wait_s": facts["learner_wait_s"],
                "async/rollout_wait_s": facts["rollout_wait_s"], "async/min_version": facts["min_version"],
                "async/max_version": facts["max_version"], "async/spanning_rows": facts["spanning_rows"],
                "async/batch_index": facts["batch_index"], "async/weight_pushes": self.pushes,
                "async/staleness_hist": facts["staleness_hist"]}

    def checkpoint_meta(self) -> dict:
        return {"policy": "replay", "next_index": getattr(self, "resume_index", self.next_index),
                "dropped_stale": self.queue.stats.dropped_stale,
                "dropped_overflow": self.queue.stats.dropped_overflow}

    def restore(self, meta: dict) -> None:
        self.next_index = int(meta.get("next_index", self.trainer.step + 1))

    def close(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stops the producer (it finishes at most its current batch) and joins it."""
        self._stop.set()
        self.queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("rljax: the rollout thread did not stop within %.0f s", timeout)
        self.queue.drain()
