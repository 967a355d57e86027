"""``python -m rljax.trace check RUN_DIR``: verify a run from its files alone.

Each check returns ``(status, name, detail)`` with ``status`` one of ``PASS``, ``WARN`` (the
run is correct but something deserves a look, e.g. a warning-severity alert fired), ``FAIL``
or ``N/A`` (the check does not apply to this run, e.g. no tool observations); WARN and N/A
are counted apart, never as a pass. :func:`exit_code` turns the results into the CLI's exit
status: 1 on any FAIL (and, with ``strict``, on any WARN), else 0.

The run's mode and settings come from ``config.resolved.yaml`` (the trace's config record
only when that file is missing or unreadable), so a run that stopped before writing its
trace is still checked as what it was configured to be. Producers and consumers in the
trace are what the step runner observed (the stage that wrote a field, the stages that read
it), so these checks compare the run with what the configuration implies, not with a second
hand-kept table. Alerts of ``error`` severity in the run fail it; ``warning`` ones warn.
"""

from __future__ import annotations

import tempfile
from typing import Callable

from rljax.trace.checks import asynchronous, ending, prompts, recompute, records, steps
# What callers of this module read (the CLI, tests, scripts): the run, the statuses, every check.
from rljax.trace.checks.asynchronous import check_async_drops, check_async_future, check_async_staleness
from rljax.trace.checks.base import FAIL, NA, PASS, STATUSES, WARN, Result, Run, read_trace
from rljax.trace.checks.ending import check_alerts, check_cleanup, check_files_whole, check_summary, check_updates
from rljax.trace.checks.prompts import check_every_prompt_trained_once, check_filtered_groups, check_rollout_unique
from rljax.trace.checks.records import (check_behaviour_logp, check_group_consistency, check_invariants, check_masks,
                                        check_padding, check_producers, check_response_len, check_sessions,
                                        check_timestamps, stages_run)
from rljax.trace.checks.steps import check_actor_dp, check_config, check_minibatch, check_token_versions, check_versions

#: Every check, in the order it runs and prints. A check is a function ``(Run) -> Result`` in a
#: module of :mod:`rljax.trace.checks` (one module per subject; a new subject, a new module).
#: Registering a check is one line here, where it should run: ``module.check_name,`` (a new
#: module also joins the ``from rljax.trace.checks import ...`` line above).
CHECKS: tuple[Callable[[Run], Result], ...] = (
    ending.check_files_whole,
    steps.check_config,
    records.check_group_consistency,
    records.check_sessions,
    records.check_response_len,
    records.check_producers,
    records.check_behaviour_logp,
    records.check_masks,
    records.check_invariants,
    records.check_timestamps,
    records.check_padding,
    steps.check_minibatch,
    steps.check_actor_dp,
    steps.check_versions,
    steps.check_token_versions,
    ending.check_cleanup,
    ending.check_alerts,
    ending.check_updates,
    ending.check_summary,
    asynchronous.check_async_staleness,
    asynchronous.check_async_future,
    asynchronous.check_async_drops,
    prompts.check_rollout_unique,
    prompts.check_every_prompt_trained_once,
    prompts.check_filtered_groups,
    recompute.check_advantages_rederived,
    recompute.check_group_ids_follow_uids,
    recompute.check_mask_from_roles,
    recompute.check_positions_rederived,
    recompute.check_update_report,
    recompute.check_rewards_rescored,
    recompute.check_weights_tied,
)


def exit_code(results: list[Result], *, strict: bool = False) -> int:
    """1 when a check failed (or, ``strict``, warned), else 0."""
    bad = (FAIL, WARN) if strict else (FAIL,)
    return 1 if any(r[0] in bad for r in results) else 0


def run_checks(run_dir: str) -> list[Result]:
    try:
        run = Run(run_dir)
    except Exception as e:  # e.g. topology.json or trace_summary.json is not JSON
        return [(FAIL, "run files readable", f"{type(e).__name__}: {e}")]
    out = []
    for check in CHECKS:
        try:
            out.append(check(run))
        except Exception as e:  # a malformed file fails its check, not the tool, under the check's own line
            detail = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            out.append((FAIL, line_name(check), detail))
    return out


def line_name(check: Callable[[Run], Result]) -> str:
    """The line ``check`` prints: every check returns its one name whatever its verdict, so a run
    directory with no files gives it (tests/trace/test_trace_guide.py holds each check to that); the
    function's name minus ``check_`` only if even that raises."""
    with tempfile.TemporaryDirectory() as empty:
        try:
            return check(Run(empty))[1]
        except Exception:  # noqa: BLE001 -- a name is still needed
            return check.__name__.removeprefix("check_")
