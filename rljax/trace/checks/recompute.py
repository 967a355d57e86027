"""The re-derivation checks: one per re-derivation of :mod:`rljax.trace.recompute`, read from
``trace_summary.json`` ``recompute``.

Each is PASS only when it ran (steps and rows counted), FAIL naming the first violation's
step, tensor, stage, trajectory key, uid (and session), N/A with the reason when it cannot
apply to the run (never a pass). The weights check re-ties the recorded digests itself: every
sampler record (install, decoded chunks) of a version against the learner's digest of it.
"""

from __future__ import annotations

from typing import Optional

from rljax.trace.checks.base import FAIL, NA, PASS, Result, Run

#: check -> (its name in the report, what PASS says was re-derived)
NAMES = {
    "advantages": ("advantages re-derived from scores and uids",
                   "the advantages the update consumed == the configured estimator on the scores and the uids' groups"),
    "group_ids": ("group ids follow the uids", "rows share a group_id exactly when they share a uid"),
    "response_mask": ("loss mask re-derived from token roles",
                      "the loss mask the update consumed == the policy's sampled tokens (prompt, padding and "
                      "observations excluded), position by position"),
    "positions": ("positions re-derived from attention", "every attended position == attended tokens before it"),
    "update_report": ("the update's own report",
                      "rows and tokens the loss consumed per row and micro-batch, its denominators and aggregation "
                      "mode == the batch and the configuration"),
    "rewards": ("rewards re-scored", "re-scored rows == the scores the reward stage recorded"),
    "weights": ("sampler weights tied to the learner's digests",
                "every version the sampler installed and decoded with has the learner's parameter digest, "
                "and every update started from the parameters the previous one left"),
}


def _section(run) -> tuple[Optional[dict], Optional[str]]:
    s = run.summary
    if s is None:
        return None, "trace_summary.json missing (see 'trace summary saved')"
    rec = s.get("recompute")
    if rec is None:
        return None, "trace_summary.json has no recompute section (a run traced before the re-derivations)"
    return rec, None


def _first(v: dict) -> str:
    session = f", session {v['session']}" if v.get("session") is not None else ""
    return (f"step {v['step']} tensor {v['tensor']} at {v['stage']}, {v['key']} (uid {v['uid']}{session}): "
            f"{v['detail']}")


def _check(run: Run, name: str) -> Result:
    title, what = NAMES[name]
    rec, missing = _section(run)
    if rec is None:
        return NA, title, missing
    st = rec.get(name) or {}
    if st.get("violations"):
        return FAIL, title, f"{st.get('violating_rows')} row(s) in all; first: {_first(st['violations'][0])}"
    if name == "weights":
        bad = untied_weights(st)
        if bad:
            return FAIL, title, bad
    if st.get("na"):
        return NA, title, st["na"]
    if not st.get("steps") or not st.get("rows"):
        return NA, title, "did not run on any step (nothing to re-derive it from in this run)"
    extra = ""
    if name == "rewards":
        skipped = st.get("skipped_rows") or 0
        extra = f"; {st.get('s', 0.0):.3f} s of reward calls" + (
            f"; {skipped} drawn row(s) scored by their environment, not re-scored" if skipped else "")
    unit = "version record(s)" if name == "weights" else "row(s)"
    return PASS, title, f"{st['rows']} {unit} over {st['steps']} step(s): {what}{extra}"


def check_advantages_rederived(run: Run) -> Result:
    return _check(run, "advantages")


def check_group_ids_follow_uids(run: Run) -> Result:
    return _check(run, "group_ids")


def check_mask_from_roles(run: Run) -> Result:
    return _check(run, "response_mask")


def check_positions_rederived(run: Run) -> Result:
    return _check(run, "positions")


def check_update_report(run: Run) -> Result:
    return _check(run, "update_report")


def check_rewards_rescored(run: Run) -> Result:
    return _check(run, "rewards")


def check_weights_tied(run: Run) -> Result:
    return _check(run, "weights")


def untied_weights(st: dict) -> Optional[str]:
    """The first sampler record whose digest is not the learner's for its version (None: all tie)."""
    learner = st.get("learner") or {}
    for r in sorted(st.get("sampler") or [], key=lambda r: r["step"]):
        want = learner.get(str(r["version"]))
        if want is not None and r["digest"] != want:
            who = {"chunk": "the sampler decoded chunk(s)", "install": "the sampler install",
                   "reference": "the reference log-prob pass", "old": "the old log-prob pass"}.get(r["kind"], r["kind"])
            return (f"step {r['step']}: {who} labelled version {r['version']} with weights digest "
                    f"{r['digest']}, the learner's version {r['version']} has {want}")
    return None
