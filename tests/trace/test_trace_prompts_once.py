"""``trace check``'s "every prompt trained once" (issue 23 item 5) on rollout_uids.jsonl files as
the trainer writes them: resume markers (``rljax.trainer.guard.mark_resume``) supersede the
records of later steps, and the check fails on a step or uid trained twice, a batch lost, a
dropped batch trained, or a batch whose prompts came from another data position than the data
order's. The end-to-end proof (a streaming run killed with SIGKILL and resumed) is
tests/trainer/test_async_kill_resume.py."""

import json

from rljax.trace.check import FAIL, PASS, Run, check_every_prompt_trained_once, check_rollout_unique
from rljax.trainer.guard import cut_jsonl, mark_resume

BATCH, N = 4, 64  # data.train_batch_size, examples in the split


def _rec(step, batch=None, dropped=(), cursor=True, uids=None):
    batch = step if batch is None else batch
    rec = {"step": step, "by_process": {"0": uids or [f"{batch}-{i}" for i in range(BATCH)]}, "batch_index": batch,
           "dropped_batches": [list(d) for d in dropped]}
    if cursor:  # the data position after batch `batch` of the data order (16 batches an epoch)
        rec["data_after"] = {"epoch": (batch - 1) // 16, "position": ((batch - 1) % 16 + 1) * BATCH, "num_examples": N}
    return rec


def _run(tmp_path, lines, **values):
    (tmp_path / "trace.jsonl").write_text(json.dumps({
        "step": 1, "uid": "1-0", "stage": "config_resolve", "fields": [],
        "config": {"values": {"data.train_batch_size": BATCH, **values}}}) + "\n")
    (tmp_path / "rollout_uids.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return Run(str(tmp_path))


def _check(tmp_path, lines, **values):
    status, _, detail = check_every_prompt_trained_once(_run(tmp_path, lines, **values))
    return status, detail


def test_resume_markers_supersede_the_steps_after_the_restored_one(tmp_path):
    # launch 1 trained steps 1-4 and was killed; its newest checkpoint was step 2: steps 3-4 again
    lines = [_rec(1), _rec(2), _rec(3), _rec(4), {"resume": {"restored_step": 2, "superseded": 2}},
             _rec(3), _rec(4), _rec(5), {"resume": {"restored_step": 5, "superseded": 0}}, _rec(6)]
    status, detail = _check(tmp_path, lines)
    assert status == PASS, detail
    assert "6 step(s), 24 prompts once each" in detail and "2 resume(s) from step(s) 2, 5" in detail
    assert "data positions of 6 batch(es) checked" in detail
    assert check_rollout_unique(_run(tmp_path, lines))[0] == PASS  # reads the markers too


def test_a_step_recorded_again_without_a_resume_is_trained_twice(tmp_path):
    status, detail = _check(tmp_path, [_rec(1), _rec(2), _rec(2)])
    assert status == FAIL and "step 2 recorded twice with no resume between" in detail


def test_a_lost_step_or_batch_fails(tmp_path):
    status, detail = _check(tmp_path, [_rec(1), _rec(3)])
    assert status == FAIL and "step(s) [2] have no record" in detail
    # the producer skipped batch 2 (neither trained nor dropped)
    status, detail = _check(tmp_path, [_rec(1), _rec(2, batch=3)])
    assert status == FAIL and "batch(es) [2] neither trained nor counted as dropped" in detail


def test_dropped_batches_are_counted_not_replayed(tmp_path):
    status, detail = _check(tmp_path, [_rec(1), _rec(2, batch=3, dropped=[("stale", 2)])])
    assert status == PASS and "1 batch(es) dropped and counted" in detail, detail
    status, detail = _check(tmp_path, [_rec(1), _rec(2, batch=3, dropped=[("stale", 2)]), _rec(3, batch=2)])
    assert status == FAIL and "batch 2 was dropped (stale) and trained" in detail


def test_a_batch_from_another_data_position_fails(tmp_path):
    # a resume that restored the data position after the newest drawn batch (3) instead of after the
    # oldest untrained one (1): batch 2 drew batch 4's prompts
    late = _rec(2)
    late["data_after"] = _rec(4)["data_after"]
    status, detail = _check(tmp_path, [_rec(1), {"resume": {"restored_step": 1, "superseded": 0}}, late])
    assert status == FAIL and "batch 2 drew its prompts ending at data position 0/16" in detail, detail
    assert "the data order's batch 2 ends at 0/8" in detail


def test_uids_twice_or_of_another_batch_fail(tmp_path):
    status, detail = _check(tmp_path, [_rec(1), _rec(2, uids=["2-0", "2-1", "2-2", "1-3"])])
    assert status == FAIL and "uid 1-3 is not a prompt of batch 2" in detail
    status, detail = _check(tmp_path, [_rec(1, uids=["1-0", "1-1", "1-2"])])
    assert status == FAIL and "3 prompt uid(s) trained, data.train_batch_size is 4" in detail


def test_sync_records_and_dynamic_sampling(tmp_path):
    sync = [{"step": s, "by_process": {"0": [f"{s}-{i}" for i in range(BATCH)]}} for s in (1, 2, 3)]
    assert _check(tmp_path, sync)[0] == PASS
    # dynamic sampling: every drawn prompt trained or dropped (no record of a drop here: one draw each)
    assert _check(tmp_path, sync, **{"algorithm.filter_groups.enable": True})[0] == PASS


def test_resume_cuts_the_later_records_and_marks_the_file(tmp_path):
    path = tmp_path / "rollout_uids.jsonl"
    path.write_text("".join(json.dumps(_rec(s)) + "\n" for s in (1, 2, 3)) + '{"step": 4, "by_pro')  # killed mid-write
    dropped = cut_jsonl(str(path), 1)
    assert mark_resume(str(path), 1, dropped)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x.get("step") for x in lines] == [1, None] and lines[1] == {"resume": {"restored_step": 1, "superseded": 3}}
    assert not mark_resume(str(tmp_path / "absent.jsonl"), 1, 0)


def _filtered(step, draws, end, kept=None, lost=()):
    """A dynamic-sampling step: batch ``step`` drew ``draws`` prompt batches (uids ``{step}-0..``), trained
    ``kept`` of them and dropped the rest, ending at prompt batch ``end`` of the data order."""
    drawn = [f"{step}-{i}" for i in range(draws * BATCH)]
    kept = kept or drawn[-BATCH:]
    rec = _rec(step, uids=kept)
    rec["dropped"] = {u: "zero variance" for u in drawn if u not in kept and u not in lost}
    rec["data_after"] = {"epoch": (end - 1) // 16, "position": ((end - 1) % 16 + 1) * BATCH, "num_examples": N}
    return rec


def test_dynamic_sampling_draws_are_each_trained_or_dropped_and_end_at_the_data_orders_position(tmp_path):
    ok = [_filtered(1, 2, 2), _filtered(2, 1, 3), _filtered(3, 3, 6)]
    status, detail = _check(tmp_path, ok, **{"algorithm.filter_groups.enable": True})
    assert status == PASS and "6 prompt batch(es) drawn by dynamic sampling" in detail, detail
    assert "data positions of 3 batch(es) checked" in detail
    # a drawn prompt neither trained nor dropped
    status, detail = _check(tmp_path, [_filtered(1, 2, 2, lost=("1-2",))], **{"algorithm.filter_groups.enable": True})
    assert status == FAIL and "a drawn prompt was lost" in detail, detail
    # batch 2 drew from the position after prompt batch 1, not after batch 1's two draws
    status, detail = _check(tmp_path, [_filtered(1, 2, 2), _filtered(2, 1, 2)], **{"algorithm.filter_groups.enable": True})
    assert status == FAIL and "batch 2 drew its prompts ending at data position 0/8" in detail, detail
    assert "the data order's batch 2 ends at 0/12 (prompt batch 3" in detail
