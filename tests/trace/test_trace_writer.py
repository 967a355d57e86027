"""The trace's file writes run in a background thread (:mod:`rljax.trace.writer`) and nothing is
lost: in order, flushed before every checkpoint save and at close and interpreter exit, and a
write's ``OSError`` still stops the run naming the file."""

import errno
import json
import os
import subprocess
import sys
import threading
import time

import jax
import pytest

from repo_paths import REPO
from rljax.trace.writer import Writer

from test_trace_alerts import _step


def _slow_append(path, text, gate: threading.Event):
    def job():
        gate.wait(5)
        with open(path, "a") as fh:
            fh.write(text)
    return job


def test_jobs_run_in_order_off_the_callers_thread_and_flush_waits_for_them(tmp_path):
    path, gate, w = tmp_path / "f", threading.Event(), Writer()
    w.put(_slow_append(path, "a", gate))
    w.put(_slow_append(path, "b", gate))
    assert not path.exists()  # put returned before the job ran
    gate.set()
    w.flush()
    assert path.read_text() == "ab"
    w.close()


def test_a_failed_write_is_raised_by_the_next_put_and_the_jobs_after_it_never_run(tmp_path):
    w, ran = Writer(), []

    def full():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "trace.jsonl"))

    w.put(full)
    w.put(lambda: ran.append(1))
    time.sleep(0.2)
    with pytest.raises(OSError, match="trace.jsonl"):
        w.put(lambda: ran.append(2))
    w.flush()  # raised once: the run's error path (close(error=...)) goes on
    assert ran == []
    w.close()


def test_what_was_put_is_written_at_interpreter_exit_without_close(tmp_path):
    """A library user who never closes the tracer: the queued writes still reach the disk."""
    code = (f"import time\nfrom rljax.trace.writer import Writer\nw = Writer()\n"
            f"w.put(lambda: (time.sleep(0.5), open({str(tmp_path / 'f')!r}, 'w').write('done')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "f").read_text() == "done"


def test_close_writes_the_final_summary_after_every_queued_one(tmp_path):
    """A summary of a step still queued at close must not overwrite the closed one (status completed)."""
    run = tmp_path / "run"
    tracer, _ = _step(run, steps=2)
    gate = threading.Event()
    tracer.writer.put(lambda: gate.wait(0.3))  # the writer is busy: the next summary is still queued at close
    tracer.cleanup(_Report(3))
    summary = tracer.close()
    tracer.writer.flush()  # whatever was still queued is done
    assert summary["status"] == "completed"
    assert json.loads((run / "trace_summary.json").read_text())["status"] == "completed"


class _Report:
    def __init__(self, step):
        self.step, self.leaked, self.stages, self.batch_keys, self.tracked = step, [], [], [], 0
        self.t_start = self.t_end = time.perf_counter()


def test_the_trainer_flushes_the_trace_before_each_checkpoint_save(tmp_path, monkeypatch):
    """A kill after a save finds the saved step's records: the trace's writes queued before the
    save are on disk when the checkpoint starts."""
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                                 "data.embedded.num_train=32", "data.embedded.num_test=8", "trace.ledgers=false"])
    trainer = Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(tmp_path), echo=lambda *a: None)
    marker = tmp_path / "queued_before_the_save"
    gate = threading.Event()
    trainer.tracer.writer.put(_slow_append(marker, "written", gate))
    threading.Timer(0.3, gate.set).start()
    seen = []
    monkeypatch.setattr(trainer.checkpointer, "save", lambda *a, **k: seen.append(marker.exists()))
    trainer.save()
    trainer.tracer.close()
    assert seen == [True]


def _burn(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_the_threads_cpu_is_counted_once_for_trace_background_s():
    """``trace/background_s``: the writer's CPU seconds in jobs, taken once (not the caller's, not a sleep's)."""
    w = Writer()
    w.put(lambda: _burn(0.05))
    w.put(lambda: time.sleep(0.2))  # waiting is not CPU
    w.flush()
    spent = w.take_cpu()
    assert 0.045 <= spent < 0.15, spent
    assert w.take_cpu() == 0.0
    w.close()


def test_a_traced_step_reports_its_background_cpu(tmp_path):
    tracer, out = _step(tmp_path, steps=2)
    assert out["trace/background_s"] >= 0 and out["trace/background_frac"] == pytest.approx(
        out["trace/background_s"] / (out["trace/overhead_s"] / out["trace/overhead_frac"]), rel=1e-6)
    tracer.close()
    summary = json.loads((tmp_path / "trace_summary.json").read_text())
    assert summary["background_s"] > 0 and 0 < summary["background_frac"] < 1
    assert "background threads' CPU" in tracer.describe_overhead(summary)
