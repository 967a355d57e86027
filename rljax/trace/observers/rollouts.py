"""Which process generated which prompt uids each step (``rollout_uids.jsonl``, counted in the
summary), the rollout dumps (``trace.rollout_dump``), and an asynchronous run's queue counts
(staleness histogram, trained and dropped rows)."""

from __future__ import annotations

import os
from itertools import compress
from typing import Mapping, Optional

import numpy as np

from rljax.trace import alerts as A
from rljax.trace._io import append_lines, compact_json

#: One line per step: the prompt uids each process generated (``{"step", "by_process": {process: [uid]}}``).
ROLLOUT_FILE = "rollout_uids.jsonl"


class Rollouts:
    """The prompts each step generated, per process."""

    def __init__(self, run_dir: str, *, enabled: bool, dump: bool, writer=None):
        self.run_dir, self.enabled, self.dump_enabled = run_dir, enabled, dump
        self.writer = writer  # rljax.trace.writer.Writer: the line is appended off the step (None: here)
        self.summary: Optional[dict] = None  # uids generated per process

    def step(self, step: int, rows, fields: Mapping) -> None:
        """Which process generated which prompt uids this step (``rollout_uids.jsonl``; counts in the summary)."""
        if hasattr(rows, "by_process"):
            by = rows.by_process()
        else:  # one process generated every row
            real = (~np.asarray(rows.is_padding)).tolist()
            # the real rows' uids in first-seen order (told apart before str: a uid repeats rollout.n times)
            by = {"0": list(dict.fromkeys(map(str, dict.fromkeys(compress(rows.uid, real)))))}
        item = fields.get("dequeue") or {}
        r = self.summary = self.summary or {"file": ROLLOUT_FILE, "uids_by_process": {}, "steps": 0}
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
            path = os.path.join(self.run_dir, ROLLOUT_FILE)
            job = lambda: append_lines(path, compact_json(rec) + "\n")  # noqa: E731
            job() if self.writer is None else self.writer.put(job)

    def dump(self, step: int, traj) -> None:
        """``trace.rollout_dump``: this process's own rows of the step, as ``.npz``."""
        if not self.dump_enabled:
            return
        import jax

        d = os.path.join(self.run_dir, "rollouts", f"process{jax.process_index()}")
        os.makedirs(d, exist_ok=True)
        np.savez(os.path.join(d, f"step{int(step)}.npz"), uid=np.asarray(traj.uid, dtype=str),
                 session=np.asarray(traj.session), is_padding=np.asarray(traj.is_padding),
                 prompt_ids=traj.prompt_ids, response_ids=traj.response_ids,
                 response_length=traj.response_length, rollout_logp=traj.rollout_logp)


class AsyncCounts:
    """``trainer.mode=async``: the staleness histogram of the trained rows, the batches trained, the
    rows dropped (stale, overflow) and generated, and the queue's final counts: this launch's. A
    resumed launch also keeps the rows its checkpoint counted dropped before it
    (``dropped_*_restored``): ``async/dropped_*`` are the run's, these plus this launch's."""

    def __init__(self, alert_drop_rate: float):
        self.alert_drop_rate = alert_drop_rate
        self.summary: Optional[dict] = None

    def step(self, d: Mapping) -> list:
        """A dequeued batch's counts; the drop-rate alert when too many generated rows were dropped."""
        a = self.summary = self.summary or {"staleness_hist": {}, "trained_rows": 0, "trained_batches": 0,
                                            "max_staleness": d.get("max_staleness"), "staleness_max": 0,
                                            "dropped_stale": 0, "dropped_overflow": 0}
        for k, v in (d.get("staleness_hist") or {}).items():
            a["staleness_hist"][k] = a["staleness_hist"].get(k, 0) + int(v)
            a["trained_rows"] += int(v)
        a["trained_batches"] += 1
        a["staleness_max"] = max(a["staleness_max"], int(d.get("staleness_max", 0)))
        a["dropped_stale"], a["dropped_overflow"] = int(d.get("dropped_stale", 0)), int(d.get("dropped_overflow", 0))
        for kind in ("stale", "overflow"):
            a[f"dropped_{kind}_restored"] = int(d.get(f"dropped_{kind}_restored", 0))
        a["generated_rows"] = int(d.get("generated_rows", 0))
        alert = A.drop_rate_alert(a["dropped_stale"] + a["dropped_overflow"], a["generated_rows"], self.alert_drop_rate)
        return [alert] if alert else []

    def totals(self, stats: Mapping) -> None:
        """The queue's final counts (drops after the last trained batch included)."""
        if self.summary is not None:
            self.summary.update(final_dropped_stale=int(stats.get("dropped_stale", 0)),
                                final_dropped_overflow=int(stats.get("dropped_overflow", 0)),
                                batches_put=int(stats.get("put", 0)), max_queue_depth=int(stats.get("max_depth", 0)),
                                final_generated_rows=int(stats.get("put_rows", 0)))
