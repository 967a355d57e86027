"""A checkpoint is the run's :class:`~rljax.trainer.state.RunState` (issue 22), and checkpoints
written before ``RunState`` existed still restore.

The old layout is written here as the code before ``RunState`` wrote it: the arrays
``{"actor": TrainState(trainable params), "critic"?}`` and the meta ``step`` / ``version`` /
``data`` / ``config`` (+ ``kl_coef`` with an adaptive KL-in-reward controller, ``async`` in
``trainer.mode=async``), no root key and no producer position. The run restores them through
the real path (``Trainer(resume=True)``: orbax, digest check, ``from_checkpoint``).
"""

import jax
import numpy as np
import pytest

ONE_STEP = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=32",
            "data.embedded.num_test=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.total_steps=3", "trace.ledgers=false"]


def _trainer(run, overrides=(), resume=False):
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", [*ONE_STEP, *overrides])
    return cfg, Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(run), resume=resume, echo=lambda *a: None)


def _write_old_checkpoint(run, cfg, trainer, *, step, version, meta_extra):
    """What the trainer before RunState saved: ``_checkpoint_state()`` and its meta dict."""
    from rljax.config import to_dict
    from rljax.trainer.checkpoint import Checkpointer
    from rljax.trainer.step import trainable

    actor = trainer.state.actor
    params = jax.tree.map(lambda x: x + 0.25, trainable(actor.params))  # other weights than a fresh run's
    tree = {"actor": actor.replace(params=params, step=actor.step + 7)}
    position = {**trainer.services.rollout.prompts.state(), "epoch": 0, "position": 12}
    meta = {"step": step, "version": version, "data": position, "config": to_dict(cfg), **meta_extra}
    ckpt = Checkpointer(str(run / "checkpoints"), max_to_keep=3, echo=lambda *a: None)
    ckpt.save(step, tree, meta)
    ckpt.close()
    trainer.tracer.close()
    return params, position


@pytest.mark.parametrize("overrides, meta_extra, want_kl, want_produced", [
    ((), {}, 0.0, 3),  # sync, no KL in the reward: the producer index is step + 1
    (("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"), {"kl_coef": 0.0123}, 0.0123, 3),
    (("trainer.mode=async",), {"async": {"policy": "replay", "next_index": 5, "dropped_stale": 0,
                                         "dropped_overflow": 0}}, 0.0, 5),
], ids=["sync", "adaptive-kl", "async"])
def test_a_checkpoint_written_before_run_state_restores_into_it(tmp_path, overrides, meta_extra, want_kl,
                                                                want_produced):
    run = tmp_path / "run"
    cfg, fresh = _trainer(run, overrides)
    params, position = _write_old_checkpoint(run, cfg, fresh, step=2, version=2, meta_extra=meta_extra)
    _, trainer = _trainer(run, overrides, resume=True)
    st = trainer.state
    try:
        assert (st.step, st.version, st.data, st.kl_coef, st.produced) == (2, 2, position, want_kl, want_produced)
        assert trainer.services.rollout.prompts.state() == position  # the prompt feed continues there
        np.testing.assert_array_equal(jax.random.key_data(st.key), jax.random.key_data(jax.random.key(cfg.trainer.seed)))
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), st.actor.params, params)
        assert int(st.actor.step) == int(fresh.state.actor.step) + 7
        assert trainer.services.rollout.sampler.version == 2  # the sampler got the restored weights
    finally:
        trainer.tracer.close()
        if trainer.cfg.trainer.mode == "async":
            trainer.schedule.close()


def test_the_run_state_round_trips_through_a_checkpoint(tmp_path):
    """The new layout: what :func:`checkpoint_tree` / :func:`checkpoint_meta` write is what
    :func:`from_checkpoint` restores, key and producer position included."""
    from rljax.trainer.state import checkpoint_meta, checkpoint_tree, from_checkpoint

    run = tmp_path / "run"
    _, trainer = _trainer(run)
    trainer.tracer.close()
    st = trainer.state.replace(step=4, version=4, kl_coef=0.5, produced=9, key=jax.random.key(77),
                               data={"epoch": 1, "position": 4, "seed": 0, "num_examples": 32})
    back = from_checkpoint(trainer.state, checkpoint_tree(st), checkpoint_meta(st), kl_in_reward=True)
    assert (back.step, back.version, back.kl_coef, back.produced, back.data) == (4, 4, 0.5, 9, st.data)
    np.testing.assert_array_equal(jax.random.key_data(back.key), jax.random.key_data(jax.random.key(77)))
    weights = from_checkpoint(trainer.state, checkpoint_tree(st), checkpoint_meta(st), weights_only=True)
    assert (weights.step, weights.version, weights.produced, weights.data) == (4, 4, 5, trainer.state.data)


def test_a_finished_run_resumed_through_the_library_raises_and_writes_nothing(tmp_path):
    """``Trainer(resume=True)`` on a run whose checkpoint is at ``trainer.total_steps`` (the
    launcher's one-line exit 0, for library callers): :class:`RunComplete` before anything is
    built, every file as it was (before, the restore cut and marked the records, and the run
    closed an empty ``trace_summary.json`` over the finished one)."""
    import hashlib

    from rljax.trainer.loop import RunComplete

    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    (run / "trace_summary.json").write_text('{"status": "completed"}\n')
    digests = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}
    before = digests()
    with pytest.raises(RunComplete, match=r"checkpoint 3 is at trainer.total_steps=3: the run in .* is complete"):
        _trainer(run, resume=True)
    assert digests() == before and sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                                             "trace_summary.json"]


# An asynchronous run's counters continue across a resume (issue 39 item 6): the checkpoint's ``async`` meta holds
# the rows generated and dropped and the weight pushes made so far and the resumed schedule counts on from them (they
# restarted from 0 after every --resume). The launched runs, stopped and resumed, against an uninterrupted one (slow):
# test_async_launch.py::test_async_resume_replays_in_flight_prompts (tau=0: every step's counters equal) and
# test_async_streaming.py::test_streaming_resume_mid_stream_loses_and_repeats_no_prompt (tau=1).
ASYNC_PUSH_2 = ("trainer.mode=async", "async_training.trigger_parameter_sync_step=2")
SAVED = {"generated_rows": 40, "weight_pushes": 3, "dropped_stale": 8, "dropped_overflow": 4}


def _resumed_async(tmp_path, saved):
    """A run resumed from an asynchronous checkpoint at step 2 (version 2) whose ``async`` meta holds ``saved``."""
    run = tmp_path / "run"
    cfg, fresh = _trainer(run, ASYNC_PUSH_2)
    meta = {"async": {"policy": "replay", "next_index": 3, **saved}}
    _write_old_checkpoint(run, cfg, fresh, step=2, version=2, meta_extra=meta)
    fresh.schedule.close()
    return run, _trainer(run, ASYNC_PUSH_2, resume=True)[1]


@pytest.mark.parametrize("saved, want", [
    (SAVED, SAVED),  # what this checkpoint saved
    # a checkpoint written before the run's counters (its dropped rows were its launch's): the pushes rebuilt from
    # the version (2 // trigger 2), nothing generated
    ({"dropped_stale": 8, "dropped_overflow": 0},
     {"generated_rows": 0, "weight_pushes": 1, "dropped_stale": 8, "dropped_overflow": 0}),
    ({}, {"generated_rows": 0, "weight_pushes": 1, "dropped_stale": 0, "dropped_overflow": 0}),  # none: 0
], ids=["saved", "dropped-only", "older-checkpoint"])
def test_a_resumed_schedule_counts_on_from_the_checkpoint(tmp_path, saved, want):
    from rljax.trainer.staleness import async_metrics

    _, trainer = _resumed_async(tmp_path, saved)
    sched = trainer.schedule
    try:
        assert trainer.state.async_counts == (saved or None)
        assert sched.weights.pushes == want["weight_pushes"]
        # nothing queued yet: a checkpoint now saves what it restored
        assert {k: sched.checkpoint_meta(trainer.state)["async"][k] for k in want} == want
        # the next step's metrics: the rows this launch generated and dropped on top of the restored ones
        facts = {"staleness_mean": 0.0, "staleness_max": 0, "dropped_stale": 2, "dropped_overflow": 1,
                 "generated_rows": 16, "generated_rows_restored": sched._restored["generated_rows"], "queue_depth": 0,
                 "learner_wait_s": 0.0, "rollout_wait_s": 0.0, "min_version": 2, "max_version": 2,
                 "spanning_rows": 0, "batch_index": 3, "staleness_hist": {"0": 16},
                 "dropped_stale_restored": sched._restored["dropped_stale"],
                 "dropped_overflow_restored": sched._restored["dropped_overflow"]}
        m = async_metrics(facts, sched.weights.pushes)
        assert (m["async/generated_rows"], m["async/dropped_stale"], m["async/dropped_overflow"]) == \
            (want["generated_rows"] + 16, want["dropped_stale"] + 2, want["dropped_overflow"] + 1)
    finally:
        trainer.tracer.close()
        sched.close()


def test_a_resumed_launchs_drops_are_logged_saved_and_checked_as_the_runs(tmp_path):
    """The resumed schedule's real queue drops a stale batch (trained after the checkpoint's step 2 at version 2,
    tau=1) and hands over the next: ``async/dropped_*`` are the checkpoint's plus this launch's; the next
    checkpoint saves them (a batch dropped from the producer's index on is not counted: it is generated again);
    ``trace_summary.json`` keeps the checkpoint's apart from the queue's and trace check's "every dropped row
    counted" passes, and fails when the summary's numbers and the metrics' disagree."""
    import json
    import shutil

    from rljax.rollout.queue import QueueItem
    from rljax.trace.check import FAIL, PASS, Run, check_async_drops
    from rljax.trace.summary import summarize_run
    from rljax.trainer.runner import Produced
    from rljax.trainer.staleness import async_metrics

    from rljax.config import resolve, write_resolved

    run, trainer = _resumed_async(tmp_path, SAVED)
    sched, tracer = trainer.schedule, trainer.tracer
    write_resolved(*resolve("default", [*ONE_STEP, *ASYNC_PUSH_2]), run / "config.resolved.yaml")  # as the launcher

    def put(index, version, rows):
        produced = Produced(batch={"enqueue": {}}, producers={}, events=[], timings={})
        sched.queue.put(QueueItem(index=index, min_version=[version] * rows, max_version=[version] * rows,
                                  uids=[f"{index}-{r // 4}" for r in range(rows)], payload=(produced, {})))

    try:
        put(3, 0, rows=16)  # staleness 2 > tau=1 at version 2: dropped
        put(4, 2, rows=16)
        facts = sched._next_batch(3, 2)[0]["queue_item"]
        assert (facts["batch_index"], facts["dropped_stale"]) == (4, 16)
        m = async_metrics(facts, sched.weights.pushes)
        assert (m["async/dropped_stale"], m["async/dropped_overflow"], m["async/generated_rows"]) == (24, 4, 72)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 3, **m}, default=float) + "\n")
        tracer.asynchronous.step(facts)
        put(6, 2, rows=16)
        with pytest.raises(TimeoutError):  # a batch after the one trained dropped as stale: generated again after
            sched.queue.get(4, timeout=0.01)  # a resume, so the checkpoint does not count it
        saved = sched.checkpoint_meta(trainer.state.replace(produced=5))["async"]
        assert {k: saved[k] for k in SAVED} == {"generated_rows": 72, "weight_pushes": 3, "dropped_stale": 24,
                                                "dropped_overflow": 4}
    finally:
        tracer.async_totals(sched.close())
        tracer.close()
    a = json.loads((run / "trace_summary.json").read_text())["async"]
    assert (a["final_dropped_stale"], a["dropped_stale_restored"], a["dropped_overflow_restored"]) == (32, 8, 4)
    status, _, detail = check_async_drops(Run(str(run)))
    assert status == PASS and "(and 8 stale, 4 overflow before the resume)" in detail, detail
    assert "its checkpoint counted 8 stale, 4 overflow row(s) dropped before it" in summarize_run(str(run))

    def check(edit_summary=None, edit_row=None):
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
        s = json.loads((copy / "trace_summary.json").read_text())
        (edit_summary or (lambda s: None))(s["async"])
        (copy / "trace_summary.json").write_text(json.dumps(s))
        r = {"step": 3, **m}
        (edit_row or (lambda r: None))(r)
        (copy / "metrics.jsonl").write_text(json.dumps(r, default=float) + "\n")
        return check_async_drops(Run(str(copy)))

    assert check()[0] == PASS
    # the summary without the checkpoint's drops: the metrics count rows the queue's final count does not hold
    status, _, detail = check(edit_summary=lambda a: a.update(final_dropped_overflow=0, dropped_overflow_restored=0))
    assert (status, detail) == (FAIL, "dropped_overflow: metrics say 4, the queue's final count 0"), detail
    status, _, detail = check(edit_row=lambda r: r.update({"async/dropped_stale": 41}))
    assert (status, detail) == (FAIL, "dropped_stale: metrics say 41, the queue's final count 32 + 8 dropped before "
                                      "the resume"), detail
    # the metrics restarted from this launch's count (the bug): fewer than the checkpoint counted
    status, _, detail = check(edit_row=lambda r: r.update({"async/dropped_overflow": 0}))
    assert status == FAIL and "metrics say 0, fewer than the 4 the run's checkpoint counted" in detail, detail
