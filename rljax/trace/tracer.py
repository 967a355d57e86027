"""The field-level stage trace of a run (``trace.jsonl``), DFX metrics and alerts.

The :class:`Tracer` is an observer of :class:`rljax.trainer.runner.StepRunner`: it learns
everything from the stage events, never from the trainer. It is a few small observers
(:mod:`rljax.trace.observers`), each with one job, that see the step at its end
(:class:`~rljax.trace.observers.step.StepView`, built once from the events):

* records (:class:`~rljax.trace.observers.records.Records`): for each stage, the fields it
  *read* and *wrote* and the producer of each; the traced prompt groups' fields summarised
  (reading only the shards that hold their rows): shape, dtype, sharding, per-row valid lengths,
  mask sums (against the learner's ``loss_mask`` that the update actually consumed), producer and
  consumers; then every reference to the step's arrays is dropped, and the runner's cleanup
  report (what of the batch is still alive after the step) becomes the ``cleanup`` record;
* whole-batch invariants on every row (:class:`~rljax.trace.observers.whole_batch.WholeBatch`),
  and the re-derivations (:mod:`rljax.trace.recompute`); what of them can start before the step's
  end starts at its stage's event in a background thread (:mod:`rljax.trace.early`);
* the shape and memory ledgers, once (:class:`~rljax.trace.observers.ledgers.Ledgers`);
* alerts (:class:`~rljax.trace.observers.alert_log.AlertLog`): each carries a severity
  (:data:`rljax.trace.alerts.SEVERITY`); ``trace_summary.json`` counts them, and is written also
  when the run fails (with the error);
* the clock (:class:`~rljax.trace.observers.clock.Clock`): stage time, and the time spent inside
  the tracer (``trace/overhead_s``, ``trace/overhead_frac`` of the step time);
* DFX metrics (:class:`~rljax.trace.observers.perf.Perf`) and which process generated which
  prompts (:class:`~rljax.trace.observers.rollouts.Rollouts`, ``rollout_uids.jsonl``).

The tracer keeps no table of stage names: a stage's own facts travel in its event
(:mod:`rljax.trace.facts`); how a batch field is read comes from the one table of batch fields
(:mod:`rljax.trace.batch_fields`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from rljax._digest import LOG
from rljax.sharding import data_shards, to_host
from rljax.trace import alerts as A
from rljax.trace import faults, recompute as RC
from rljax.trace._io import compact_json, write_atomic
from rljax.trace.fields import RESPONSE_FIELDS
from rljax.trace.groups import choose_groups  # noqa: F401 -- re-exported (rljax.trace.choose_groups)
from rljax.trace.invariants import host_memory
from rljax.trace.observers.alert_log import AlertLog
from rljax.trace.observers.clock import Clock, timed
from rljax.trace.observers.ledgers import Ledgers
from rljax.trace.observers.perf import Perf, local_memory_stats
from rljax.trace.observers.records import TRACE_FILE, Records
from rljax.trace.observers.rollouts import ROLLOUT_FILE, AsyncCounts, Rollouts
from rljax.trace.observers.step import StepView
from rljax.trace.observers.whole_batch import WholeBatch
from rljax.trace.early import Early
from rljax.trace.prefetch import Prefetch
from rljax.trace.writer import Writer

SUMMARY_FILE = "trace_summary.json"
log = logging.getLogger("rljax.trace")


class Tracer:
    """An observer of the step runner (see the module docstring).

    Args:
      cfg: the resolved configuration (``trace.*`` for the groups and alert thresholds).
      mesh: the learner mesh.
      run_dir: where ``trace.jsonl``, the ledgers and ``trace_summary.json`` go.
      enabled: write files (the main process); hooks still run cheaply elsewhere.
      ledger_sources: ``() -> dict`` of what the ledgers compile and measure (model config,
        step config, parameters, optimizer state, ``lower_update(fields)`` /
        ``lower_logprob(fields)``, the sampler's engine and parameters, decode parameters),
        called once after the first step; ``None``: shape ledger only.
    """

    def __init__(self, cfg, mesh, run_dir: str, *, enabled: bool = True,
                 ledger_sources: Optional[Callable[[], Mapping[str, Any]]] = None):
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.memory_stats = local_memory_stats
        self.sandbox: Optional[dict] = None  # the python tool's sandbox probe (env.sandbox), set by the trainer
        self.clock = Clock()
        # The files are written by a background thread (rljax.trace.writer): flushed before each checkpoint save
        # (the trainer's flush()) and at close. The lock keeps the summary it encodes whole: every hook that
        # changes what the summary reads holds it.
        self.writer = Writer()
        self._lock = threading.RLock()
        self._generation = 0  # the summaries put: only the newest is encoded and written
        self.alerts = AlertLog(cfg.trace, mismatch_max=A.mismatch_threshold(cfg))
        self.records = Records(cfg, run_dir, enabled=enabled, wall=self.clock.wall, writer=self.writer)
        self.whole_batch = WholeBatch(RC.Recompute(cfg))  # the trainer attaches its reward function
        self.ledgers = Ledgers(run_dir, mesh, wanted=cfg.trace.ledgers, enabled=enabled, sources=ledger_sources)
        self.perf = Perf(data_shards(mesh), cfg.trace)  # the batch's shards: dp x fsdp
        self.rollouts = Rollouts(run_dir, enabled=enabled, dump=cfg.trace.rollout_dump, writer=self.writer)
        self.asynchronous = AsyncCounts(cfg.trace.alert_drop_rate)
        self._events: list = []
        self._closed = False
        # One process on CPU devices: the stages' batch arrays are copied to the host in a background thread
        # while the later stages run (rljax.trace.prefetch); the step's end waits for it. None: elsewhere.
        self.prefetch: Optional[Prefetch] = Prefetch() if host_memory() else None
        # Checks whose inputs are complete mid-step (the rollout's facts, the re-scoring, the whole-batch reduction)
        # start at their stage's event in a background thread (rljax.trace.early); the step's end takes their
        # results. None: every check at the step's end (bench/trace_overhead.py --early-ab times both).
        self.early: Optional[Early] = Early()

    # ------------------------------------------------------------------ observer hooks

    @timed
    def step_start(self, step: int, t: float) -> None:
        self.clock.t0, self._events, self.records.pending = t, [], []

    @timed
    def stage(self, event) -> None:
        self._events.append(event)
        if self.prefetch is not None:  # the host copies the step's end reads (rljax.trace.prefetch)
            self.prefetch.put([v for v in event.writes.values() if isinstance(v, jax.Array) and v.ndim])
        if self.early is None:
            return
        recompute, step = self.whole_batch.recompute, int(event.step)
        starts = [lambda: self.whole_batch.stage(step, self._events, event, self.early)]
        if recompute is not None:
            starts.append(lambda: recompute.stage(step, self._events, event, self.early))
        for start in starts:
            try:
                start()
            except Exception as e:  # noqa: BLE001 -- what did not start, the step's end computes itself
                log.warning("rljax.trace: a check not started mid-step: %s: %s", type(e).__name__, e)

    def step_end(self, step: int, metrics: dict) -> None:
        """Records, DFX metrics and alerts of the step (added to ``metrics``); drops the step's arrays."""
        entered = time.perf_counter()
        with self._lock:  # the writer encoding a summary meanwhile: waited for, and counted
            try:
                self._step_end(step, metrics, entered)
            finally:  # no job of the step holds its arrays when the runner looks for leaks (a step's end that
                if self.early is not None:  # raised did not wait)
                    self.early.wait()
                self.whole_batch.end_step()
                if self.whole_batch.recompute is not None:
                    self.whole_batch.recompute.end_step()

    def _step_end(self, step: int, metrics: dict, entered: float) -> None:
        if self.prefetch is not None:
            self.prefetch.wait()  # the host copies made, and no array of the step referenced by the thread
        self.clock.spent += LOG.take_spent()  # the digest log's lookups and dispatches during the step's stages
        view = StepView.of(step, self._events)
        self._events = []
        out: dict[str, Any] = {}
        found = self.asynchronous.step(view.fields["dequeue"]) if "dequeue" in view.fields else []
        if view.traj is not None:
            found = self._batch(view, metrics, out) + found
        found += self.whole_batch.take_alerts() + self.alerts.metric_alerts(metrics)
        out.update(self.whole_batch.metrics())
        for name, msg in found:
            self.alerts.fire(step, name, msg, out)
        out.update(self.perf.bytes_and_comm(view.events, metrics, self.clock.t0))
        self.clock.stages(view.events)
        del view
        tokens, step_wall = metrics.get("perf/total_num_tokens"), metrics.get("timing_s/step")
        if tokens is not None and step_wall:
            out["perf/e2e_tokens_per_s"] = float(tokens) / float(step_wall)
        if self.early is not None:  # a job whose result was not taken (its inputs changed): waited for, and counted
            self.early.wait()
        background = (self.writer.take_cpu() + (self.early.take_cpu() if self.early is not None else 0.0)
                      + (self.prefetch.take_cpu() if self.prefetch is not None else 0.0))
        out.update(self.clock.step_done(entered, self.ledgers.last_s, background))
        if self.ledgers.last_s:
            out["trace/ledger_s"] = self.ledgers.last_s
        self.ledgers.last_s = 0.0
        metrics.update(out)

    def _batch(self, view: StepView, metrics: Mapping, out: dict) -> list:
        """A step that generated a batch: its DFX metrics, prompts per process, whole-batch
        invariants, records, ledgers (once) and memory; returns the alerts they raise."""
        traj = view.traj
        self.rollouts.step(view.step, view.rows, view.fields)
        self.rollouts.dump(view.step, traj)  # every process, its own rows
        row_tokens = self._row_tokens(view)
        attended = self.whole_batch.attended  # the reduction's, else Perf sums the attention mask itself
        out.update(self.perf.tokens(view.rows, view.fields.get("attention_mask"), attended=attended))
        sigs = self.records.step(view, row_tokens, metrics)
        found = A.checksum_alerts(sigs)
        learner_mask = view.loss_mask
        found += A.width_alerts(self.records.pending, {"sampler": int(traj.response_ids.shape[1]),
                                                       "learner": int(learner_mask.shape[1]) if learner_mask is not None
                                                       else None}, RESPONSE_FIELDS)
        self.ledgers.step(view)
        memory, more = self.perf.memory(self.memory_stats(), self.ledgers.compiled_peak, out["perf/dp_tokens"])
        out.update(memory)
        return found + more

    def _row_tokens(self, view: StepView) -> Optional[np.ndarray]:
        """Per-row loss tokens of the consumed ``loss_mask``: the invariants' reduction has them;
        else one global reduction, so every process takes part (process 0 alone would wait for
        the others on multi-host)."""
        row_tokens = self.whole_batch.step(view)
        if row_tokens is None and view.loss_mask is not None:
            import jax.numpy as jnp

            row_tokens = np.asarray(to_host(jnp.sum(view.loss_mask, axis=1)))
        return row_tokens

    def async_totals(self, stats: Mapping) -> None:
        """The queue's final counts (drops after the last trained batch included)."""
        with self._lock:
            self.asynchronous.totals(stats)

    @timed
    def cleanup(self, report) -> None:
        """The runner's cleanup report becomes each group's last record; the step's records and the
        summary so far are put to the writer (timed: counted in the next step's ``trace/overhead_s``,
        the step's metrics being out by then; the writer's own work is off the step). Raises the
        ``OSError`` of an earlier step's record write (the run stops, naming the file)."""
        with self._lock:
            if report.leaked:
                self.alerts.fire(report.step, "batch_leak",
                                 f"step {report.step}: {len(report.leaked)} batch field(s) still referenced after "
                                 f"the step: {', '.join(report.leaked[:8])}", None)
            self.records.cleanup(report)
            if not self.enabled or self._closed:
                return
            self._generation += 1
            generation = self._generation
        self.writer.put(lambda: self._write_summary(generation))

    def _write_summary(self, generation: int) -> None:
        """The writer's job: the summary so far (a kill after the last step loses nothing of it),
        unless a newer one was put meanwhile or the tracer closed."""
        with self._lock:
            if generation != self._generation or self._closed:
                return
            text = compact_json(self._summary())
        try:
            write_atomic(os.path.join(self.run_dir, SUMMARY_FILE), text)
        except OSError:  # a full disk: the records' own writes stop the run and name the file; the summary
            pass  # on disk stays the previous step's (whole: written atomically)

    @timed
    def flush(self) -> None:
        """Waits until the writer has written everything put so far (the trainer calls it before each
        checkpoint save: a kill after the save finds the step's records and summary); the wait
        counts as the tracer's overhead. Raises a write's ``OSError``."""
        self.writer.flush()

    def alert(self, step: int, name: str, msg: str) -> None:
        """An alert raised outside the tracer's own rules (e.g. a skipped non-finite update)."""
        with self._lock:
            self.alerts.fire(step, name, msg, None)

    def close(self, *, error: Optional[str] = None, step: Optional[int] = None) -> dict:
        """Writes ``trace_summary.json`` (records, traced uids, stage time, overhead, alerts, and the
        error when the run failed); returns it. Closing twice keeps the first summary's error. The
        writer is flushed first; its ``OSError`` is raised when the run did not already fail."""
        if self.prefetch is not None:
            self.prefetch.close()
        if self.early is not None:
            self.early.close()
        try:
            self.writer.close()
        except OSError:
            if not error:
                raise  # a record the run could not write: it fails, naming the file (and closes again)
        with self._lock:
            return self._close(error, step)

    def _close(self, error: Optional[str], step: Optional[int]) -> dict:
        summary = self._summary("failed" if error else "completed")
        if error:
            summary["error"] = error
            summary["failed_at_step"] = step
        if self.enabled and not (self._closed and not error):
            os.makedirs(self.run_dir, exist_ok=True)
            write_atomic(os.path.join(self.run_dir, SUMMARY_FILE), json.dumps(summary, indent=1))
        self._closed = True
        return summary

    def _summary(self, status: str = "running") -> dict:
        """``trace_summary.json``'s content so far: ``status`` ``running`` (written after every
        step's records, so a launch killed before :meth:`close` leaves the summary of every step
        it traced: :func:`complete_summary`), ``completed`` or ``failed``; ``last_step``: the
        newest step whose records are in ``trace.jsonl``."""
        clock, records = self.clock, self.records
        summary = {"steps": clock.steps, "last_step": records.last_step, "records": records.count,
                   "groups_per_step": records.k, "stages": ["config_resolve", *clock.stages_seen, "cleanup"],
                   "traced_uids": records.uids, **clock.summary(), "ledger_s": self.ledgers.total_s,
                   "alerts": self.alerts.alerts, "status": status,
                   "files": [f for f in (TRACE_FILE, "shape_ledger.json", "memory_ledger.json", ROLLOUT_FILE)
                             if os.path.exists(os.path.join(self.run_dir, f))]}
        if faults.enabled():  # a test provoked these bugs on purpose: which, and how often each acted
            summary["faults"] = faults.counts()
        summary["bytes_per_field"] = self.perf.bytes
        summary["invariants"] = self.whole_batch.summary
        summary["recompute"] = self.whole_batch.recompute.summary()
        summary["slowest_process_steps"] = {str(k): v for k, v in sorted(self.perf.slowest.items())}
        for name, section in (("async", self.asynchronous.summary), ("rollout", self.rollouts.summary),
                              ("sandbox", self.sandbox)):
            if section is not None:
                summary[name] = section
        return summary

    @staticmethod
    def describe_overhead(summary: Mapping) -> str:
        """One line for the run summary table."""
        background = (f"; its background threads' CPU {100 * summary['background_frac']:.1f}% more"
                      if "background_frac" in summary else "")
        return (f"{100 * summary['overhead_frac_median']:.1f}% of step time (median; max "
                f"{100 * summary['overhead_frac_max']:.1f}%, {summary['overhead_s']:.2f} s in "
                f"{summary['steps']} steps{background}) + ledgers {summary['ledger_s']:.2f} s once")


def complete_summary(run_dir: str, step: int) -> Optional[str]:
    """Completes the ``trace_summary.json`` of a run that trained every step (its checkpoint
    ``step`` is at ``trainer.total_steps``) when the launch that trained ``step`` stopped before
    :meth:`Tracer.close` (a SIGKILL, or a signal or error after its last step's records): the
    summary it wrote after ``step`` (status ``running``, or ``failed`` with the error) becomes
    ``completed``, the stop kept under ``stopped``. An asynchronous run's final queue counts are
    those of its last trained batch (the queue's own went with the launch): said under
    ``async.final_counts``. Returns one line saying what was done, or what is missing and why
    (nothing is written then); None when the summary is already complete."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    try:
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh)
    except FileNotFoundError:
        return (f"{SUMMARY_FILE} is missing, and cannot be rebuilt from the records on disk (the launch that "
                f"trained step {step} stopped before writing it): python -m rljax.trace check reports it")
    except (OSError, ValueError) as e:
        return f"{SUMMARY_FILE} is unreadable ({type(e).__name__}) and cannot be rebuilt from the records on disk"
    if summary.get("status") == "completed":
        return None
    last = summary.get("last_step")
    if last != step:
        return (f"{SUMMARY_FILE} (status {summary.get('status')}) covers the steps up to {last}, not {step}: it "
                "cannot be completed from the records on disk")
    stopped = {k: summary.pop(k) for k in ("error", "failed_at_step") if k in summary}
    how = (f"the launch that trained step {step} ended before closing it: "
           + (stopped["error"] if stopped.get("error") else "killed"))
    summary["stopped"] = {**stopped, "completed_at": time.time(), "how": how}
    summary["status"] = "completed"
    a = summary.get("async")
    if a and "final_dropped_stale" not in a:
        per_batch = a.get("trained_rows", 0) / max(a.get("trained_batches", 0), 1)
        generated = int(a.get("generated_rows", 0))
        a.update(final_dropped_stale=int(a.get("dropped_stale", 0)),
                 final_dropped_overflow=int(a.get("dropped_overflow", 0)), final_generated_rows=generated,
                 batches_put=int(np.ceil(generated / per_batch)) if per_batch else 0,
                 final_counts=f"as of the last trained batch (step {step}): the queue's own final counts went "
                              "with the launch that stopped")
    write_atomic(path, json.dumps(summary, indent=1))
    return f"its {SUMMARY_FILE} was completed from the summary of every step on disk ({how})"
