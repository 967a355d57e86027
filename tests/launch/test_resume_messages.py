"""What a resume says is what happened (issue 39 item 5): a fresh process reading a checkpoint
(every ``--resume``) printed ``WARNING:absl:Item "state" ... could not be restored`` twice
although the state was restored, and the shape check from the checkpoint's metadata got None
there (it checked nothing: the mismatch surfaced only inside the array read)."""

import logging
import signal
import subprocess
import sys

import jax.numpy as jnp
import pytest
from launching import REPO, launch_env

from rljax.trainer.checkpoint import Checkpointer, CheckpointMismatch


def _state(value=1.0, rows=8):
    return {"actor": {"w": jnp.full((rows, 4), value, jnp.float32), "step": jnp.array(3, jnp.int32)}}


def test_a_fresh_checkpointer_reads_meta_and_shapes_without_orbax_warnings(tmp_path, caplog):
    first = Checkpointer(str(tmp_path / "checkpoints"), echo=print)
    first.save(2, _state(2.0), {"step": 2})
    first.wait()
    first.close()
    again = Checkpointer(str(tmp_path / "checkpoints"), echo=print)  # as a resumed process builds it
    with caplog.at_level(logging.WARNING):
        assert again.read_meta(2) == {"step": 2}
        state, _ = again.restore(2, _state(0.0))
        with pytest.raises(CheckpointMismatch) as e:  # from the saved metadata, before any array read
            again.restore(2, _state(0.0, rows=6))
    assert float(state["actor"]["w"][0, 0]) == 2.0
    assert "(8, 4)" in str(e.value) and "(6, 4)" in str(e.value), e.value
    assert not [r for r in caplog.records if "could not be restored" in r.getMessage()], caplog.text
    again.close()


def test_a_save_failing_while_stopping_names_its_step():
    """A tiny disk: the save had already failed when the stop waited for it, so the checkpointer had
    no pending step and the line read "the save of step None failed while stopping: ..."."""
    from rljax.trainer.checkpoint import CheckpointError
    from rljax.trainer.guard import wait_for_save

    class Failed:
        pending = None  # the save's thread has ended: it failed

        def wait(self, timeout):
            raise CheckpointError("saving checkpoint 3 in /run/checkpoints failed: No space left on device")

    lines = []
    assert wait_for_save(Failed(), 5.0, lines.append) is False
    assert lines == ["checkpoint: while stopping: saving checkpoint 3 in /run/checkpoints failed: No space left on "
                     "device"]


def test_a_signal_while_a_launch_starts_says_where_resume_starts(tmp_path):
    """SIGTERM while the launch was starting ended it with status -15 and no word (Ctrl-C: a
    KeyboardInterrupt traceback; SIGINT takes the same path, 130). Now one line: no step was in
    flight, and where --resume starts."""
    sig, code = signal.SIGTERM, 143
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", str(run), "trainer.total_steps=2"],
                            cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # JAX is set up and compiling: well inside the start-up
        if "compilation cache" in line:
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"rljax.launch: stopped by {signal.Signals(sig).name} outside the step loop "
                                            f"(starting up): no step was in flight; {run} holds no checkpoint: "
                                            "--resume starts from step 1"), err[-3000:]
    assert "Traceback" not in err


def test_a_plugin_that_exits_at_import_is_not_quoted_as_runpy(tmp_path):
    """The exit-at-import error quoted runpy's RuntimeWarning about rljax.reward._check (printed by the
    probe's own ``python -m``) as if it were the plugin's output."""
    from rljax.config import ConfigError
    from rljax.reward._check import probe_plugin

    plugin = tmp_path / "bad.py"
    plugin.write_text("import os\nos._exit(3)\n")  # says nothing
    with pytest.raises(ConfigError) as e:
        probe_plugin(f"{plugin}:compute_score", data_source=None, timeout_s=60)
    assert str(e.value).endswith("importing the plugin ended the process with exit code 3 (os._exit, sys.exit or a "
                                 "crash at import)"), e.value
    plugin.write_text("import os, sys\nprint('plugin: giving up', file=sys.stderr, flush=True)\nos._exit(3)\n")
    with pytest.raises(ConfigError) as e:
        probe_plugin(f"{plugin}:compute_score", data_source=None, timeout_s=60)
    assert str(e.value).endswith("crash at import): plugin: giving up"), e.value


def test_a_lost_tensorstore_write_is_not_logged_after_the_saves_line(tmp_path):
    """A full disk: 1 run in 4 printed asyncio's "Future exception was never retrieved" and a
    ValueError('RESOURCE_EXHAUSTED: ...') after the save's one-line error. That record (a
    tensorstore error set on a future from C: no traceback) is dropped; others are kept."""
    import asyncio

    Checkpointer(str(tmp_path / "checkpoints"), echo=print).close()  # installs its filter on asyncio's logger

    def record(exc):
        loop = asyncio.new_event_loop()
        fut = loop.create_future()
        fut.set_exception(exc)
        rec = logging.LogRecord("asyncio", logging.ERROR, asyncio.base_events.__file__, 1,
                                "Future exception was never retrieved\nfuture: %r" % fut, None,
                                (type(exc), exc, exc.__traceback__))
        fut.exception()
        loop.close()
        return rec

    quiet = next(f for f in logging.getLogger("asyncio").filters if type(f).__name__ == "_QuietOrbaxErrors")
    assert not quiet.filter(record(ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left")))
    assert quiet.filter(record(ValueError("a bug of ours")))  # not a tensorstore status: still logged
