"""Checks of an asynchronous run (``trainer.mode=async``; N/A otherwise): staleness within tau, no
future weight version trained, every dropped row counted."""

from __future__ import annotations

from rljax.trace.checks.base import FAIL, PASS, Result, Run, mode_result


def _dequeues(run: Run) -> list[dict]:
    return run.by_stage("dequeue")


def check_async_staleness(run: Run) -> Result:
    """trainer.mode=async: every trained row's staleness (learner version - oldest version it saw) is within tau,
    in the trace (traced groups), in metrics.jsonl (every step's maximum) and in the summary's histogram."""
    name = "trained staleness within tau"
    na = mode_result(run, name)
    if na is not None:
        return na
    tau = run.config_values.get("async_training.max_staleness")
    bad = []
    for r in _dequeues(run):
        for s in (r.get("group") or {}).get("staleness") or []:
            if s > tau:
                bad.append(f"step {r['step']} uid {r['uid']}: staleness {s}")
    steps = 0
    for step, m in sorted(run.metrics.items()):
        if "async/staleness_max" in m:
            steps += 1
            if m["async/staleness_max"] is None or m["async/staleness_max"] > tau:
                bad.append(f"step {step}: async/staleness_max {m['async/staleness_max']}")
    hist = ((run.summary or {}).get("async") or {}).get("staleness_hist") or {}
    bad += [f"summary histogram: {n} row(s) at staleness {k}" for k, n in hist.items() if int(k) > tau]
    if bad:
        return FAIL, name, f"tau={tau}: " + "; ".join(bad[:3])
    if not steps:
        return FAIL, name, "no async/staleness_max in metrics.jsonl"
    return PASS, name, f"tau={tau}: {steps} step(s), histogram {dict(sorted(hist.items()))}"


def check_async_future(run: Run) -> Result:
    """trainer.mode=async: no trained trajectory saw a weight version newer than the learner's."""
    name = "no future weight version trained"
    na = mode_result(run, name)
    if na is not None:
        return na
    recs = _dequeues(run)
    for r in recs:
        g = r.get("group") or {}
        if g.get("max_version") is not None and g["max_version"] > r.get("learner_version", -1):
            return FAIL, name, (f"step {r['step']} uid {r['uid']}: max_version {g['max_version']} > learner version "
                                f"{r.get('learner_version')}")
    for step, m in sorted(run.metrics.items()):
        if "async/max_version" in m and m["async/max_version"] is not None and \
                m["async/max_version"] > m.get("training/weight_version", 0) - 1:
            return FAIL, name, (f"step {step}: async/max_version {m['async/max_version']} > the learner version "
                                f"{m.get('training/weight_version', 0) - 1} it trained at")
    if not recs:
        return FAIL, name, "no dequeue records in the trace"
    return PASS, name, f"{len(recs)} traced dequeue(s): every version <= the learner's"


def check_async_drops(run: Run) -> Result:
    """trainer.mode=async: every dropped row is counted: the queue's final counts equal the last metrics' plus
    what was dropped after the last trained batch, and batches put = trained + dropped + left in flight. The
    metrics count the run's drops; the summary's queue counts are its last launch's, the rows its checkpoint
    counted dropped before it under ``dropped_*_restored`` (a summary without them: none)."""
    name = "every dropped row counted"
    na = mode_result(run, name)
    if na is not None:
        return na
    a = (run.summary or {}).get("async")
    if not a:
        return FAIL, name, "trace_summary.json has no async section"
    last = [m for _, m in sorted(run.metrics.items()) if "async/dropped_stale" in m]
    if not last:
        return FAIL, name, "no async/dropped_* in metrics.jsonl"
    m = last[-1]
    for kind in ("stale", "overflow"):
        logged, final = m.get(f"async/dropped_{kind}"), a.get(f"final_dropped_{kind}")
        before = int(a.get(f"dropped_{kind}_restored", 0))
        if final is None or logged is None or final + before < logged:
            resumed = f" + {before} dropped before the resume" if before else ""
            return FAIL, name, f"dropped_{kind}: metrics say {logged}, the queue's final count {final}{resumed}"
        if logged < before:
            return FAIL, name, (f"dropped_{kind}: metrics say {logged}, fewer than the {before} the run's checkpoint "
                                "counted dropped before the resume (the count restarted)")
    rows_per_batch = a["trained_rows"] / max(a["trained_batches"], 1)
    dropped = (a["final_dropped_stale"] + a["final_dropped_overflow"]) / rows_per_batch if rows_per_batch else 0
    put = a.get("batches_put", 0)
    if a["trained_batches"] + dropped > put + 1e-6:
        return FAIL, name, (f"{a['trained_batches']} trained + {dropped:g} dropped batch(es) > {put} put into the "
                            "queue")
    qsize = run.config_values.get("async_training.queue_size")
    if run.config_values.get("async_training.overflow") == "drop_stalest" and rows_per_batch and qsize:
        over = a["final_dropped_overflow"] / rows_per_batch  # the throttle: <= queue_size per trained batch
        if over > qsize * (a["trained_batches"] + 1) + 1e-6:
            return FAIL, name, (f"{over:g} batch(es) dropped for overflow to train {a['trained_batches']}: more than "
                                f"async_training.queue_size={qsize} per trained batch (the producer was not throttled)")
    before = [int(a.get(f"dropped_{kind}_restored", 0)) for kind in ("stale", "overflow")]
    resumed = f" (and {before[0]} stale, {before[1]} overflow before the resume)" if any(before) else ""
    return PASS, name, (f"{a['final_dropped_stale']} stale and {a['final_dropped_overflow']} overflow row(s) dropped "
                        f"and counted{resumed}; {a['trained_batches']} of {put} queued batch(es) trained")
