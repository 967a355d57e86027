"""A resume keeps its run (issue 25 item 5, issue 28 item 3): the recorded configuration, refusals
before anything is written, no appending to another run's files, records cut back on resume.

Everything here stops before JAX starts (seconds); the runs that train are in
tests/launch/test_reliability_signals.py (slow).
"""

import argparse
import hashlib
import json
import os
import signal

import pytest
from launching import launch

from rljax._resume import ResumeRefused, nothing_to_train, plan
from rljax.launch import finished_run
from rljax.config import resolve, write_resolved
from rljax.trainer.guard import StopSignals, cut_jsonl


def _run_dir(tmp_path, overrides=("trainer.total_steps=60", "rollout.n=4"), checkpoints=(20,)):
    run = tmp_path / "run"
    run.mkdir()
    cfg, prov = resolve("default", list(overrides))
    write_resolved(cfg, prov, run / "config.resolved.yaml")
    (run / "topology.json").write_text('{"mesh": {"dp": 1}}\n')
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(0, 21)))
    for s in checkpoints:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
    return run


def _digests(run) -> dict:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_bare_resume_restores_the_recorded_configuration_with_overrides_listed(tmp_path):
    """Issue 25 (4): a bare --resume used the preset's defaults (a finished 60-step run went on to 300)."""
    run = _run_dir(tmp_path)
    cfg, _, lines = plan(None, ["trainer.resume_mode=auto"], str(run))
    assert cfg.trainer.total_steps == 60 and cfg.rollout.n == 4
    assert lines == [f"resume: the run's recorded configuration {run}/config.resolved.yaml, no overrides"]
    cfg, _, lines = plan(None, ["trainer.total_steps=80", "trainer.resume_mode=auto"], str(run))
    assert cfg.trainer.total_steps == 80 and cfg.rollout.n == 4
    assert lines[0].endswith("with overrides: trainer.total_steps=80 (was 60)")


def test_a_recorded_resume_from_is_not_inherited(tmp_path):
    run = _run_dir(tmp_path, overrides=("trainer.total_steps=60", "trainer.resume_from=8"))
    cfg, _, _ = plan(None, ["trainer.resume_mode=auto"], str(run))
    assert cfg.trainer.resume_from is None
    cfg, _, _ = plan(None, ["trainer.resume_from=20", "trainer.resume_mode=auto"], str(run))
    assert cfg.trainer.resume_from == 20


@pytest.mark.parametrize("override, names", [
    ("model.hidden_size=48", "model.hidden_size: null in the run, 48 now"),
    ("actor.lora.rank=4", "actor.lora.rank: 0 in the run, 4 now"),
    ("algorithm.adv_estimator=gae", "a critic exists in only one of them"),
])
def test_a_key_that_would_break_the_run_is_refused_even_from_weights(tmp_path, override, names):
    run = _run_dir(tmp_path)
    for from_weights in (False, True):
        with pytest.raises(ResumeRefused, match="resume would break the run") as e:
            plan(None, [override], str(run), from_weights=from_weights)
        assert names in str(e.value)


def test_another_task_needs_resume_from_weights(tmp_path):
    """Issue 28 (5): --config tool_lookup --resume continued the addition task's run silently."""
    run = _run_dir(tmp_path)
    with pytest.raises(ResumeRefused) as e:
        plan("tool_lookup", [], str(run))
    msg = str(e.value)
    assert "resume under another task" in msg and "env.function: null in the run, 'lookup' now" in msg
    assert "--resume-from-weights" in msg and "\n" not in msg
    cfg, _, _ = plan("tool_lookup", [], str(run), from_weights=True)
    assert cfg.env.function == "lookup"


def test_refused_resumes_exit_2_and_change_no_file_of_the_run(tmp_path):
    """Issue 25 (4): a refused resume (LoRA onto a full run) overwrote config.resolved.yaml and topology.json."""
    run = _run_dir(tmp_path)
    before = _digests(run)
    for args in (["--resume", "actor.lora.rank=4"], ["--resume", "model.num_layers=3"],
                 ["--config", "tool_lookup", "--resume"]):
        out = launch("--run-dir", str(run), *args, timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("rljax.launch: error: resume ")
        assert _digests(run) == before


def test_a_fresh_launch_never_appends_to_an_existing_runs_files(tmp_path):
    """Issue 28 (5): a fresh launch into a directory without checkpoints appended to the old metrics.jsonl."""
    run = _run_dir(tmp_path, checkpoints=())
    before = _digests(run)
    out = launch("--run-dir", str(run), timeout=120)
    assert out.returncode == 2 and "holds a previous run's metrics.jsonl" in out.stderr
    assert "--resume" in out.stderr and out.stderr.count("\n") == 1
    assert _digests(run) == before


def test_records_after_the_restored_step_are_cut_from_every_record_file(tmp_path):
    """Issue 28 (8): replayed steps were written twice into trace.jsonl and rollout_uids.jsonl."""
    for name in ("trace.jsonl", "rollout_uids.jsonl"):
        path = tmp_path / name
        lines = [json.dumps({"step": s, "uid": f"u{s}"}) for s in (1, 2, 2, 3, 4)] + ['{"step": 5, "ui']
        path.write_text("\n".join(lines))
        assert cut_jsonl(str(path), 2) == 3
        assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [1, 2, 2]
        assert cut_jsonl(str(path), -1) == 3 and path.read_text() == ""


def test_sigint_is_a_stop_request_and_a_second_one_interrupts():
    """Issue 28 (6): Ctrl-C saved nothing (SIGTERM saved the step)."""
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM stays a request
        assert stop.requested == "SIGTERM"


def _finished(tmp_path, steps=(10, 20), digested=(10, 20)):
    """A run directory as a finished 20-step run leaves it: checkpoints (with digests), records, a
    closed trace summary, a released lock."""
    run = _run_dir(tmp_path, overrides=("trainer.total_steps=20", "rollout.n=4"), checkpoints=steps)
    for s in digested:
        (run / "checkpoints" / str(s) / "rljax_digest.json").write_text('{"step": %d, "files": {}}' % s)
    (run / "checkpoints" / "20" / "state").mkdir(exist_ok=True)
    (run / "checkpoints" / "20" / "state" / "d").write_bytes(os.urandom(64))
    for name in ("trace.jsonl", "rollout_uids.jsonl"):
        (run / name).write_text("".join(json.dumps({"step": s, "uid": f"{s}-0"}) + "\n" for s in range(1, 21)))
    (run / "trace_summary.json").write_text(json.dumps({"status": "completed", "last_step": 20, "steps": 20}))
    (run / "report.png").write_bytes(b"\x89PNG")
    (run / "rljax.lock").write_text("")
    return run


def test_a_finished_run_resumed_trains_nothing_and_writes_nothing(tmp_path):
    """A --resume of a run that trained every step overwrote its trace_summary.json with an empty
    one, appended a resume marker and rewrote config.resolved.yaml (trace check then FAILed three
    checks). Now: one line (which step, that the run is complete, how to train on), exit 0, before
    JAX starts, every file of the run byte-identical."""
    run = _finished(tmp_path)
    before = _digests(run)
    out = launch("--run-dir", str(run), "--resume", timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
    assert out.stdout.count("\n") == 1, out.stdout
    line = out.stdout.strip()
    assert line.startswith("rljax: resume: checkpoint 20 is at trainer.total_steps=20") and "complete" in line
    assert "trainer.total_steps=N, N > 20" in line
    assert _digests(run) == before


def test_which_resumes_have_nothing_to_train(tmp_path):
    """The launcher's decision reads the checkpoint directory as the restore chooses: at or past
    trainer.total_steps; a raised total_steps, an older --resume=N, or a newest checkpoint a kill
    left without a digest (a plain --resume passes it over) trains on."""
    cfg, _ = resolve("default", ["trainer.total_steps=20"])
    run = _finished(tmp_path)
    assert nothing_to_train(str(run), cfg) == 20
    more, _ = resolve("default", ["trainer.total_steps=30"])
    assert nothing_to_train(str(run), more) is None
    fewer, _ = resolve("default", ["trainer.total_steps=15"])
    assert nothing_to_train(str(run), fewer) == 20
    older, _ = resolve("default", ["trainer.total_steps=20", "trainer.resume_from=10"])
    assert nothing_to_train(str(run), older) is None
    (run / "checkpoints" / "20" / "rljax_digest.json").unlink()  # killed between the commit and the digest
    assert nothing_to_train(str(run), cfg) is None  # step 20 is trained again from checkpoint 10
    assert nothing_to_train(str(run), cfg, unverified=True) == 20


def test_a_finished_run_whose_last_launch_stopped_early_gets_its_summary_and_plot(tmp_path):
    """The launch that trained the last step was stopped before it closed trace_summary.json and drew
    report.png: the resume with nothing to train completes both, and says so in its one line."""
    run = _finished(tmp_path)
    (run / "trace_summary.json").write_text(json.dumps({"status": "running", "last_step": 20, "steps": 20}))
    (run / "report.png").unlink()
    cfg, _ = resolve(str(run / "config.resolved.yaml"), [])
    args = argparse.Namespace(resume_unverified=False)
    line = finished_run(args, cfg, str(run), main=False)  # other processes: the line, nothing written
    assert "nothing to train" in line and "completed" not in line and not (run / "report.png").exists()
    line = finished_run(args, cfg, str(run), main=True)
    assert "its trace_summary.json was completed" in line and line.endswith("report.png drawn (it was missing)")
    assert json.loads((run / "trace_summary.json").read_text())["status"] == "completed"
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    before = _digests(run)
    assert "completed" not in finished_run(args, cfg, str(run), main=True) and _digests(run) == before
