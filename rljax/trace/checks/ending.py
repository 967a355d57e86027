"""Checks of what the run left: whole record files, every batch field released after each step,
alerts, finite updates and a closed trace summary."""

from __future__ import annotations

import os

from rljax.trace import faults
from rljax.trace.alerts import SEVERITY
from rljax.trace.checks.base import FAIL, NA, PASS, WARN, Result, Run
from rljax.trace.tracer import SUMMARY_FILE, TRACE_FILE


def check_files_whole(run: Run) -> Result:
    """The JSON-lines files and the JSON summaries parse: a cut last line (a kill or a full disk
    while writing it) or a damaged line is named here; the other checks read the complete records."""
    name = "record files whole"
    if run.cut:
        return FAIL, name, (f"cut short or unreadable: {'; '.join(run.cut[:4])}{' ...' if len(run.cut) > 4 else ''} "
                            "(a write that did not finish: a full disk or a kill)")
    # A run that wrote no trace, or never wrote its summary, has nothing whole to check: those two
    # files are what `trace check` reads (the lines that read them fail too); the others may be absent
    # (named, never said to parse).
    missing = [n for n in (TRACE_FILE, SUMMARY_FILE) if not os.path.exists(os.path.join(run.dir, n))]
    if missing:
        return FAIL, name, f"missing: {', '.join(missing)} (the run wrote no trace, or was stopped before writing it)"
    present = [n for n, f in run.files.items() if os.path.exists(f.path)]
    parsed = [n for n in ("topology.json", SUMMARY_FILE) if os.path.exists(os.path.join(run.dir, n))]
    absent = [n for n in (*run.files, "topology.json") if n not in present + parsed]
    return PASS, name, (", ".join(f"{n}: {len(run.files[n].records)} records" for n in present)
                        + f"; {' and '.join(parsed)} parse" + (f"; absent: {', '.join(absent)}" if absent else ""))


def check_cleanup(run: Run) -> Result:
    name = "nothing left in the buffer after cleanup"
    recs = run.by_stage("cleanup")
    if not recs:
        return FAIL, name, "no cleanup records"
    for r in recs:
        if "tracked_objects" not in r:
            return FAIL, name, f"step {r['step']}: the cleanup record has no live-batch registry report"
        if r.get("remaining_keys") or not r.get("released"):
            return FAIL, name, (f"step {r['step']}: {len(r.get('remaining_keys') or [])} batch field(s) still "
                                f"referenced after the step: {', '.join((r.get('remaining_keys') or [])[:5])}")
    tracked = max(r["tracked_objects"] for r in recs)
    return PASS, name, (f"{len(recs)} cleanup record(s): every batch field released "
                        f"(up to {tracked} objects followed per step)")


def check_alerts(run: Run) -> Result:
    """Error-severity alerts fail the run; warnings are reported."""
    name = "no error-severity alerts"
    alerts = dict((run.summary or {}).get("alerts") or {})
    for step, m in sorted(run.metrics.items()):  # also alerts that only reached metrics.jsonl
        for k, v in m.items():
            if k.startswith("alerts/") and v:
                a = k.split("/", 1)[1]
                if a not in alerts:
                    alerts[a] = {"count": 1, "severity": SEVERITY.get(a, "warning"), "first_step": step}
    errors = {k: v for k, v in alerts.items() if isinstance(v, dict) and v.get("severity") == "error"}
    if errors:
        k, v = next(iter(sorted(errors.items())))
        return FAIL, name, (f"{len(errors)} error alert kind(s): {k} x{v.get('count')} (first at step "
                            f"{v.get('first_step')}: {v.get('message', '')})")
    warns = {k: v for k, v in alerts.items()}
    if warns:
        return WARN, name, "warning alert(s): " + "; ".join(
            f"{k} x{v.get('count')} (first at step {v.get('first_step')}: {v.get('message', '')})"
            if isinstance(v, dict) else f"{k} x{v}" for k, v in sorted(warns.items()))
    return PASS, name, "no alerts"


def check_updates(run: Run) -> Result:
    """Every training step applied its update: no ``alerts/nonfinite_update``, the cumulative
    ``actor/skipped_updates`` never grows, loss and gradient norm are finite (not null)."""
    name = "updates finite"
    bad, prev, steps = [], 0, 0
    for step, m in sorted(run.metrics.items()):
        if "actor/skipped_updates" not in m and "alerts/nonfinite_update" not in m:
            continue
        steps += 1
        skipped = m.get("actor/skipped_updates")
        grew = skipped is not None and skipped > prev
        nulls = [k for k in ("actor/loss", "actor/grad_norm") if k in m and m[k] is None]
        if m.get("alerts/nonfinite_update") or grew or nulls:
            bad.append(f"step {step}" + (f" ({', '.join(nulls)} null)" if nulls else ""))
        prev = skipped if skipped is not None else prev
    if bad:
        return FAIL, name, f"{len(bad)} of {steps} step(s) skipped their update as non-finite: {', '.join(bad[:5])}"
    if not steps:
        return NA, name, "no training steps in metrics.jsonl"
    return PASS, name, f"{steps} step(s), every update applied"


def check_summary(run: Run) -> Result:
    name = "trace summary saved"
    s = run.summary
    if not s:
        return FAIL, name, f"{SUMMARY_FILE} missing"
    if s.get("status") == "failed":
        return FAIL, name, f"the run failed at step {s.get('failed_at_step')}: {s.get('error')}"
    if s.get("status") == "running":
        return FAIL, name, (f"the run stopped after step {s.get('last_step')} without closing its summary (killed, or "
                            "still running): --resume trains the rest (or completes the summary of a run that "
                            "trained every step)")
    if not s.get("records") or not s.get("traced_uids"):
        return FAIL, name, f"{SUMMARY_FILE} records no trace"
    uids = {r["uid"] for r in run.records}
    missing = [u for u in s["traced_uids"] if u not in uids]
    if missing:
        return FAIL, name, f"{SUMMARY_FILE} lists uid(s) absent from {TRACE_FILE}: {missing[:3]}"
    files = [f for f in ("shape_ledger.json", "memory_ledger.json") if not os.path.exists(os.path.join(run.dir, f))]
    note = f"; missing ledger(s): {', '.join(files)}" if files else "; shape and memory ledgers present"
    frac = 100 * s.get("overhead_frac_median", 0)
    if s.get("faults"):
        return WARN, name, (f"faults switched on (rljax.trace.faults, tests only): {faults.describe(s['faults'])}; "
                            f"{s['records']} records, {s['steps']} steps")
    return PASS, name, (f"{s['records']} records, {s['steps']} steps, overhead {frac:.1f}% "
                        f"of step time{note}")
