"""A record line cut short (issue 39 item 3): truncating the last bytes of a finished run's
metrics.jsonl and resuming said "removed 1 metrics.jsonl record(s) after step 6 (they are run
again)" while step 6 was restored, not run: its record was gone for good. Now the step runs
again from the checkpoint before it when there is one, and the message says which happened.

Everything here reads and writes files only (seconds); the launch that runs the step again is
the slow test of tests/launch/test_resume_changes.py."""

import json

from rljax._resume import nothing_to_train
from rljax._rundir import DIGEST_FILE, cut_record, drop_cut_records, passed_over_line, resume_checkpoint
from rljax.config import resolve


def _run(tmp_path, checkpoints=(2, 4, 6), steps=6, cut="metrics.jsonl", keep=9):
    run = tmp_path / "run"
    for s in checkpoints:
        (run / "checkpoints" / str(s)).mkdir(parents=True)
        (run / "checkpoints" / str(s) / DIGEST_FILE).write_text("{}")
    metrics = "".join(json.dumps({"step": s, "actor/loss": 0.5}) + "\n" for s in range(steps + 1))
    uids = "".join(json.dumps({"step": s, "by_process": {"0": [f"{s}-0"]}}) + "\n" for s in range(1, steps + 1))
    (run / "metrics.jsonl").write_text(metrics)
    (run / "rollout_uids.jsonl").write_text(uids)
    path = run / cut
    data = path.read_bytes()
    path.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 1 + keep])  # the last line's first `keep` bytes
    return run


def test_a_cut_last_line_is_the_record_of_its_step(tmp_path):
    assert cut_record(str(_run(tmp_path))) == ("metrics.jsonl", 6)  # read from '{"step": 6'
    assert cut_record(str(_run(tmp_path / "b", keep=3))) == ("metrics.jsonl", 6)  # '{"s': the step after step 5
    assert cut_record(str(_run(tmp_path / "c", cut="rollout_uids.jsonl"))) == ("rollout_uids.jsonl", 6)
    whole = _run(tmp_path / "d", keep=0)
    assert cut_record(str(whole)) is None


def test_the_step_runs_again_from_the_checkpoint_before_it(tmp_path):
    run = _run(tmp_path)
    ckpt = str(run / "checkpoints")
    assert resume_checkpoint(ckpt, past_undigested=True) == (4, [6])
    assert resume_checkpoint(ckpt, 6) == (6, [])  # --resume=6 is what was asked for
    line = passed_over_line(ckpt, 4, [6])
    assert "the last line of metrics.jsonl (step 6's record) was cut short; resuming from checkpoint 4 so that " \
           "steps 5-6 run again" in line and "no digest" not in line
    cfg, _ = resolve("default", ["trainer.total_steps=6", "trainer.resume_mode=auto"])
    assert nothing_to_train(str(run), cfg) is None  # the finished run trains step 5 and 6 again
    assert drop_cut_records(str(run), 4) == [
        "resume: the last line of metrics.jsonl (step 6's record) was cut short: dropped; step 6 runs again and "
        "writes it"]
    assert (run / "metrics.jsonl").read_text().endswith('"step": 5, "actor/loss": 0.5}\n')
    assert cut_record(str(run)) is None and resume_checkpoint(ckpt, past_undigested=True) == (6, [])


def test_with_no_checkpoint_before_it_the_record_is_said_lost(tmp_path):
    run = _run(tmp_path, checkpoints=(6,))
    assert resume_checkpoint(str(run / "checkpoints"), past_undigested=True) == (6, [])
    said = drop_cut_records(str(run), 6)
    assert said == ["resume: the last line of metrics.jsonl (step 6's record) was cut short: dropped; step 6 is "
                    "restored from checkpoint 6, not run again: its metrics.jsonl record is lost (a resume from a "
                    "checkpoint before step 6 would run it again)"]
    assert "after step" not in said[0]
