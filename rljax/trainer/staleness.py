"""What the asynchronous schedule records about a batch's staleness: the ``enqueue`` /
``dequeue`` stage facts and the step's ``async/*`` metrics (:mod:`rljax.trainer.async_loop`).

A row's staleness is ``learner_version - min_version``: how many updates the learner made
since the oldest weights the row was generated with. With several processes the dequeue
facts are recomputed over every process's rows in ``gather_rollout``
(:func:`rows_staleness`).
"""

from __future__ import annotations

import numpy as np


def staleness_facts(learner_version: int, min_version: np.ndarray, max_version: np.ndarray) -> dict:
    """The staleness of a trained batch's rows (``learner_version - min_version``): max, mean and
    histogram, the version range, and the rows whose generation spanned a weight push."""
    staleness = learner_version - min_version
    return {"staleness_max": int(staleness.max()), "staleness_mean": float(staleness.mean()),
            "min_version": int(min_version.min()), "max_version": int(max_version.max()),
            "spanning_rows": int((min_version < max_version).sum()),
            "staleness_hist": {str(k): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))}}


def rows_staleness(dequeued: dict, rows) -> dict:
    """Several processes: the dequeue facts (``dequeued``, this process's batch) with the staleness
    and the version spread of every process's rows (:class:`~rljax.trainer.distribute.RolloutRows`;
    each process's queue holds its own share of a batch, the learner trains all of them)."""
    facts = dict(dequeued)
    real = ~np.asarray(rows.is_padding)
    facts.update(staleness_facts(facts["learner_version"], np.asarray(rows.min_version)[real],
                                 np.asarray(rows.max_version)[real]))
    facts["version_span_max"] = int(np.asarray(rows.version_span)[real].max(initial=0))
    return facts


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


def async_metrics(facts: dict, pushes: int) -> dict:
    """``async/*`` of a step from its dequeue facts (staleness over every process's rows; queue and
    wait times this process's) and the weight pushes made so far. The generated and dropped rows and
    the pushes count from the run's start (a resume continues them from its checkpoint's; the facts hold
    this launch's queue counts and, under ``*_restored``, the checkpoint's)."""
    return {"async/staleness_mean": facts["staleness_mean"], "async/staleness_max": facts["staleness_max"],
            "async/dropped_stale": facts["dropped_stale"] + facts.get("dropped_stale_restored", 0),
            "async/dropped_overflow": facts["dropped_overflow"] + facts.get("dropped_overflow_restored", 0),
            "async/generated_rows": facts.get("generated_rows", 0) + facts.get("generated_rows_restored", 0),
            "async/queue_depth": facts["queue_depth"], "async/learner_wait_s": facts["learner_wait_s"],
            "async/rollout_wait_s": facts["rollout_wait_s"], "async/min_version": facts["min_version"],
            "async/max_version": facts["max_version"], "async/spanning_rows": facts["spanning_rows"],
            "async/version_span_max": facts.get("version_span_max", 0),
            "async/batch_index": facts["batch_index"], "async/weight_pushes": pushes,
            "async/staleness_hist": facts["staleness_hist"],
            "rollout/admitted_ahead": facts.get("admitted_ahead", 0)}
