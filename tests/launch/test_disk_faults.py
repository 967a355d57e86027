"""Issue 28 (7-8): a full disk ends the run in one line with every record file whole; `trace
check` reports a cut file instead of crashing; the data pre-flight rejects unpaired surrogates."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from launching import REPO, launch, launch_env

from rljax.trace.check import run_checks


def test_append_lines_never_leaves_a_cut_line(tmp_path):
    """A write that fails part-way (here RLIMIT_FSIZE: the first bytes land, then EFBIG) leaves
    the file as it was: with a plain append, trace.jsonl kept a cut line after a full disk."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"step": 1}\n')
    code = textwrap.dedent(f"""
        import resource, signal, json
        from rljax.trace._io import append_lines
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
        try:
            append_lines({str(path)!r}, "".join(json.dumps({{"step": 2, "pad": "x" * 40}}) + "\\n" for _ in range(3)))
        except OSError as e:
            print(e.errno, e.filename)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env(), timeout=60)
    errno, name = out.stdout.split()
    assert int(errno) == 27 and name == str(path)  # EFBIG, and the error names the file
    assert path.read_text() == '{"step": 1}\n'


def test_trace_check_reports_a_cut_trace_instead_of_crashing(tmp_path):
    """`python -m rljax.trace check` crashed with a JSONDecodeError on a cut line and a 0-byte summary."""
    (tmp_path / "trace.jsonl").write_text('{"step": 1, "uid": "a", "stage": "rollout"}\n{"step": 1, "ui')
    (tmp_path / "trace_summary.json").write_text("")
    results = {name: (status, detail) for status, name, detail in run_checks(str(tmp_path))}
    status, detail = results["record files whole"]
    assert status == "FAIL" and "trace.jsonl line 2" in detail and "trace_summary.json" in detail
    out = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(tmp_path)], capture_output=True,
                         text=True, env=launch_env(), timeout=60)
    assert "Traceback" not in out.stderr and "record files whole" in out.stdout


def test_an_unpaired_surrogate_fails_the_data_preflight_in_one_line(tmp_path):
    """A row with an escaped lone surrogate passed the pre-flight and crashed dataset preparation
    (a TFDS traceback after the run directory was written)."""
    rows = [{"question": f"what is {i}+1?", "answer": f"#### {i + 1}"} for i in range(16)]
    lines = [json.dumps(r) for r in rows]
    lines[5] = lines[5].replace("what", "wh\\udcffat")
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n")
    run = tmp_path / "run"
    out = launch("data.dataset=gsm8k", f"data.path={tmp_path}", "data.max_prompt_length=128", "--run-dir", str(run),
                 timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "train split, row 5: the prompt holds an unpaired surrogate ('\\udcff'" in out.stderr
    assert not run.exists()


SMALL = ["--mesh=dp1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "data.embedded.num_train=32", "data.embedded.num_test=8", "trainer.total_steps=300"]


def _in_small_tmpfs(tmp_path, size, *args, then=""):
    """Runs the launcher with its run directory on a tmpfs of ``size`` in a private mount namespace."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a private tmpfs needs a root test process and unshare")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    launch_cmd = " ".join([sys.executable, "-m", "rljax.launch", *SMALL, *args, "--run-dir", f"{mnt}/run"])
    script = (f"mount -t tmpfs -o size={size} none {mnt} || exit 99; {launch_cmd} > {tmp_path}/out 2> {tmp_path}/err;"
              f" echo $? > {tmp_path}/rc; cp -r {mnt}/run {tmp_path}/run; {then}")
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=launch_env(), timeout=1200)
    return (int((tmp_path / "rc").read_text()), (tmp_path / "err").read_text(), tmp_path / "run")


def _whole(run):
    for name in ("trace.jsonl", "metrics.jsonl", "rollout_uids.jsonl", "trace_summary.json"):
        p = run / name
        if p.exists():
            text = p.read_text()
            if name.endswith(".json"):
                json.loads(text)
            else:
                [json.loads(l) for l in text.splitlines()]


@pytest.mark.slow
def test_a_full_disk_at_a_save_is_one_line_naming_the_newest_intact_checkpoint(tmp_path):
    """A failing save printed ~500 traceback lines (orbax's threads); a failing trace write ended
    the run with tracebacks, a cut line in trace.jsonl and a 0-byte trace_summary.json."""
    rc, err, run = _in_small_tmpfs(tmp_path, "3m", "trainer.save_freq=1", "trainer.max_checkpoints=null")
    # tensorstore's late callbacks into orbax's closed event loop printed 0-33 "Event loop is
    # closed" tracebacks per run, and asyncio ten "Task exception was never retrieved" (CI, 1 Dec):
    # none may be left.
    assert rc == 1 and "ERROR:absl" not in err, err[-3000:]
    assert "Traceback" not in err and "Task exception" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    # The save runs in the background: whichever write meets the full disk first stops the run,
    # the save (reported at the next save) or a record written meanwhile (CI, 2 Dec: "step 4
    # stopped: writing ..."). Either way: one line, the OS reason, the newest intact checkpoint:
    # the newest with a digest (a step committed before its digest could be written is not intact).
    save_failed = last.startswith("rljax.launch: error: saving checkpoint")
    record_failed = last.startswith("rljax.launch: error: step ") and " stopped: writing " in last
    assert (save_failed or record_failed) and "No space left on device" in last, last
    ckpts = run / "checkpoints"
    steps = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit() and (ckpts / n / "rljax_digest.json").exists())
    assert f"the newest intact checkpoint is step {steps[-1]}" in last and f"continues from step {steps[-1] + 1}" in last
    _whole(run)


@pytest.mark.slow
def test_a_full_disk_at_a_trace_write_is_one_line_and_every_record_whole(tmp_path):
    rc, err, run = _in_small_tmpfs(tmp_path, "1m", "trainer.save_freq=-1", "trace.groups=4")
    assert rc == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "stopped: writing" in last and "No space left on device" in last and "no intact checkpoint" in last
    assert ".jsonl" in last  # names the file
    _whole(run)
    results = {name: status for status, name, _ in run_checks(str(run))}
    assert results["record files whole"] == "PASS"


def _unretrieved_task_stderr(tmp_path, filename):
    """stderr of a process that builds a Checkpointer, then lets an asyncio task whose exception
    was raised in ``filename`` be collected unretrieved (as orbax's writer tasks are on a full disk)."""
    code = textwrap.dedent(f"""
        import asyncio, gc
        from rljax.trainer.checkpoint import Checkpointer
        Checkpointer({str(tmp_path / "ckpt")!r})
        ns = {{}}
        exec(compile("async def write():\\n    raise ValueError('RESOURCE_EXHAUSTED: No space left on device')\\n",
                     {filename!r}, "exec"), ns)
        loop = asyncio.new_event_loop()
        task = loop.create_task(ns["write"]())
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        del task
        gc.collect()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_orbax_writer_tasks_never_retrieved_print_nothing(tmp_path):
    """CI of 1 Dec: a full disk printed ten asyncio "Task exception was never retrieved" tracebacks
    from orbax's writer tasks beside the one-line save error. Those are dropped; a task failing in
    any other code is still reported."""
    orbax_file = "/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    assert "Task exception was never retrieved" not in _unretrieved_task_stderr(tmp_path, orbax_file)
    other = _unretrieved_task_stderr(tmp_path, "/site-packages/somelib/io.py")
    assert "Task exception was never retrieved" in other and "No space left on device" in other


def test_late_callbacks_into_a_closed_event_loop_print_nothing(tmp_path):
    """tensorstore reports as unraisable the RuntimeError a closed loop's call_soon_threadsafe raises
    when a write finishes after orbax's failed save closed its loop (0-33 tracebacks a run). Those
    print nothing once a Checkpointer exists; the same error raised anywhere else still prints."""
    code = textwrap.dedent(f"""
        import asyncio, gc
        from rljax.trainer.checkpoint import Checkpointer
        Checkpointer({str(tmp_path / "ckpt")!r})
        loop = asyncio.new_event_loop()
        loop.close()

        class LateCallback:  # raising in __del__ reaches sys.unraisablehook, as tensorstore's callbacks do
            def __del__(self):
                loop.call_soon_threadsafe(print)

        class Other:
            def __del__(self):
                raise RuntimeError("Event loop is closed")

        LateCallback(); Other(); gc.collect()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env(), timeout=120)
    assert out.returncode == 0 and out.stderr.count("Traceback (most recent call last)") == 1, out.stderr[-2000:]
    assert "call_soon_threadsafe" not in out.stderr and "RuntimeError: Event loop is closed" in out.stderr
