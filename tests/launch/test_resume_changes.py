"""A resume with changed settings (issue 39 item 2): ``config_changes.jsonl`` records from which
step which values hold, and ``trace check`` judges each step by the settings it ran with (it
judged the steps before the resume by the new values: "step 1: 32 prompt uid(s) trained,
data.train_batch_size is 16")."""

import json
import os

import pytest
from launching import launch

from rljax._resume import CHANGES, read_changes, record_changes, values_at
from rljax.config import resolve, to_flat_dict, write_resolved
from rljax.trace.check import FAIL, PASS, Run, check_every_prompt_trained_once, check_rollout_unique, run_checks


def _record(run, *overrides):
    cfg, prov = resolve("default", ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                                    *overrides])
    write_resolved(cfg, prov, run / "config.resolved.yaml")
    return cfg


def _resume(run, *overrides):
    """What the launcher does for ``--resume`` with ``overrides``: the change line, then the new file."""
    cfg, prov = resolve(str(run / "config.resolved.yaml"), ["trainer.resume_mode=auto", *overrides])
    line = record_changes(str(run), cfg)
    write_resolved(cfg, prov, run / "config.resolved.yaml")
    return line


def test_each_resume_records_from_which_step_what_changed(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    first = to_flat_dict(_record(run, "trainer.total_steps=3"))
    assert record_changes(str(run), resolve(str(run / "config.resolved.yaml"))[0]) is None  # not a resume
    line = _resume(run, "data.train_batch_size=4", "rollout.n=2", "trainer.total_steps=5")
    assert line == {"from_step": 4, "restored_step": 3, "changed": {
        "data.train_batch_size": [8, 4], "rollout.n": [4, 2], "trainer.total_steps": [3, 5]}}
    final = to_flat_dict(resolve(str(run / "config.resolved.yaml"))[0])
    changes = read_changes(str(run))
    assert values_at(final, changes, 3)["data.train_batch_size"] == 8 and values_at(final, changes, 3) == first | {
        "trainer.resume_mode": final["trainer.resume_mode"]}
    assert values_at(final, changes, 4)["data.train_batch_size"] == 4
    # a plain resume from the same checkpoint: no change, and it stands for steps 4 on
    (run / "checkpoints" / "5").mkdir()
    assert _resume(run)["changed"] == {}
    # a resume from checkpoint 2 with the first values: steps 3 on run again, the step-4 change no longer stands
    (run / "checkpoints" / "2").mkdir()
    line = _resume(run, "trainer.resume_from=2", "data.train_batch_size=8", "rollout.n=4")
    assert line["from_step"] == 3 and line["changed"] == {"trainer.total_steps": [3, 5]}  # step 2 ran with 8, 4
    final = to_flat_dict(resolve(str(run / "config.resolved.yaml"))[0])
    assert [values_at(final, read_changes(str(run)), s)["rollout.n"] for s in (2, 3, 4, 6)] == [4, 4, 4, 4]
    (run / CHANGES).write_text((run / CHANGES).read_text() + '{"from_step": 9, "chan')  # a cut line is left out
    assert len(read_changes(str(run))) == 3


def _uids(step, n):
    return {"step": step, "by_process": {"0": [f"{step}-{i}" for i in range(n)]}}


def test_trace_check_judges_the_steps_before_a_resume_by_their_own_settings(tmp_path):
    """Steps 1-3 trained 8 prompts, the resume from checkpoint 3 set data.train_batch_size=4: both
    prompt checks pass; judged by the final settings (no change record) they fail on step 1."""
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    _record(run, "trainer.total_steps=3")
    _resume(run, "data.train_batch_size=4", "trainer.total_steps=5")
    lines = [_uids(1, 8), _uids(2, 8), _uids(3, 8), {"resume": {"restored_step": 3, "superseded": 0}},
             _uids(4, 4), _uids(5, 4)]
    (run / "rollout_uids.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for check in (check_every_prompt_trained_once, check_rollout_unique):
        status, _, detail = check(Run(str(run)))
        assert status == PASS, detail
    (run / CHANGES).unlink()  # the checker with the final settings for every step
    for check in (check_every_prompt_trained_once, check_rollout_unique):
        status, _, detail = check(Run(str(run)))
        assert status == FAIL and "step 1: 8 prompt uid(s)" in detail and "data.train_batch_size is 4" in detail


def test_data_positions_follow_a_changed_batch_size(tmp_path):
    """An asynchronous run's data position after each batch: 8 prompts a batch for batches 1-3,
    then 4 (the restored iterator draws the resumed run's batch size)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    _record(run, "trainer.total_steps=3")
    _resume(run, "data.train_batch_size=4", "trainer.total_steps=5")
    ends = {1: 8, 2: 16, 3: 24, 4: 28, 5: 32}
    lines = []
    for step, n in ((1, 8), (2, 8), (3, 8), (4, 4), (5, 4)):
        rec = _uids(step, n) | {"batch_index": step, "dropped_batches": []}
        rec["data_after"] = {"epoch": 0, "position": ends[step], "num_examples": 64}
        lines.append(rec)
    (run / "rollout_uids.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    status, _, detail = check_every_prompt_trained_once(Run(str(run)))
    assert status == PASS and "data positions of 5 batch(es) checked" in detail, detail
    lines[4]["data_after"]["position"] = 36  # as if batch 5 had drawn 8
    (run / "rollout_uids.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    status, _, detail = check_every_prompt_trained_once(Run(str(run)))
    assert status == FAIL and "batch 5 drew its prompts ending at data position 0/36" in detail, detail


@pytest.mark.slow
def test_a_resume_with_other_settings_passes_trace_check(tmp_path):
    """The issue's case at this project's size: a finished 2-step run resumed with
    ``--resume rollout.n=2 data.train_batch_size=4 trainer.total_steps=3`` (checked against the
    run's values: the preset's actor.ppo_mini_batch_size=16 refused it before) passes trace check."""
    from test_launch import SMALL

    run = str(tmp_path / "run")
    first = launch("--run-dir", run, "--mesh=dp1", *SMALL, "trainer.total_steps=2", "trainer.save_freq=1")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = launch("--resume", "--run-dir", run, "rollout.n=2", "data.train_batch_size=4", "trainer.total_steps=3")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert read_changes(run) == [{"from_step": 3, "restored_step": 2, "changed": {
        "data.train_batch_size": [8, 4], "rollout.n": [4, 2], "trainer.total_steps": [2, 3]}}]
    failed = [r for r in run_checks(run) if r[0] == FAIL]
    assert not failed, failed
    # Issue 39 item 3 on the same run: the last bytes of metrics.jsonl (step 3's record) cut off, then
    # a resume that trains on: step 3 runs again from checkpoint 2 and writes its record (before: "removed
    # 1 record(s) after step 3 (they are run again)", step 3 restored, its record lost for good).
    path = os.path.join(run, "metrics.jsonl")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-40])
    again = launch("--resume", "--run-dir", run, "trainer.total_steps=4")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "the last line of metrics.jsonl (step 3's record) was cut short; resuming from checkpoint 2 so that " \
           "step 3 runs again" in again.stdout, again.stdout[-3000:]
    assert "restored step 2" in again.stdout and "after step 3" not in again.stdout
    from rljax.trace import read_metrics

    assert sorted(r["step"] for r in read_metrics(run) if r["step"] >= 1) == [1, 2, 3, 4]
    failed = [r for r in run_checks(run) if r[0] == FAIL]
    assert not failed, failed
