"""``trace_summary.json`` survives a launch that ends before it closes (a SIGKILL after the last
step, a signal or an error after the last step's records): the tracer writes the summary so far
after every step (status ``running``), and a resume of a run that trained every step completes
it (:func:`rljax.trace.tracer.complete_summary`) instead of overwriting it with an empty one.
The end-to-end kills are tests/trainer/test_async_kill_resume.py (slow). The summary of a run with a
fault hook armed holds each fault's counts (its ``faults``)."""

import json
import shutil

from rljax.trace.check import FAIL, PASS, WARN, Run, check_invariants, check_summary
from rljax.trace.summary import summarize_run
from rljax.trace.tracer import complete_summary

from test_trace_alerts import _step


def _summary(run) -> dict:
    return json.loads((run / "trace_summary.json").read_text())


def test_the_summary_after_each_step_is_what_close_writes_once_completed(tmp_path):
    run, copy = tmp_path / "run", tmp_path / "killed"
    tracer, _ = _step(run, steps=2)
    s = _summary(run)  # the launch "dies" here: no close()
    assert s["status"] == "running" and s["last_step"] == 2 and s["steps"] == 2 and s["records"] > 0
    status, _, detail = check_summary(Run(str(run)))
    assert status == FAIL and "without closing its summary" in detail, detail
    assert "status: running (records up to step 2)" in summarize_run(str(run))
    shutil.copytree(run, copy)
    line = complete_summary(str(copy), 2)
    assert line.startswith("its trace_summary.json was completed") and "killed" in line, line
    assert check_summary(Run(str(copy)))[0] == PASS and check_invariants(Run(str(copy)))[0] == PASS
    assert "status: completed by a resume: the launch that trained step 2 ended" in summarize_run(str(copy))
    completed = _summary(copy)
    assert completed.pop("stopped")["how"].endswith("ended before closing it: killed")
    closed = json.loads(json.dumps(tracer.close()))  # what the launch would have written
    assert completed == closed
    assert complete_summary(str(copy), 2) is None  # closed: nothing to do


def test_a_stop_after_the_last_step_is_completed_and_anything_else_is_left_as_it_is(tmp_path):
    run = tmp_path / "run"
    tracer, _ = _step(run, steps=2)
    tracer.close(error="StopRequested: stopped by SIGTERM after step 2; saved checkpoint 2", step=2)
    assert check_summary(Run(str(run)))[0] == FAIL
    before = (run / "trace_summary.json").read_bytes()
    line = complete_summary(str(run), 3)  # the checkpoint is a step the summary does not reach
    assert "covers the steps up to 2, not 3" in line and (run / "trace_summary.json").read_bytes() == before
    assert "SIGTERM" in complete_summary(str(run), 2)
    s = _summary(run)
    assert s["status"] == "completed" and s["stopped"]["failed_at_step"] == 2 and "error" not in s
    assert check_summary(Run(str(run)))[0] == PASS
    (run / "trace_summary.json").unlink()
    assert "is missing, and cannot be rebuilt" in complete_summary(str(run), 2)
    assert not (run / "trace_summary.json").exists()


def test_an_async_summary_gets_final_queue_counts_said_to_be_the_last_batchs(tmp_path):
    (tmp_path / "trace_summary.json").write_text(json.dumps({
        "status": "running", "last_step": 4, "steps": 4,
        "async": {"trained_rows": 128, "trained_batches": 4, "dropped_stale": 32, "dropped_overflow": 0,
                  "generated_rows": 192}}))
    complete_summary(str(tmp_path), 4)
    a = _summary(tmp_path)["async"]
    assert (a["final_dropped_stale"], a["final_dropped_overflow"], a["final_generated_rows"], a["batches_put"]) == \
        (32, 0, 192, 6)
    assert "as of the last trained batch (step 4)" in a["final_counts"]


def test_a_summary_that_cannot_be_written_between_steps_does_not_stop_the_run(tmp_path, monkeypatch):
    """On a full disk the records' own writes stop the run and name their file (tests/launch/
    test_disk_faults.py); the summary between steps is best effort and never the first to fail it."""
    import errno

    import rljax.trace.tracer as tracer_module

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(tracer_module, "write_atomic", full)
    run = tmp_path / "run"
    _step(run, steps=2)
    assert (run / "trace.jsonl").read_text().count("\n") > 0 and not (run / "trace_summary.json").exists()


def test_a_runs_summary_holds_each_faults_counts_and_check_and_summary_print_them(tmp_path):
    """``trace_summary.json``'s ``faults``: each armed fault's chances and acts (one that acted, one whose hook never
    ran); ``trace check``'s "trace summary saved" (WARN) and ``trace summary`` say them in the stderr line's words;
    a summary written before the counts (a list of names) still reads."""
    from rljax.trace import faults

    faults.enable("keep_batch_field", "swap_rewards")
    try:
        assert faults.active("keep_batch_field")  # a hook acting, as step_metrics' does
        tracer, _ = _step(tmp_path / "run", steps=1)
        line = faults.report()
        tracer.close()
    finally:
        faults.disable()
    s = json.loads((tmp_path / "run" / "trace_summary.json").read_text())
    assert s["faults"] == {"keep_batch_field": {"chances": 1, "acted": 1}, "swap_rewards": {"chances": 0, "acted": 0}}
    words = "keep_batch_field acted 1 of 1; swap_rewards acted 0 of 0 (NEVER ACTED: no hook of it ran)"
    assert line == f"rljax faults: {words}"
    status, _, detail = check_summary(Run(str(tmp_path / "run")))
    assert status == WARN and detail.startswith(f"faults switched on (rljax.trace.faults, tests only): {words}; ")
    assert f"faults switched on (rljax.trace.faults, tests only): {words}" in summarize_run(str(tmp_path / "run"))
    s["faults"] = ["keep_batch_field"]  # an older summary
    (tmp_path / "run" / "trace_summary.json").write_text(json.dumps(s))
    status, _, detail = check_summary(Run(str(tmp_path / "run")))
    assert status == WARN and "tests only): keep_batch_field (no counts recorded); " in detail, detail
