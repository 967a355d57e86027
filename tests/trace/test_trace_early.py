"""Checks started mid-step (:mod:`rljax.trace.early`): the rollout's own facts at its event, the
re-scoring at the reward stage's event and the whole-batch reduction at the update's event run in
the tracer's background thread; the
step's end takes each result only when its own inputs are the same, and waits for every job
before the runner looks for leaked batch arrays."""

import gc
import threading
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.config import resolve
from rljax.sharding import make_mesh
from rljax.trace.early import Early
from rljax.trace.metrics import is_wall_clock
from rljax.trace.observers.whole_batch import _same
from rljax.trace.recompute import Recompute
from rljax.trace.rescore import Rescorer

TINY = ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=16",
        "data.embedded.num_test=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trace.ledgers=false", "trace.rescore_rows=2"]


# ----------------------------------------------------------------------------- the thread


def test_jobs_run_off_the_callers_thread_in_order_and_give_their_results():
    early, gate, order = Early(), threading.Event(), []

    def job(i):
        gate.wait(5)
        order.append((i, threading.current_thread().name))
        return i * 10

    jobs = [early.submit(lambda i=i: job(i)) for i in range(3)]
    assert order == []  # submit returned before any job ran
    gate.set()
    assert [j.result() for j in jobs] == [0, 10, 20]
    assert order == [(i, "rljax-trace-early") for i in range(3)]
    assert early.take_cpu() >= 0.0
    early.close()


def test_a_jobs_exception_is_raised_where_its_result_is_taken():
    early = Early()
    bad = early.submit(lambda: 1 / 0)
    good = early.submit(lambda: "after")
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert good.result() == "after"  # a failed job does not stop the thread
    early.close()


def test_a_job_holds_nothing_once_waited_for():
    """The runner's leak check follows the wait: the job's function and inputs are gone by then."""

    class Batch:
        pass

    early, batch = Early(), Batch()
    ref = weakref.ref(batch)
    job = early.submit(lambda b=batch: type(b).__name__)
    del batch
    early.wait()
    gc.collect()
    assert job.result() == "Batch" and ref() is None
    early.close()


def test_without_a_thread_a_job_runs_in_submit():
    early = Early(background=False)
    ran = []
    job = early.submit(lambda: ran.append(threading.current_thread().name) or 7)
    assert ran == [threading.current_thread().name] and job.result() == 7
    early.wait()
    early.close()


# ----------------------------------------------------------------------------- the same inputs


def test_same_inputs_are_the_same_device_arrays_or_equal_host_values():
    a = jnp.arange(4)
    twin = jnp.arange(4)  # equal values, another array: not the input the job read
    host = np.array([True, False])
    assert _same(([(a, None)], host, {"k": (a, 3)}), ([(a, None)], host.copy(), {"k": (a, 3)}))
    assert not _same([(a, None)], [(twin, None)])
    assert not _same(host, ~host)
    assert not _same({"k": a}, {"k": a, "j": a})
    assert not _same((a, 3), (a, 4))
    assert not _same(np.zeros(2, np.int32), np.zeros(2, np.int64))


# ----------------------------------------------------------------------------- the re-scoring's opt-out


def _recompute(fn):
    cfg, _ = resolve("default", TINY)
    rc = Recompute(cfg)
    rc.rescorer = Rescorer(fn, lambda ids: "", rows=2)
    return rc


def _reward_event():
    traj = types.SimpleNamespace(batch_size=2, is_padding=np.zeros(2, bool))
    return types.SimpleNamespace(stage="reward", reads={"trajectories": traj, "prompts": ["p", "q"]},
                                 writes={"scored_rows": {"scores": np.zeros(2)}}, producers={})


def test_a_reward_function_that_is_not_thread_safe_is_re_scored_at_the_steps_end():
    data = types.SimpleNamespace(stage="dataset_item", reads={}, writes={"uids": ["a", "b"], "prompts": ["p", "q"]},
                                 producers={})
    submitted = []
    early = types.SimpleNamespace(submit=lambda fn: submitted.append(fn) or object())

    def unsafe(response, answer, **kw):
        return 0.0

    unsafe.thread_safe = False
    for fn, started in ((lambda *a, **k: 0.0, 1), (unsafe, 0)):
        rc, submitted[:] = _recompute(fn), []
        reward = _reward_event()
        rc.stage(1, [data, reward], reward, early)
        assert len(submitted) == started
        rc.end_step()
        assert rc._early is None


# ----------------------------------------------------------------------------- a real run


def _run(tmp_path, name, early_on: bool, steps: int = 3):
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", [*TINY, f"trainer.total_steps={steps}"])
    t = Trainer(cfg, make_mesh("dp2", jax.devices()[:2]), str(tmp_path / name), echo=lambda *a: None)
    if not early_on:
        t.tracer.early = None
    rows = [t.train_one_step() for _ in range(steps)]
    summary = t.tracer.close()
    return t, rows, summary


def test_a_run_takes_the_mid_step_results_and_gets_what_the_steps_end_computes(tmp_path):
    """The same seed with the checks started mid-step and with every check at the step's end:
    the same metrics (times aside) and the same verdicts; the mid-step results were the ones used,
    and no job kept a batch array past its step (no ``batch_leak`` alert)."""
    t_on, on, s_on = _run(tmp_path, "mid", True)
    t_off, off, s_off = _run(tmp_path, "end", False)
    for t, n in ((t_on, 3), (t_off, 0)):
        wb = t.tracer.whole_batch
        assert (wb.taken_mid_step, wb.taken_mid_step_rollout, wb.recompute.taken_mid_step) == (n, n, n)
    for a, b in zip(on, off):
        keys = {k for k in a if not is_wall_clock(k)}
        assert keys == {k for k in b if not is_wall_clock(k)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    rec_on, rec_off = s_on["recompute"], s_off["recompute"]
    for check in ("advantages", "group_ids", "response_mask", "positions", "update_report", "rewards"):
        assert {k: v for k, v in rec_on[check].items() if k != "s"} == \
            {k: v for k, v in rec_off[check].items() if k != "s"}, check
    assert rec_on["rewards"]["rows"] > 0 and rec_on["rewards"]["steps"] == 3
    assert s_on["invariants"]["rows"] == s_off["invariants"]["rows"] > 0
    assert "batch_leak" not in s_on["alerts"] and "batch_leak" not in s_off["alerts"]
