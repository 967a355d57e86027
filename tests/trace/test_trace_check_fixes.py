"""``python -m rljax.trace check`` lines that could not fail where they should: each on a tiny run
directory written by hand (only the records the line reads; no training), with the healthy
directory beside the broken one so that each test also sees the line pass."""

import json

import pytest

from rljax.trace.check import CHECKS, run_checks
from rljax.trace.checks.base import FAIL, NA, PASS, Run
from rljax.trace.checks.records import check_masks
from rljax.trace.checks.steps import check_versions

FILES = "record files whole"
SESSIONS = "sessions per uid == rollout.n"


def write_run(path, records, summary=True):
    """A run directory holding ``records`` as trace.jsonl and, with ``summary``, a trace_summary.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary:
        (path / "trace_summary.json").write_text(json.dumps({"status": "completed"}))
    return path


def config(**values):
    """The trace's copy of the key fields (what Run reads without config.resolved.yaml)."""
    return {"step": 0, "uid": "-", "stage": "config_resolve", "keys": [], "config": {"values": values}}


def results(path):
    return {name: (status, detail) for status, name, detail in run_checks(str(path))}


# -- record files whole ---------------------------------------------------------------------------------------------

def test_record_files_whole_fails_on_a_run_that_wrote_no_trace(tmp_path):
    status, detail = results(tmp_path)[FILES]
    assert status == FAIL and "trace.jsonl" in detail and "trace_summary.json" in detail, detail


def test_record_files_whole_fails_without_the_summary_and_never_says_it_parses(tmp_path):
    run = write_run(tmp_path / "run", [config(**{"trainer.mode": "sync"})], summary=False)
    status, detail = results(run)[FILES]
    assert status == FAIL and "missing: trace_summary.json" in detail, detail
    (run / "trace_summary.json").write_text("{}")
    status, detail = results(run)[FILES]
    assert status == PASS and "trace_summary.json parse" in detail and "absent: " in detail, detail
    assert "topology.json" not in detail.split("absent: ")[0], detail  # absent, not said to parse


# -- weight version after each sync == next rollout's version -------------------------------------------------------

def sync(step, learner, sampler=None):
    """A weight_sync record as traces written before this check's fix have it (``next_rollout_version``
    copied from the sampler version: the check no longer reads it)."""
    sampler = learner if sampler is None else sampler
    return {"step": step, "uid": f"{step}-0", "stage": "weight_sync", "keys": [], "learner_version": learner,
            "sampler_version": sampler, "next_rollout_version": sampler}


def rollout(step, *versions):
    """A traced rollout of step ``step``: one trajectory per ``(min, max)`` version pair, as the sampler recorded them."""
    trajs = [{"key": f"{step}-0_{i}_0", "min_version": lo, "max_version": hi} for i, (lo, hi) in enumerate(versions)]
    return {"step": step, "uid": f"{step}-0", "stage": "rollout_sessions", "keys": [t["key"] for t in trajs],
            "trajectories": trajs, "min_version": min(lo for lo, _ in versions),
            "max_version": max(hi for _, hi in versions)}


def versions(tmp_path, records, **cfg):
    return check_versions(Run(str(write_run(tmp_path / "run", [config(**cfg), *records]))))


SYNC = {"trainer.mode": "sync"}


def test_versions_pass_and_name_the_last_step_without_a_next_rollout(tmp_path):
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1), rollout(2, (1, 1), (1, 1)), sync(2, 2)],
                                 **SYNC)
    assert status == PASS and "1 followed" in detail and "the last (step 2) has no next rollout" in detail, detail


def test_versions_fail_when_the_next_step_is_traced_without_its_rollout(tmp_path):
    """The sync record's own next-rollout version was its sampler version: step 2's rollout is what
    is compared, and a traced step 2 with no rollout record is not a pass on nothing."""
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1), sync(2, 2)], **SYNC)
    assert status == FAIL and "step 2" in detail and "no rollout_sessions" in detail, detail


def test_versions_compare_every_trajectory_the_sampler_recorded(tmp_path):
    bad = rollout(2, (1, 1), (0, 1))
    bad["min_version"] = 1  # the group's summary says 1..1; one trajectory sampled a token with version 0
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1), bad, sync(2, 2)], **SYNC)
    assert status == FAIL and "2-0_1_0" in detail and "0..1" in detail, detail


def test_versions_na_when_no_sync_has_a_next_rollout(tmp_path):
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1)], **SYNC)
    assert status == NA and "step 1" in detail, detail


@pytest.mark.parametrize("tau,expect", [(0, FAIL), (1, NA)])
def test_versions_async_lag_fails_only_without_staleness(tmp_path, tau, expect):
    """Async: step 2 trained a batch sampled before the sync after step 1 (version 0); with tau=0
    that is wrong, with tau=1 it is allowed and left to 'trained staleness within tau'."""
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1), rollout(2, (0, 0)), sync(2, 2)],
                                 **{"trainer.mode": "async", "async_training.max_staleness": tau})
    assert status == expect, detail


def test_versions_fail_when_the_sampler_did_not_install_the_sync(tmp_path):
    status, _, detail = versions(tmp_path, [rollout(1, (0, 0)), sync(1, 1, sampler=0), rollout(2, (0, 0))], **SYNC)
    assert status == FAIL and "sampler 0" in detail, detail


# -- loss_mask consumed by the update == rollout's response_mask ----------------------------------------------------

def mask_run(tmp_path, sampler_rows, learner_rows):
    keys = [f"1-0_{i}_0" for i in range(learner_rows)]
    tf = {"step": 1, "uid": "1-0", "stage": "trajectory_fields", "keys": keys,
          "trajectories": [{"key": f"1-0_{i}_0", "response_mask_sum": 3, "response_len": 3, "observation_tokens": 0}
                           for i in range(sampler_rows)]}
    am = {"step": 1, "uid": "1-0", "stage": "actor_minibatch", "keys": keys,
          "fields": [{"name": "loss_mask", "mask_sum": [3] * learner_rows}]}
    return check_masks(Run(str(write_run(tmp_path / "run", [tf, am]))))


def test_masks_pass_when_every_trajectory_is_compared(tmp_path):
    status, _, detail = mask_run(tmp_path, 4, 4)
    assert status == PASS and detail.startswith("4 traced"), detail


@pytest.mark.parametrize("sampler_rows,learner_rows", [(3, 4), (4, 3)])
def test_masks_fail_when_the_trajectory_counts_differ(tmp_path, sampler_rows, learner_rows):
    status, _, detail = mask_run(tmp_path, sampler_rows, learner_rows)
    assert status == FAIL and "step 1 group 1-0" in detail, detail
    assert f"loss_mask has {learner_rows} trajectories" in detail and f"trajectory_fields {sampler_rows}" in detail


# -- run_checks: a check that raises -------------------------------------------------------------------------------

def test_a_check_that_raises_fails_under_its_own_line(tmp_path):
    """A malformed trajectory key (no session number) makes the sessions check raise: its FAIL is
    under its printed line, with the exception on one line, and every line is still reported once."""
    bad = {"step": 1, "uid": "1-0", "stage": "rollout_sessions", "keys": ["1-0_x"], "n": 1, "sessions": [0]}
    run = write_run(tmp_path / "run", [config(**{"rollout.n": 1, "trainer.mode": "sync"}), bad])
    got = run_checks(str(run))
    status, detail = {name: (s, d) for s, name, d in got}[SESSIONS]
    assert status == FAIL and detail.startswith("ValueError: ") and "\n" not in detail, detail
    empty = tmp_path / "empty"
    empty.mkdir()
    assert [name for _, name, _ in got] == [name for _, name, _ in run_checks(str(empty))]
    assert len(got) == len(CHECKS)
