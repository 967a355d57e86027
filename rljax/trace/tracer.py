"""The field-level stage trace of a run (``trace.jsonl``), DFX metrics and alerts.

The :class:`Tracer` is an observer of :class:`rljax.trainer.runner.StepRunner`: it learns
everything from the stage events, never from the trainer. For each stage it is told the
fields the stage *read* (recorded by the runner as the stage read them) and *wrote*, and
the producer of each. At the end of the step it summarises the traced prompt groups'
fields (reading only the shards that hold their rows): shape, dtype, sharding, per-row
valid lengths, mask sums (against the learner's ``loss_mask`` that the update actually
consumed), the producer stage and the stages that consumed the field. Then it drops every
reference it held; the runner's cleanup report (what of the batch is still alive after
the step) becomes the ``cleanup`` record. Time spent inside the tracer is measured and
reported (``trace/overhead_s``, ``trace/overhead_frac`` of the step time).

Records: one per stage per traced group, in the order the stages ran, plus
``config_resolve`` (first) and ``cleanup`` (last). Each record: ``stage``, ``step``,
``uid``, ``group``, ``keys`` (``{uid}_{session}_{index}``), ``t_start`` / ``t_end`` (Unix
seconds), ``reads`` / ``writes`` (field names), ``fields`` (see
:func:`rljax.trace.fields.summarize`), a shape ``signature`` and the stage's own facts (its
``facts(event, view)``, carried in the stage event: :mod:`rljax.trace.facts`; the tracer
keeps no table of stage names). The ``cleanup`` record lists the ``stages`` the runner ran
that step, in order, which ``trace check`` compares each group's records with.

Alerts carry a severity (:data:`rljax.trace.alerts.SEVERITY`); ``trace_summary.json``
counts them, and is written also when the run fails (with the error).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np

from rljax.sharding import to_host
from rljax.trace import alerts as A
from rljax.trace._io import append_lines, write_atomic
from rljax.trace.facts import GroupView
from rljax.trace.fields import MASK_FIELDS, RESPONSE_FIELDS, SEQUENCE_FIELDS, VALUE_FIELDS, host_rows, summarize
from rljax.trace.groups import choose_groups  # noqa: F401 -- re-exported (rljax.trace.choose_groups)
from rljax.config import load_resolved, to_flat_dict
from rljax.trace import faults, invariants as I
from rljax.trace.ledger import LedgerInput, write_ledgers

log = logging.getLogger("rljax.trace")

#: Config keys whose value and source every config_resolve record carries (the seed's list, rljax names).
KEY_CONFIG = ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
              "data.filter_overlong_prompts", "data.truncation", "algorithm.adv_estimator",
              "algorithm.use_kl_in_reward", "algorithm.norm_adv_by_std_in_grpo", "algorithm.bypass_mode",
              "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "actor.ppo_epochs", "actor.use_kl_loss",
              "rollout.n", "rollout.tp", "reward.function", "trainer.mesh", "trace.groups", "trainer.mode",
              "rollout.placement", "async_training.max_staleness", "async_training.partial_rollout",
              "algorithm.filter_groups.enable")
TRACE_FILE = "trace.jsonl"
SUMMARY_FILE = "trace_summary.json"
#: One line per step: the prompt uids each process generated (``{"step", "by_process": {process: [uid]}}``).
ROLLOUT_FILE = "rollout_uids.jsonl"


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._spent += time.perf_counter() - t

    return wrapper


def _percentiles(x: np.ndarray, prefix: str) -> dict:
    if x.size == 0:
        return {}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max()),
            f"{prefix}/p50": float(p50), f"{prefix}/p90": float(p90), f"{prefix}/p99": float(p99)}


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


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
        self.cfg, self.mesh, self.run_dir = cfg, mesh, run_dir
        self.ledger_sources = ledger_sources
        self.enabled = enabled
        self.k = int(cfg.trace.groups)
        self.dp = int(dict(mesh.shape).get("dp", 1))
        self.path = os.path.join(run_dir, TRACE_FILE)
        self.spikes = A.SpikeDetector(factor=cfg.trace.alert_spike_factor, window=cfg.trace.alert_spike_window)
        self.memory_stats = lambda: [d.memory_stats() for d in _local_devices()]
        self._offset = time.time() - time.perf_counter()
        self._spent = 0.0
        self._spent_total = 0.0
        self._step_total = 0.0
        self._ledger_s = 0.0
        self._ledger_total = 0.0
        self._records = 0
        self._fracs: list[float] = []
        self._steps = 0
        self._uids: list[str] = []
        self._alerts: dict[str, dict] = {}
        self._stage_total: dict[str, float] = {}
        self._stages_seen: list[str] = []
        self._async: Optional[dict] = None  # trainer.mode=async: staleness histogram, drops, trained rows
        self._bytes: dict[str, dict[str, int]] = {}  # stage -> field -> bytes (largest seen)
        self._invariants: dict[str, Any] = {"steps": 0, "rows": 0, "violating_rows": 0, "violations": []}
        self._invariant_alerts: list = []
        self._inv_counts: Optional[dict] = None
        self._slowest: dict[int, int] = {}  # process -> steps it was the slowest
        self._rollout: Optional[dict] = None  # uids generated per process
        self.sandbox: Optional[dict] = None  # the python tool's sandbox probe (env.sandbox), set by the trainer
        self._ledgers_done = not cfg.trace.ledgers
        self._compiled_peak: Optional[int] = None
        self._config: Optional[dict] = None  # read at the first record: the launcher writes config.resolved.yaml
        # only once the run is built (a refused resume leaves the run's record as it was)
        self._config_written = False
        self._closed = False
        self._last_step: Optional[int] = None  # the newest step whose records are written
        self._events: list = []
        self._pending: list[dict] = []
        self._step: Optional[int] = None
        self._row_tokens: Optional[np.ndarray] = None
        self._t0 = 0.0

    def _wall(self, t_perf: Optional[float]) -> Optional[float]:
        return None if t_perf is None else round(t_perf + self._offset, 6)

    # ------------------------------------------------------------------ observer hooks

    @_timed
    def step_start(self, step: int, t: float) -> None:
        self._step, self._t0, self._events, self._pending = int(step), t, [], []

    @_timed
    def stage(self, event) -> None:
        self._events.append(event)

    def step_end(self, step: int, metrics: dict) -> None:
        """Records, DFX metrics and alerts of the step (added to ``metrics``); drops the step's arrays."""
        entered = time.perf_counter()
        events, self._events = self._events, []
        fields = {}  # the newest value of every field of the step
        for ev in events:
            fields.update(ev.reads)
            fields.update(ev.writes)
        traj = fields.get("trajectories")
        # Several processes: this process's trajectories, and every process's row facts (gather_rollout).
        rows_view = fields.get("rollout_rows")
        out: dict[str, Any] = {}
        async_alerts = []
        if "dequeue" in fields:
            async_alerts = self._async_step(fields["dequeue"])
        if traj is not None:
            out.update(self._dfx(rows_view if rows_view is not None else traj, fields.get("attention_mask")))
            self._rollout_step(step, rows_view if rows_view is not None else traj, fields)
            if self.cfg.trace.rollout_dump:  # every process, its own rows
                self._dump_rollout(step, traj)
            consumers: dict[str, list[str]] = {}
            for ev in events:
                for k in ev.reads:
                    consumers.setdefault(k, []).append(ev.stage)
            loss_mask = fields.get("loss_mask")
            row_tokens = None  # per-row loss tokens of the consumed mask (the invariants' reduction has them)
            try:
                row_tokens = self._invariants_step(step, events, traj, fields, rows_view)
            except Exception as e:  # a check must never stop training; check reports what was not checked
                log.warning("rljax.trace: whole-batch invariants not computed: %s: %s", type(e).__name__, e)
                self._invariants["error"] = f"step {step}: not computed: {type(e).__name__}: {e}"
            if row_tokens is None and loss_mask is not None:
                # A global reduction, so every process takes part (process 0 alone would wait
                # for the others on multi-host).
                import jax.numpy as jnp

                row_tokens = np.asarray(to_host(jnp.sum(loss_mask, axis=1)))
            self._row_tokens = row_tokens
            records = []
            sigs: dict[str, dict] = {}
            groups = choose_groups(self.cfg.trainer.seed, step, int(traj.num_groups), self.k)
            for g in groups if self.enabled else ():  # other processes of a multi-host run write nothing
                recs = self._group_records(g, events, traj, fields, consumers, loss_mask, metrics)
                sigs[recs[0]["uid"]] = {r["stage"]: r["signature"] for r in recs}
                records.extend(recs)
            self._pending = records
            found = A.checksum_alerts(sigs)
            learner_mask = fields.get("loss_mask")
            found += A.width_alerts(records, {"sampler": int(traj.response_ids.shape[1]),
                                              "learner": int(learner_mask.shape[1]) if learner_mask is not None
                                              else None}, RESPONSE_FIELDS)
            if not self._ledgers_done:
                t = time.perf_counter()
                self._ledgers_done = True
                try:
                    if self.enabled:
                        self._compiled_peak = write_ledgers(LedgerInput(
                            run_dir=self.run_dir, step=step, mesh=self.mesh, traj=traj, fields=fields,
                            producers=_producers(events), consumers=consumers,
                            sources=self.ledger_sources() if self.ledger_sources else None))
                except Exception as e:  # a ledger must never stop training
                    log.warning("rljax.trace: ledgers not written: %s: %s", type(e).__name__, e)
                self._ledger_s = time.perf_counter() - t
                self._ledger_total += self._ledger_s
            stats = self.memory_stats()
            if stats and stats[0]:
                out.update({f"memory/{k}": stats[0].get(k) for k in ("bytes_in_use", "peak_bytes_in_use",
                                                                      "bytes_limit")})
            found += [a for a in (A.memory_alert(stats, self.cfg.trace.alert_memory_frac,
                                                 compiled_peak=self._compiled_peak),
                                  A.dp_imbalance_alert(out["perf/dp_tokens"], self.cfg.trace.alert_dp_imbalance)) if a]
        else:
            found = []
        found += async_alerts + self._invariant_alerts + self.spikes.update(metrics)
        self._invariant_alerts = []
        if self._inv_counts is not None:
            out.update({"invariants/rows": self._inv_counts["rows"],
                        "invariants/violating_rows": self._inv_counts["violations"],
                        "trace/invariants_s": self._inv_counts["s"]})
            self._inv_counts = None
        found += [a for a in (A.mismatch_alert(metrics, self.cfg.trace.alert_rollout_probs_diff_max),) if a]
        for name, msg in found:
            self._alert(step, name, msg, out)
        out.update(self._bytes_and_comm(events, metrics))
        for ev in events:
            dt = ev.t_end - ev.t_start
            self._stage_total[ev.stage] = self._stage_total.get(ev.stage, 0.0) + dt
            if ev.stage not in self._stages_seen:
                self._stages_seen.append(ev.stage)
        del events, fields, traj
        tokens, step_wall = metrics.get("perf/total_num_tokens"), metrics.get("timing_s/step")
        if tokens is not None and step_wall:
            out["perf/e2e_tokens_per_s"] = float(tokens) / float(step_wall)
        self._spent += time.perf_counter() - entered - self._ledger_s
        step_s = time.perf_counter() - self._t0
        out.update({"trace/overhead_s": self._spent, "trace/overhead_frac": self._spent / step_s if step_s > 0 else 0.0})
        if self._ledger_s:
            out["trace/ledger_s"] = self._ledger_s
        self._spent_total += self._spent
        self._step_total += step_s
        self._fracs.append(self._spent / step_s if step_s > 0 else 0.0)
        self._spent, self._ledger_s = 0.0, 0.0
        self._steps += 1
        metrics.update(out)

    def _invariants_step(self, step: int, events, traj, fields: Mapping, rows_view) -> Optional[np.ndarray]:
        """Whole-batch invariants (:mod:`rljax.trace.invariants`) over every row of the step, for each
        distinct ``loss_mask`` / ``input_ids`` a learner stage read, and the scores tie. Every
        device-side fact of the step (those pairs' per-row facts, the per-row sums of the step's
        ``loss_mask``, the scores the advantages read) comes from one jitted reduction and one
        host transfer (:func:`~rljax.trace.invariants.step_facts`). Several processes: every
        process takes part in that reduction (the learner arrays are global), checks its own
        rows against its own rollout, and the verdicts are all-gathered (one small collective).
        Returns the per-row loss-mask sums of the whole learner batch (None: not computed here)."""
        inv = self._invariants
        t = time.perf_counter()
        B, lo = int(traj.batch_size), 0
        if rows_view is not None:  # several processes: this process's rows are one block of the learner batch
            import jax

            owner = np.asarray(rows_view.process)
            blocks = [np.nonzero(owner == p)[0] for p in np.unique(owner)]
            mine = np.nonzero(owner == jax.process_index())[0]
            if len(mine) != B or any(len(b) and (np.diff(b) != 1).any() for b in blocks):
                inv["skipped"] = "several processes: a process's rows are not one block of the learner batch"
                return None
            B, lo = len(owner), int(mine[0]) if len(mine) else 0
        pairs: dict = {}  # (id(loss_mask), id(input_ids)) -> [loss_mask, input_ids, the stages that read them]
        for ev in events:
            lm = ev.reads.get("loss_mask")
            if lm is None or ev.stage in ("metrics",) or lm.shape[0] != B:
                continue
            ids = ev.reads.get("input_ids", fields.get("input_ids"))
            pairs.setdefault((id(lm), id(ids)), [lm, ids, []])[2].append(ev.stage)
        loss_mask = fields.get("loss_mask")
        row_sum_mask = loss_mask if loss_mask is not None and loss_mask.shape[0] == B else None
        scored = fields.get("scored_rows")
        adv = next((ev for ev in events if "scores" in ev.reads and "advantages" in ev.writes), None)  # scores -> advantages
        scores = adv.reads["scores"] if scored is not None and adv is not None else None
        on_device = scores is not None and tuple(scores.shape) == (B,) and not isinstance(scores, np.ndarray)
        roles = getattr(traj, "roles", None)
        obs = None if roles is None else np.asarray(roles) == I.OBSERVATION_ROLE
        # Several processes: the observation rows are this process's only; its learner rows are
        # checked against the rollout's mask (digests), so the rollout's own observation tokens
        # with mask 1 are the learner's.
        per_pair, extra = I.step_facts([(lm, ids) for lm, ids, _ in pairs.values()],
                                       obs if rows_view is None else None, row_sum_mask,
                                       scores if on_device else None)
        mine = slice(lo, lo + int(traj.batch_size))
        local: dict = {"rows": 0, "violations": 0, "list": [], "error": None}
        try:
            local = self._invariants_local(step, traj, fields, pairs, per_pair, extra, mine, obs, scores, scored,
                                           on_device, rows_view is not None)
        except Exception as e:  # noqa: BLE001 -- reported; the other processes still wait for the combine
            local["error"] = f"step {step}: not computed: {type(e).__name__}: {e}"
        verdicts = [local] if rows_view is None else _allgather_json(local)
        counts = {"rows": sum(v["rows"] for v in verdicts), "violations": sum(v["violations"] for v in verdicts)}
        for v in verdicts:
            if v.get("error"):
                inv["error"] = v["error"]
            found = v["list"]
            if found:
                inv["violations"].extend(found[:max(20 - len(inv["violations"]), 0)])
                if not self._invariant_alerts:  # one alert per step, naming the first violation
                    first = found[0]
                    self._invariant_alerts.append(
                        ("batch_invariant", f"step {step} {first['tensor']} at {first['stage']}, {first['key']} (uid "
                                            f"{first['uid']}): {first['detail']} ({v['violations']} row(s))"))
        if scores is not None:
            inv["scores_tied"] = True
        if rows_view is not None:
            inv["processes"] = len(verdicts)
        inv["steps"] += 1
        inv["rows"] += counts["rows"]
        inv["violating_rows"] += counts["violations"]
        inv["stages"] = sorted(set(inv.get("stages", [])) | {st for _, _, stages in pairs.values() for st in stages})
        dt = time.perf_counter() - t
        inv["s"] = inv.get("s", 0.0) + dt
        self._inv_counts = dict(counts, s=dt)
        return extra.get("row_sum")

    def _invariants_local(self, step, traj, fields, pairs, per_pair, extra, mine, obs, scores, scored, on_device,
                          several) -> dict:
        """This process's rows against its own rollout: ``{"rows", "violations", "list", "error"}``."""
        real = ~np.asarray(traj.is_padding)
        keys = tuple(f"{u}_{se}_{i}" for u, se, i in zip(traj.uid, traj.session, traj.index))
        rollout = I.host_row_facts(np.asarray(traj.loss_mask), np.asarray(traj.response_ids))
        learner_version = (fields.get("dequeue") or {}).get("learner_version")
        if learner_version is None and fields.get("weight_version_after") is not None:
            learner_version = int(fields["weight_version_after"]) - 1  # the sync after the update advanced it
        rows, bad, found = 0, 0, []
        for (_, _, stages), update in zip(pairs.values(), per_pair):  # one comparison per distinct array
            update = {k: v[mine] for k, v in update.items()}
            if several and obs is not None:
                update["observation_tokens"] = ((np.asarray(traj.loss_mask) != 0) & obs).sum(axis=1)
            c, v = I.compare(step, keys, real, rollout, update, stage=stages[0],
                             max_version=np.asarray(traj.max_version), learner_version=learner_version)
            rows, bad = max(rows, c["rows"]), max(bad, c["violations"])
            found += v
        if scores is not None:
            read = extra["scores"][mine] if on_device else np.asarray(to_host(scores), np.float32)[mine]
            present = np.arange(traj.response_ids.shape[1])[None, :] < np.asarray(traj.response_length)[:, None]
            c, v = I.compare_scores(step, keys, real, I.position_digest(present, np.asarray(traj.response_ids)),
                                    scored, read)
            bad += c["violations"]
            found += v
        return {"rows": rows, "violations": bad, "list": found[:5], "error": None}

    def _bytes_and_comm(self, events, metrics: Mapping) -> dict:
        """Bytes of every batch field each stage wrote (global, from shapes: no copy), the communication
        we issue (weight push, the rollout gather, the step-time all-gather) timed, and each process's
        step time with the slowest process (an all-gather of one float on several processes)."""
        out: dict[str, Any] = {}
        total = 0
        for ev in events:
            sizes = self._bytes.setdefault(ev.stage, {})
            for name, x in ev.writes.items():
                arrays = x.arrays() if hasattr(x, "arrays") else {name: x} if _is_array(x) else {}
                for k, v in arrays.items():
                    if _is_array(v):
                        n = int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                        key = k if name != "trajectories" else f"trajectories.{k}"
                        sizes[key] = max(sizes.get(key, 0), n)
                        total += n
        out["perf/batch_bytes"] = total
        comm = {}
        for ev in events:
            if ev.writes.get("weight_sync_s") is not None:  # the weight push the stage timed
                comm["weight_push"] = float(ev.writes["weight_sync_s"])
            if ev.comm:  # a stage that is one communication (Stage.comm): all of its time
                comm[ev.stage] = ev.t_end - ev.t_start
        step_s = float(metrics.get("timing_s/step") or (time.perf_counter() - self._t0))
        t = time.perf_counter()
        by_process = _gather_step_times(step_s)
        if len(by_process) > 1:
            comm["step_time_allgather"] = time.perf_counter() - t
        out.update({f"comm_s/{k}": v for k, v in comm.items()})
        out["timing_s/comm"] = sum(comm.values())
        slowest = int(np.argmax(by_process))
        out.update({"perf/step_time_by_process": [round(x, 6) for x in by_process],
                    "perf/slowest_process": slowest,
                    "perf/step_time_max_over_min": float(max(by_process) / min(by_process)) if min(by_process) > 0
                    else 1.0})
        self._slowest[slowest] = self._slowest.get(slowest, 0) + 1
        return out

    def _rollout_step(self, step: int, rows, fields: Mapping) -> None:
        """Which process generated which prompt uids this step (``rollout_uids.jsonl``; counts in the summary)."""
        if hasattr(rows, "by_process"):
            by = rows.by_process()
        else:  # one process generated every row
            real = ~np.asarray(rows.is_padding)
            by = {"0": list(dict.fromkeys(str(u) for u, r in zip(rows.uid, real) if r))}
        item = fields.get("dequeue") or {}
        r = self._rollout = self._rollout or {"file": ROLLOUT_FILE, "uids_by_process": {}, "steps": 0}
        for p, uids in by.items():
            r["uids_by_process"][p] = r["uids_by_process"].get(p, 0) + len(uids)
        r["steps"] += 1
        r["processes"] = max(len(by), r.get("processes", 0))
        if self.enabled:
            rec = {"step": int(step), "by_process": by}
            if "batch_index" in item:  # trainer.mode=async: the producer's batch, those dropped before it, and the
                rec["batch_index"] = item["batch_index"]  # data position after its draw ("every prompt trained once")
                rec["dropped_batches"] = item.get("dropped_batches", [])
                if item.get("data_after") is not None:
                    rec["data_after"] = {k: int(item["data_after"][k]) for k in ("epoch", "position", "num_examples")
                                         if k in item["data_after"]}
            if "dynamic_sampling" in fields:  # algorithm.filter_groups: the uids generated, not trained, and why
                rec["dropped"] = fields["dynamic_sampling"]["dropped"]
            append_lines(os.path.join(self.run_dir, ROLLOUT_FILE), json.dumps(rec, separators=(",", ":")) + "\n")

    def _dump_rollout(self, step: int, traj) -> None:
        import jax

        d = os.path.join(self.run_dir, "rollouts", f"process{jax.process_index()}")
        os.makedirs(d, exist_ok=True)
        np.savez(os.path.join(d, f"step{int(step)}.npz"), uid=np.asarray(traj.uid, dtype=str),
                 session=np.asarray(traj.session), is_padding=np.asarray(traj.is_padding),
                 prompt_ids=traj.prompt_ids, response_ids=traj.response_ids,
                 response_length=traj.response_length, rollout_logp=traj.rollout_logp)

    def _async_step(self, d: Mapping) -> list:
        a = self._async = self._async or {"staleness_hist": {}, "trained_rows": 0, "trained_batches": 0,
                                          "max_staleness": d.get("max_staleness"), "staleness_max": 0,
                                          "dropped_stale": 0, "dropped_overflow": 0}
        for k, v in (d.get("staleness_hist") or {}).items():
            a["staleness_hist"][k] = a["staleness_hist"].get(k, 0) + int(v)
            a["trained_rows"] += int(v)
        a["trained_batches"] += 1
        a["staleness_max"] = max(a["staleness_max"], int(d.get("staleness_max", 0)))
        a["dropped_stale"], a["dropped_overflow"] = int(d.get("dropped_stale", 0)), int(d.get("dropped_overflow", 0))
        a["generated_rows"] = int(d.get("generated_rows", 0))
        alert = A.drop_rate_alert(a["dropped_stale"] + a["dropped_overflow"], a["generated_rows"],
                                  self.cfg.trace.alert_drop_rate)
        return [alert] if alert else []

    def async_totals(self, stats: Mapping) -> None:
        """The queue's final counts (drops after the last trained batch included)."""
        if self._async is not None:
            self._async.update(final_dropped_stale=int(stats.get("dropped_stale", 0)),
                               final_dropped_overflow=int(stats.get("dropped_overflow", 0)),
                               batches_put=int(stats.get("put", 0)), max_queue_depth=int(stats.get("max_depth", 0)),
                               final_generated_rows=int(stats.get("put_rows", 0)))

    def cleanup(self, report) -> None:
        """The runner's cleanup report becomes each group's last record; the step's records are written."""
        if report.leaked:
            self._alert(report.step, "batch_leak",
                        f"step {report.step}: {len(report.leaked)} batch field(s) still referenced after the step: "
                        f"{', '.join(report.leaked[:8])}", None)
        records = self._pending
        self._pending = []
        for uid in dict.fromkeys(r["uid"] for r in records):
            first = next(r for r in records if r["uid"] == uid)
            rec = dict(step=first["step"], uid=uid, group=first["group"], keys=first["keys"], stage="cleanup",
                       t_start=self._wall(report.t_start), t_end=self._wall(report.t_end), reads=[], writes=[],
                       fields=[], stages=list(report.stages), batch_keys=report.batch_keys, tracked_objects=report.tracked,
                       remaining_keys=list(report.leaked), released=not report.leaked)
            rec["signature"] = {"keys": list(first["keys"]), "rows": len(first["keys"]), "batch": None,
                                "resp_len": None, "mask_sum": None}
            records.append(rec)
        if self.enabled and records:
            append_lines(self.path, "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        self._records += len(records)
        self._uids.extend(sorted({r["uid"] for r in records}))
        self._last_step = int(report.step)
        if self.enabled and not self._closed:  # the summary so far: a kill after the last step loses nothing of it
            try:
                write_atomic(os.path.join(self.run_dir, SUMMARY_FILE),
                             json.dumps(self._summary(), separators=(",", ":")))
            except OSError:  # a full disk: the records' own writes stop the run and name the file; the summary
                pass  # on disk stays the previous step's (whole: written atomically)

    def _alert(self, step: int, name: str, msg: str, out: Optional[dict]) -> None:
        sev = A.SEVERITY.get(name, "warning")
        a = self._alerts.setdefault(name, {"count": 0, "severity": sev, "first_step": int(step), "message": msg})
        a["count"] += 1
        if out is not None:
            out[f"alerts/{name}"] = 1
        (log.error if sev == "error" else log.warning)("rljax alert %s [%s] (step %d): %s", name, sev, step, msg)

    def alert(self, step: int, name: str, msg: str) -> None:
        """An alert raised outside the tracer's own rules (e.g. a skipped non-finite update)."""
        self._alert(step, name, msg, None)

    def close(self, *, error: Optional[str] = None, step: Optional[int] = None) -> dict:
        """Writes ``trace_summary.json`` (records, traced uids, stage time, overhead, alerts, and the
        error when the run failed); returns it. Closing twice keeps the first summary's error."""
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
        frac = self._spent_total / self._step_total if self._step_total > 0 else 0.0
        summary = {"steps": self._steps, "last_step": self._last_step, "records": self._records,
                   "groups_per_step": self.k,
                   "stages": ["config_resolve", *self._stages_seen, "cleanup"], "traced_uids": self._uids,
                   "stage_s": self._stage_total, "overhead_s": self._spent_total, "step_s": self._step_total,
                   "overhead_frac": frac,
                   "overhead_frac_median": float(np.median(self._fracs)) if self._fracs else 0.0,
                   "overhead_frac_max": float(max(self._fracs, default=0.0)),
                   "ledger_s": self._ledger_total, "alerts": self._alerts, "status": status,
                   "files": [f for f in (TRACE_FILE, "shape_ledger.json", "memory_ledger.json", ROLLOUT_FILE)
                             if os.path.exists(os.path.join(self.run_dir, f))]}

        if faults.enabled():  # a test provoked these bugs on purpose
            summary["faults"] = faults.enabled()
        summary["bytes_per_field"] = self._bytes
        summary["invariants"] = self._invariants
        summary["slowest_process_steps"] = {str(k): v for k, v in sorted(self._slowest.items())}
        if self._async is not None:
            summary["async"] = self._async
        if self._rollout is not None:
            summary["rollout"] = self._rollout
        if self.sandbox is not None:
            summary["sandbox"] = self.sandbox
        return summary

    @staticmethod
    def describe_overhead(summary: Mapping) -> str:
        """One line for the run summary table."""
        return (f"{100 * summary['overhead_frac_median']:.1f}% of step time (median; max "
                f"{100 * summary['overhead_frac_max']:.1f}%, {summary['overhead_s']:.2f} s in "
                f"{summary['steps']} steps) + ledgers {summary['ledger_s']:.2f} s once")

    # ------------------------------------------------------------------ DFX metrics

    def _dfx(self, traj, attention_mask=None) -> dict:
        """Per-dp-shard tokens of the learner batch as placed (its attention mask), lengths."""
        real = ~np.asarray(traj.is_padding)
        if attention_mask is not None:
            import jax.numpy as jnp

            tokens = np.asarray(to_host(jnp.sum(attention_mask, axis=1))) * real
        else:
            tokens = (np.asarray(traj.prompt_length) + np.asarray(traj.response_length)) * real
        counts = A.dp_token_counts(tokens[:, None], self.dp)
        out = {"perf/dp_tokens": [int(c) for c in counts], "perf/dp_token_imbalance": A.imbalance(counts),
               "perf/padding_rows": int((~real).sum())}
        out.update(_percentiles(np.asarray(traj.prompt_length)[real], "prompt_length"))
        out.update({k: v for k, v in _percentiles(np.asarray(traj.response_length)[real], "response_length").items()
                    if k.rsplit("/", 1)[1].startswith("p")})
        return out

    # ------------------------------------------------------------------ records

    def _config_facts(self) -> dict:
        path = os.path.join(self.run_dir, "config.resolved.yaml")
        flat = to_flat_dict(self.cfg)
        facts = {"file": "config.resolved.yaml" if os.path.exists(path) else None,
                 "sha256": hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]}
        sources = {}
        if facts["file"]:
            try:
                _, prov = load_resolved(path)
                sources = {k: prov.get(k) for k in KEY_CONFIG}
                # every writer of each key field, in order (default, preset file(s), cli), as the file keeps them
                facts["writers"] = {k: [[src, list(v) if isinstance(v, tuple) else v] for src, v in prov.chain(k)]
                                    for k in KEY_CONFIG}
                facts["fields_not_from_default"] = sum(1 for v in prov.values() if v != "default")
            except Exception as e:  # provenance unreadable: the checker reports it
                facts["error"] = f"{type(e).__name__}: {e}"
        facts["values"] = {k: flat.get(k) for k in KEY_CONFIG}
        facts["sources"] = sources
        return facts

    def _config_once(self) -> dict:
        """The key fields' values and sources in the run's first record; the file and hash after."""
        if self._config is None:
            self._config = self._config_facts()
        if not self._config_written:
            self._config_written = True
            return self._config
        return {k: self._config.get(k) for k in ("file", "sha256")}

    def _group_records(self, g: int, events, traj, fields: Mapping, consumers: Mapping, loss_mask,
                       metrics: Mapping) -> list[dict]:
        B = int(traj.batch_size)
        pad = np.asarray(traj.is_padding)
        rows = np.nonzero(np.asarray(traj.group_id) == g)[0]
        rows = rows[~pad[rows]]
        uid = str(traj.uid[rows[0]]) if len(rows) else f"group-{g}"
        key_of = {int(i): f"{traj.uid[i]}_{traj.session[i]}_{traj.index[i]}" for i in rows}
        keys = list(key_of.values())
        resp_len = np.asarray(traj.response_length)
        prompt_len = np.asarray(traj.prompt_length)
        sampler_mask = np.asarray(traj.response_mask)[rows]
        # Several processes: ``traj`` holds this process's rows, the learner arrays every process's;
        # this process's rows start at ``off`` in them (gather_rollout's row facts say where).
        view = fields.get("rollout_rows")
        g_rows, g_B, g_pad, g_resp, g_prompt = rows, B, pad, resp_len, prompt_len
        if view is not None:
            import jax

            mine = np.nonzero(np.asarray(view.process) == jax.process_index())[0]
            g_rows, g_B = rows + (int(mine[0]) if len(mine) else 0), int(view.batch_size)
            g_pad, g_resp, g_prompt = (np.asarray(view.is_padding), np.asarray(view.response_length),
                                       np.asarray(view.prompt_length))
        # The learner's loss mask as the update consumed it (traced rows only).
        learner_mask = host_rows(loss_mask, g_rows) if loss_mask is not None else None
        base = {"step": self._step, "uid": uid, "group": int(g), "keys": keys}

        def field(name, x, producer, consumed_as=None):
            sampler = _sampler_side(x, traj) and x.shape[0] == B
            r, p_len, r_len, is_pad = (rows, prompt_len, resp_len, pad) if sampler else \
                (g_rows, g_prompt, g_resp, g_pad)
            if name in MASK_FIELDS:
                mask_rows = (host_rows(x, r) if name != "response_mask" or x is not traj.response_mask
                             else sampler_mask)
            elif name in RESPONSE_FIELDS:
                mask_rows = sampler_mask if sampler else learner_mask
            else:
                mask_rows = None
            if name in SEQUENCE_FIELDS:
                valid = p_len + r_len
            elif name in RESPONSE_FIELDS:
                valid = r_len
            elif name in ("prompt_ids", "prompt_mask"):
                valid = p_len
            else:
                valid = None
            out = summarize(name, x, producer=producer, consumers=consumers.get(consumed_as or name, []), rows=r,
                            valid_length=valid, mask_rows=mask_rows, is_padding=is_pad,
                            values=name in VALUE_FIELDS)
            out["layout"] = "sampler" if sampler else "learner"  # whose response width it must have
            return out

        def fields_of(ev) -> list[dict]:
            out = []
            for name, x in {**ev.reads, **ev.writes}.items():
                producer = ev.producers.get(name, "?")
                if name == "trajectories":
                    for k, v in x.arrays().items() if hasattr(x, "arrays") else ():
                        if k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "loss_mask",
                                 "rollout_logp"):
                            out.append(field(k if k != "loss_mask" else "sampler_loss_mask", v, producer,
                                             consumed_as="trajectories"))
                elif _is_array(x) and x.ndim and x.shape[0] in (B, g_B):
                    out.append(field(name, x, producer))
            return out

        recs = [self._rec(base, "config_resolve", [], None, None, keys, config=self._config_once())]
        view = GroupView(step=self._step, group=int(g), rows=rows, key_of=key_of, traj=traj, fields=fields,
                         is_padding=g_pad, response_length=g_resp, row_tokens=self._row_tokens, wall=self._wall)
        for ev in events:
            facts = ev.facts(ev, view) if ev.facts is not None else {}
            recs.append(self._rec(base, ev.stage, fields_of(ev), ev.t_start, ev.t_end, keys,
                                  reads=list(ev.reads), writes=list(ev.writes), **facts))
        return recs

    def _rec(self, base, stage, fields, t0, t1, keys, **extra) -> dict:
        r = dict(base, stage=stage, t_start=self._wall(t0), t_end=self._wall(t1), fields=fields, **extra)
        r["signature"] = _signature(keys, fields)
        return r

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


def _allgather_json(obj: dict, width: int = 8192) -> list[dict]:
    """Every process's ``obj`` (JSON, at most ``width`` bytes: the list of found violations is cut
    to fit), in process order; one all-gather."""
    from jax.experimental import multihost_utils

    obj = dict(obj)
    data = json.dumps(obj).encode()
    while len(data) > width and obj.get("list"):
        obj["list"] = obj["list"][:-1]
        data = json.dumps(obj).encode()
    buf = np.zeros(width, np.uint8)
    buf[:len(data)] = np.frombuffer(data[:width], np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf, tiled=False)).reshape(-1, width)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _gather_step_times(step_s: float) -> list[float]:
    """Every process's step time (one process: its own)."""
    import jax

    if jax.process_count() == 1:
        return [step_s]
    from jax.experimental import multihost_utils

    return [float(x) for x in np.asarray(multihost_utils.process_allgather(np.float32(step_s))).ravel()]


def _producers(events) -> dict[str, str]:
    out: dict[str, str] = {}
    for ev in events:
        out.update(ev.producers)
    return out


def _sampler_side(x, traj) -> bool:
    """True for the sampler's own host arrays; the learner's fields are device arrays."""
    return isinstance(x, np.ndarray)




def _signature(keys, fields) -> dict:
    """What must agree between stages for one group: keys, rows, batch size, response length, mask sums."""
    batch = sorted({f["shape"][0] for f in fields if f["shape"]})
    resp = sorted({f["shape"][1] for f in fields if f["name"] in RESPONSE_FIELDS and len(f["shape"]) == 2})
    sums = [sum(f["mask_sum"]) for f in fields if f["name"] in RESPONSE_FIELDS and "mask_sum" in f]
    return {"keys": list(keys), "rows": len(keys), "batch": batch or None, "resp_len": resp or None,
            "mask_sum": sorted(set(sums)) or None}


def _local_devices():
    import jax

    return jax.local_devices()
