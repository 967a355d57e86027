"""``python -m rljax.trace check`` lines that could not fail where they should: each on a tiny run
directory written by hand (only the records the line reads; no training), with the healthy
directory beside the broken one so that each test also sees the line pass."""

import json

from rljax.trace.check import run_checks
from rljax.trace.checks.base import FAIL, PASS

FILES = "record files whole"


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

