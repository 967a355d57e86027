"""The cheap half of issue 28's fault campaign, reproducible in a few minutes on a CPU host.

    python bench/fault_campaign.py [--markdown] [--only NAME ...] [--workdir DIR]

Each fault is injected into a real ``python -m rljax.launch`` (or, for tool code, the real
python-tool sandbox) on a tiny embedded configuration; the table says what was expected and
what was observed (exit status and the last line of stderr, or the fact checked). Signals,
damaged checkpoints, resumes that would change the run, hostile rewards, hostile tool code,
bad data and a full disk. The rows that need root (a private tmpfs, dropped capabilities) say
so when skipped. ``--markdown`` prints the table for docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--mesh=dp1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "data.embedded.num_train=64", "data.embedded.num_test=8", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trace.groups=1"]
ROOT = os.geteuid() == 0


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rljax.launch", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _last(text: str) -> str:
    lines = [l for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def _short(text: str, n: int = 150) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _observed(out) -> str:
    tb = " + TRACEBACK" if "Traceback" in out.stderr else ""
    return f"exit {out.returncode}{tb}: {_short(_last(out.stderr))}"


def _steps(run: str) -> list[int]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r["step"] for r in map(json.loads, open(path)) if "actor/pg_loss" in r]


def _ckpts(run: str) -> list[int]:
    d = os.path.join(run, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _digests(run: str) -> dict:
    import hashlib

    out = {}
    for root, _, files in os.walk(run):
        for f in files:
            p = os.path.join(root, f)
            out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _signal_run(work, name, sig, *extra, group=False):
    run = os.path.join(work, name)
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run, *SMALL, *extra,
                             "trainer.total_steps=100", "trainer.save_freq=1"], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(_steps(run)) < 2:
        time.sleep(0.2)
    if group:
        os.killpg(proc.pid, sig)
        for pid in _descendants(proc.pid):  # a scheduler signals every process of the job
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, run


def _descendants(pid: int) -> list[int]:
    kids: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        children = kids.get(todo.pop(), [])
        out += children
        todo += children
    return out


# ----------------------------------------------------------------------------- the faults


def sigint(work):
    rc, err, run = _signal_run(work, "sigint", signal.SIGINT)
    last = _ckpts(run)[-1] if _ckpts(run) else None
    ok = rc == 130 and last is not None and f"next --resume starts from step {last + 1}" in err
    return ("SIGINT (Ctrl-C) mid-run", "finish the step, save it, exit 130, name the step --resume starts from",
            f"exit {rc}: {_short(_last(err))}", ok)


def sigterm_group(work):
    plugin = os.path.join(work, "exact.py")
    open(plugin, "w").write("def reward(response, answer, **kw):\n    return float(response.strip() == answer)\n")
    rc, err, run = _signal_run(work, "sigterm", signal.SIGTERM, f"reward.function={plugin}:reward",
                               "reward.num_workers=2", "reward.max_error_fraction=0.0", group=True)
    rows = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if "reward/errors" in r]
    errors = sum(r["reward/errors"] for r in rows)
    ok = rc == 143 and errors == 0 and "saved checkpoint" in err
    return ("SIGTERM to every process of the job, reward workers on",
            "workers ignore it, the step is scored whole and saved, exit 143",
            f"exit {rc}, reward errors in saved steps: {int(errors)}: {_short(_last(err), 90)}", ok)


def _trained(work) -> str:
    run = os.path.join(work, "trained")
    if not os.path.isdir(run):
        out = _launch("--run-dir", run, *SMALL, "trainer.total_steps=2", "trainer.save_freq=1")
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
    return run


def unverified_checkpoint(work):
    run = os.path.join(work, "unverified")
    shutil.copytree(_trained(work), run)
    step_dir = os.path.join(run, "checkpoints", "2")
    os.remove(os.path.join(step_dir, "rljax_digest.json"))
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs]
    big = max(files, key=os.path.getsize)
    data = bytearray(open(big, "rb").read())
    data[len(data) // 2] ^= 1
    open(big, "wb").write(bytes(data))
    asked = _launch("--run-dir", run, "--resume=2", "trainer.total_steps=3")
    ok = asked.returncode == 1 and "newest intact checkpoint is 1" in asked.stderr and "Traceback" not in asked.stderr
    out = _launch("--run-dir", run, "--resume", "trainer.total_steps=3")
    notice = next((l for l in out.stdout.splitlines() if "have no digest" in l), "")
    ok = ok and out.returncode == 0 and "resuming from 1" in notice and _steps(run) == [1, 2, 3]
    return ("checkpoint without its digest, one byte flipped",
            "--resume=2 refused naming step 1; a plain --resume restores 1 and says why",
            f"{_observed(asked)}; then --resume: exit {out.returncode}: {_short(notice)}", ok)


def changed_shape(work):
    run = _trained(work)
    before = _digests(run)
    out = _launch("--run-dir", run, "--resume", "model.num_layers=3")
    ok = out.returncode == 2 and "would break the run" in out.stderr and _digests(run) == before
    return ("resume with another model shape", "exit 2 listing the key and both values, no file changed",
            _observed(out), ok)


def other_task(work):
    run = _trained(work)
    before = _digests(run)
    out = _launch("--run-dir", run, "--config", "tool_lookup", "--resume")
    ok = out.returncode == 2 and "--resume-from-weights" in out.stderr and _digests(run) == before
    return ("--config tool_lookup --resume on an addition run", "exit 2 unless --resume-from-weights",
            _observed(out), ok)


def fresh_into_old(work):
    run = os.path.join(work, "old")
    os.makedirs(run)
    open(os.path.join(run, "metrics.jsonl"), "w").write('{"step": 1}\n')
    out = _launch("--run-dir", run, *SMALL)
    ok = out.returncode == 2 and open(os.path.join(run, "metrics.jsonl")).read() == '{"step": 1}\n'
    return ("fresh launch into a run directory without checkpoints", "exit 2, the old metrics.jsonl untouched",
            _observed(out), ok)


def _check(run: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rljax.trace", "check", run], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)


def finished_resume(work):
    run = os.path.join(work, "finished")
    shutil.copytree(_trained(work), run)
    before = _digests(run)
    out = _launch("--run-dir", run, "--resume")
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    chk = _check(run)
    ok = out.returncode == 0 and len(lines) == 1 and "nothing to train" in lines[0] and _digests(run) == before
    ok = ok and chk.returncode == 0
    return ("--resume of a run that trained every step", "one line, exit 0, no file changed, trace check passes",
            f"exit {out.returncode}, {len(lines)} line(s): {_short(lines[0] if lines else '', 110)}; files "
            f"{'unchanged' if _digests(run) == before else 'CHANGED'}; trace check exit {chk.returncode}", ok)


def sigterm_in_last_step(work):
    run = os.path.join(work, "last_step")
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run, *SMALL, "trainer.total_steps=3",
                             "trainer.save_freq=1"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None and len(_steps(run)) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # while step 3, the last, runs
    _, err = proc.communicate(timeout=300)
    out = _launch("--run-dir", run, "--resume")
    line = next((l for l in out.stdout.splitlines() if "nothing to train" in l), "")
    chk = _check(run)
    ok = proc.returncode == 143 and out.returncode == 0 and "was completed" in line and chk.returncode == 0
    return ("SIGTERM in the last step, then --resume", "step saved, exit 143; the resume trains nothing, completes "
            "trace_summary.json in its one line; trace check passes",
            f"exit {proc.returncode}; then --resume: exit {out.returncode}: {_short(line[line.find('nothing'):], 230)}"
            f"; trace check exit {chk.returncode}", ok)


def _plugin(work, name, body):
    path = os.path.join(work, f"{name}.py")
    open(path, "w").write(textwrap.dedent(body))
    return path


def reward_exit_at_import(work):
    p = _plugin(work, "exit_import", "import os\nos._exit(3)\ndef reward(r, a, **k):\n    return 1.0\n")
    out = _launch("--run-dir", os.path.join(work, "r1"), *SMALL, f"reward.function={p}:reward")
    return ("reward plugin calls os._exit(3) at import", "exit 2, one line, nothing quoted that is not the plugin's",
            _observed(out), out.returncode == 2 and out.stderr.count("\n") == 1 and "runpy" not in out.stderr)


def reward_hang_at_import(work):
    p = _plugin(work, "hang_import", "import time\ntime.sleep(3600)\ndef reward(r, a, **k):\n    return 1.0\n")
    t0 = time.monotonic()
    out = _launch("--run-dir", os.path.join(work, "r2"), *SMALL, f"reward.function={p}:reward",
                  "reward.import_timeout_s=5")
    took = time.monotonic() - t0
    return ("reward plugin hangs at import", "exit 2 after reward.import_timeout_s (5 s here)",
            f"{_observed(out)} ({took:.0f} s)", out.returncode == 2 and took < 120)


def reward_huge(work):
    p = _plugin(work, "huge", "def reward(r, a, **k):\n    return 1e30\n")
    out = _launch("--run-dir", os.path.join(work, "r3"), *SMALL, f"reward.function={p}:reward",
                  "reward.num_workers=0", "trainer.total_steps=2")
    return ("reward returns 1e30", "one-line stop naming reward.clip", _observed(out),
            out.returncode == 1 and "reward.clip" in _last(out.stderr) and "Traceback" not in out.stderr)


def reward_all_fail(work):
    p = _plugin(work, "broken", "def reward(r, a, **k):\n    raise KeyError('score')\n")
    out = _launch("--run-dir", os.path.join(work, "r4"), *SMALL, f"reward.function={p}:reward",
                  "reward.num_workers=0", "trainer.total_steps=2")
    warnings = out.stderr.count("reward failed for uid")
    return ("reward raises on every sample", "one line (count, first error), no per-sample warnings",
            f"{_observed(out)}; {warnings} per-sample warnings",
            out.returncode == 1 and "every sample" in _last(out.stderr) and warnings == 0
            and "Traceback" not in out.stderr)


def reward_inprocess_timeout(work):
    out = _launch("--run-dir", os.path.join(work, "r5"), *SMALL, "reward.num_workers=0", "reward.timeout_s=5")
    return ("reward.num_workers=0 with reward.timeout_s", "exit 2 (a hang in-process cannot be stopped)",
            _observed(out), out.returncode == 2)


HOSTILE = r"""
import json, os, socket
r = {"uid": os.getuid(), "secret": os.environ.get("RLJAX_SECRET")}
for name, fn in (("shadow", lambda: open("/etc/shadow").read(1)), ("opt", lambda: open("/opt/rljax_owned", "w")),
                 ("localhost", lambda: socket.create_connection(("127.0.0.1", 22), timeout=1))):
    try:
        fn(); r[name] = True
    except OSError as e:
        r[name] = False
n = 0
try:
    for i in range(3000):
        open(f"/run/lock/rljax_campaign_{i}", "w").write("x" * 8000); n += 1
except OSError:
    pass
r["files"] = n
print(json.dumps(r))
"""


def _hostile_tool(drop):
    code = ("import json, sys\nfrom rljax.env import PythonSandbox\ns = PythonSandbox(timeout_s=10)\n"
            "print(json.dumps({'line': s.describe(), 'out': s.run(sys.argv[1]).output}))")
    cmd = [sys.executable, "-c", code, HOSTILE]
    if drop:
        cmd = ["capsh", f"--drop={drop}", "--", "-c", 'exec "$0" "$@"', *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**_env(), "RLJAX_SECRET": "hunter2"}, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    r = json.loads(got["out"].strip().splitlines()[-1])
    left = [f for f in os.listdir("/run/lock") if f.startswith("rljax_campaign_")]
    for f in left:
        os.remove(os.path.join("/run/lock", f))
    ok = (r["uid"] != 0 and not r["secret"] and not r["shadow"] and not r["opt"] and not r["localhost"]
          and not left and r["files"] < 1100)
    return (f"uid {r['uid']}, /etc/shadow {'read' if r['shadow'] else 'denied'}, secret "
            f"{'read' if r['secret'] else 'absent'}, /opt {'written' if r['opt'] else 'denied'}, localhost "
            f"{'reached' if r['localhost'] else 'unreachable'}, {r['files']} files written, {len(left)} left on the "
            "host"), ok


def hostile_tool_code(work):
    observed, ok = _hostile_tool(None)
    return ("hostile tool code (root, all capabilities)", "private uid, no secret, no network, writes private and "
            "capped", observed, ok)


def hostile_tool_code_no_sys_admin(work):
    if not (ROOT and shutil.which("capsh")):
        return ("hostile tool code, root without CAP_SYS_ADMIN", "private uid via a user namespace", "skipped: needs "
                "root and capsh", None)
    observed, ok = _hostile_tool("cap_sys_admin")
    return ("hostile tool code, root without CAP_SYS_ADMIN (Docker's default)", "private uid and private tmpfs via a "
            "user namespace", observed, ok)


def sandbox_cannot_drop_root(work):
    if not (ROOT and shutil.which("capsh")):
        return ("tool run without CAP_SETUID", "refuses to start", "skipped: needs root and capsh", None)
    cmd = [sys.executable, "-m", "rljax.launch", "env.function=tools", "--run-dir", os.path.join(work, "tools")]
    out = subprocess.run(["capsh", "--drop=cap_sys_admin,cap_setuid,cap_setgid", "--", "-c", 'exec "$0" "$@"', *cmd],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    return ("tool env, root without CAP_SYS_ADMIN / CAP_SETUID", "exit 2 naming the missing protection",
            _observed(out), out.returncode == 2 and "non_root" in out.stderr)


def bad_data_surrogate(work):
    d = os.path.join(work, "data")
    os.makedirs(d)
    rows = [json.dumps({"question": f"what is {i}+1?", "answer": f"#### {i + 1}"}) for i in range(16)]
    rows[5] = rows[5].replace("what", "wh\\udcffat")
    open(os.path.join(d, "train.jsonl"), "w").write("\n".join(rows) + "\n")
    open(os.path.join(d, "test.jsonl"), "w").write("\n".join(rows[6:10]) + "\n")
    out = _launch("data.dataset=gsm8k", f"data.path={d}", "data.max_prompt_length=128", "--run-dir",
                  os.path.join(work, "surrogate"))
    return ("a data row with an escaped lone surrogate", "exit 2 naming the row, nothing written", _observed(out),
            out.returncode == 2 and not os.path.exists(os.path.join(work, "surrogate")))


def disk_full(work):
    if not (ROOT and shutil.which("unshare")):
        return ("disk full at a checkpoint save", "one line naming the newest intact checkpoint",
                "skipped: a private tmpfs needs root and unshare", None)
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    cmd = " ".join([sys.executable, "-m", "rljax.launch", *SMALL, "trainer.total_steps=50", "trainer.save_freq=1",
                    "trainer.max_checkpoints=null", "--run-dir", f"{mnt}/run"])
    script = f"mount -t tmpfs -o size=3m none {mnt} && {cmd} > /dev/null 2> {work}/disk.err; echo $? > {work}/disk.rc"
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=_env(), timeout=900)
    rc, err = int(open(f"{work}/disk.rc").read()), open(f"{work}/disk.err").read()
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("[")]
    ok = rc == 1 and "Traceback" not in err and len(lines) == 1 and "newest intact checkpoint" in lines[0]
    return ("disk full at a checkpoint save (3 MB tmpfs)", "one line: what failed, where, the newest intact "
            "checkpoint", f"exit {rc}, {len(lines)} line(s) besides progress: {_short(_last(err))}", ok)


# ----------------------------------------------------------------------------- issue 39


def _cache_runs(work, name, damage):
    """A run into a private compilation cache, ``damage(cache, entries)``, then a second launch:
    ``(second launch, refusal lines, its exit line, entries)``."""
    cache = os.path.join(work, f"cache-{name}")
    args = (*SMALL, "trainer.total_steps=1", f"trainer.compilation_cache_dir={cache}")
    first = _launch("--run-dir", os.path.join(work, f"{name}-a"), *args)
    if first.returncode:
        raise RuntimeError(first.stderr[-2000:])
    entries = sorted(os.path.join(cache, n) for n in os.listdir(cache) if n.endswith("-cache"))
    damage(cache, entries)
    checked = os.path.getmtime(os.path.join(cache, ".rljax-checked"))
    for p in entries:  # older than the start-up check, as in the issue: only the read sees them
        if os.path.exists(p):
            os.utime(p, (checked - 5, checked - 5))
    out = _launch("--run-dir", os.path.join(work, f"{name}-b"), *args)
    said = [l for l in (out.stdout + out.stderr).splitlines()
            if ("refused" in l and "this process loaded" not in l) or "Error reading persistent" in l]
    exit_line = next((l for l in out.stdout.splitlines() if "this process loaded" in l), "")
    return out, said, exit_line, entries, cache, args


def _pair(entries):
    by_module: dict = {}
    for p in entries:
        by_module.setdefault(os.path.basename(p).rsplit("-", 2)[0], []).append(p)
    return next(v for v in by_module.values() if len(v) >= 2)[:2]


def cache_swapped_pair(work):
    def swap(cache, entries):
        a, b = _pair(entries)
        da, db = open(a, "rb").read(), open(b, "rb").read()
        open(a, "wb").write(db), open(b, "wb").write(da)
    out, said, exit_line, entries, cache, args = _cache_runs(work, "swap", swap)
    verify = subprocess.run([sys.executable, "-m", "rljax.compilation_cache", "--verify", cache], cwd=REPO,
                            env=_env(), capture_output=True, text=True, timeout=120)
    ok = out.returncode == 0 and len(said) == 1 and "refused 2" in exit_line and verify.returncode == 0
    return ("two same-named compilation cache entries swapped (both valid)",
            "one line naming the cache, both compiled again, the cache verified after",
            f"exit {out.returncode}, {len(said)} line: {_short(said[0] if said else '', 120)}; exit line: "
            f"{_short(exit_line[exit_line.find('loaded'):], 120)}; --verify exit {verify.returncode}", ok)


def cache_flipped_every_entry(work):
    def flip(cache, entries):
        for p in entries:
            data = bytearray(open(p, "rb").read())
            data[len(data) // 3] ^= 1
            open(p, "wb").write(bytes(data))
    out, said, exit_line, entries, cache, args = _cache_runs(work, "flip", flip)
    again = _launch("--run-dir", os.path.join(work, "flip-c"), *args)
    said_again = [l for l in (again.stdout + again.stderr).splitlines() if "refused" in l or "Error reading" in l]
    n = len(entries)
    again_line = next((l for l in again.stdout.splitlines() if "this process loaded" in l), "")
    ok = (out.returncode == 0 and len(said) == 1 and f"compiled {n} ({n} written to it; refused {n}" in exit_line
          and again.returncode == 0 and f"loaded {n} program(s) from it and compiled 0" in again_line
          and not said_again)
    return ("a flipped byte in every compilation cache entry",
            "one line, every entry compiled and written again (counted), the next launch loads them silently",
            f"exit {out.returncode}, {len(said)} line; exit line: {_short(exit_line[exit_line.find('loaded'):], 110)}"
            f"; next launch: {_short(again_line[again_line.find('loaded'):], 90)}"
            f"{'; it said: ' + _short(said_again[0], 100) if said_again else ''}", ok)


def cache_wrong_program(work):
    sys.path.insert(0, REPO)
    from rljax import compilation_cache as cc

    def forge(cache, entries):  # swapped and sealed again under the new keys: the seal cannot tell
        stage = sorted(p for p in entries if os.path.basename(p).startswith("jit_stage-"))[:2]
        keys = [os.path.basename(p)[: -len("-cache")] for p in stage]
        values = [cc.unseal(k, open(p, "rb").read())[0] for k, p in zip(keys, stage)]
        for p, k, v in zip(stage, keys, values[::-1]):
            open(p, "wb").write(cc.seal(k, v))
    out, said, exit_line, entries, cache, args = _cache_runs(work, "forge", forge)
    retry = next((l for l in out.stderr.splitlines() if "retrying once" in l), "")
    ok = out.returncode == 0 and retry and "Traceback" not in out.stderr
    return ("a wrong program under a valid seal (a pair swapped and resealed)",
            "the launch fails on it, says so, runs again with the cache bypassed",
            f"exit {out.returncode}: {_short(retry, 200)}", ok)


def resume_with_overrides(work):
    run = os.path.join(work, "overrides")
    shutil.copytree(_trained(work), run)
    out = _launch("--run-dir", run, "--resume", "rollout.n=4", "data.train_batch_size=8", "trainer.total_steps=3")
    chk = _check(run)
    noise = "could not be restored" in out.stdout + out.stderr
    changes = open(os.path.join(run, "config_changes.jsonl")).read().strip() if out.returncode == 0 else ""
    ok = out.returncode == 0 and chk.returncode == 0 and not noise and '"from_step": 3' in changes
    return ("--resume rollout.n=4 data.train_batch_size=8 trainer.total_steps=3 on a finished run",
            "trains on, records the change, trace check passes, no orbax warning",
            f"exit {out.returncode}; config_changes.jsonl: {_short(changes, 130)}; trace check exit {chk.returncode}"
            f"{'; orbax warning printed' if noise else ''}", ok)


def cut_metrics_line(work):
    run = os.path.join(work, "cut")
    shutil.copytree(_trained(work), run)
    path = os.path.join(run, "metrics.jsonl")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-40])
    out = _launch("--run-dir", run, "--resume", "trainer.total_steps=3")
    said = next((l for l in out.stdout.splitlines() if "cut short" in l), "")
    chk = _check(run)
    ok = out.returncode == 0 and "step 2 runs again" in said and _steps(run) == [1, 2, 3] and chk.returncode == 0
    return ("the last 40 bytes of a finished run's metrics.jsonl cut, then --resume trainer.total_steps=3",
            "step 2 runs again from checkpoint 1 and says so; steps 1-3 recorded; trace check passes",
            f"exit {out.returncode}: {_short(said, 150)}; steps {_steps(run)}; trace check exit {chk.returncode}", ok)


def _gsm8k_dir(work, name, rows):
    d = os.path.join(work, name)
    os.makedirs(d)
    open(os.path.join(d, "train.jsonl"), "wb").write(b"\n".join(rows) + b"\n")
    open(os.path.join(d, "test.jsonl"), "wb").write(rows[0] + b"\n")
    return d


def null_prompt(work):
    rows = [json.dumps({"question": f"what is {i}+1?", "answer": f"#### {i + 1}"}).encode() for i in range(16)]
    rows[3] = json.dumps({"question": None, "answer": "#### 2"}).encode()
    d = _gsm8k_dir(work, "nullq", rows)
    out = _launch("data.dataset=gsm8k", f"data.path={d}", "data.max_prompt_length=128", "--run-dir",
                  os.path.join(work, "nullq-run"))
    ok = out.returncode == 2 and "1 of 16 rows have an empty or null prompt (first: row 3)" in out.stderr
    return ('a data row {"question": null, "answer": "#### 2"} (data.truncation=error)',
            "exit 2 in one line naming the row (with left/right: skipped and counted)", _observed(out), ok)


def bad_data_0xff(work):
    rows = [json.dumps({"question": f"what is {i}+1?", "answer": f"#### {i + 1}"}).encode() for i in range(16)]
    rows[5] = rows[5].replace(b"what", b"wh\xffat")
    d = _gsm8k_dir(work, "ff", rows)
    out = _launch("data.dataset=gsm8k", f"data.path={d}", "data.max_prompt_length=128", "--run-dir",
                  os.path.join(work, "ff-run"))
    ok = out.returncode == 2 and "train.jsonl:6: byte 0xFF" in out.stderr
    return ("a raw 0xFF byte in a JSONL data file", "exit 2 naming the file and line", _observed(out), ok)


def sigterm_at_startup(work):
    run = os.path.join(work, "startup")
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run, *SMALL], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "compilation cache" in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    ok = proc.returncode == 143 and "--resume starts from step 1" in _last(err) and "Traceback" not in err
    return ("SIGTERM while the launch starts (compiling)", "exit 143, one line saying where --resume starts",
            f"exit {proc.returncode}: {_short(_last(err))}", ok)


def _async_counters(run: str) -> list[tuple]:
    path = os.path.join(run, "metrics.jsonl")
    rows = {r["step"]: r for r in map(json.loads, open(path)) if "actor/pg_loss" in r}  # the resume's lines last
    return [(int(rows[k]["async/generated_rows"]), int(rows[k]["async/weight_pushes"])) for k in sorted(rows)]


def async_resume_counters(work):
    """Issue 39 item 6: an async run stopped after step 2 and resumed to 4, against one launch of 4 steps, at
    tau=0 (the counters equal at every step) and tau=1 (the pushes equal; the rows generated never fewer
    than the batches trained so far)."""
    out = []
    ok = True
    for tau in (0, 1):
        base = [*SMALL, "trainer.mode=async", f"async_training.max_staleness={tau}"]
        full, split = (os.path.join(work, f"counters{tau}-{n}") for n in ("full", "split"))
        for args in (["trainer.total_steps=4", "--run-dir", full], ["trainer.total_steps=2", "--run-dir", split],
                     ["trainer.total_steps=4", "--resume", "--run-dir", split]):
            r = _launch(*base, *args)
            if r.returncode:
                return ("async run resumed: its counters", "continue", _observed(r), False)
        f, s = _async_counters(full), _async_counters(split)
        if tau == 0:
            ok = ok and f == s
        else:
            ok = ok and [p for _, p in f] == [p for _, p in s] and all(g >= 8 * k for k, (g, _) in enumerate(s, 1))
        out.append(f"tau={tau}: (generated_rows, weight_pushes) by step, uninterrupted {f}, resumed after 2 {s}")
    return ("async run stopped after step 2 and resumed to 4 (tau=0, tau=1)",
            "async/generated_rows and async/weight_pushes continue (tau=0: equal to one launch's at every step)",
            "; ".join(out), ok)


FAULTS = [sigint, sigterm_group, unverified_checkpoint, changed_shape, other_task, fresh_into_old, finished_resume,
          sigterm_in_last_step,
          reward_exit_at_import, reward_hang_at_import, reward_huge, reward_all_fail, reward_inprocess_timeout,
          hostile_tool_code, hostile_tool_code_no_sys_admin, sandbox_cannot_drop_root, bad_data_surrogate, disk_full,
          cache_swapped_pair, cache_flipped_every_entry, cache_wrong_program, resume_with_overrides, cut_metrics_line,
          null_prompt, bad_data_0xff, sigterm_at_startup, async_resume_counters]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--only", nargs="*", help="run only these faults (function names)")
    p.add_argument("--workdir", help="where the runs go (default: a temporary directory, removed after)")
    args = p.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="rljax-faults-")
    os.makedirs(work, exist_ok=True)
    rows, t0 = [], time.monotonic()
    for fault in FAULTS:
        if args.only and fault.__name__ not in args.only:
            continue
        t = time.monotonic()
        try:
            name, expected, observed, ok = fault(work)
        except Exception as e:  # noqa: BLE001 - a fault the harness could not inject is a row too
            name, expected, observed, ok = fault.__name__, "?", f"harness error: {type(e).__name__}: {e}", False
        rows.append((name, expected, observed, ok))
        status = "skip" if ok is None else ("ok" if ok else "FAIL")
        print(f"[{time.monotonic() - t:5.0f} s] {status:4}  {name}: {observed}", file=sys.stderr, flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    if args.markdown:
        print("| fault | expected | observed | |\n|---|---|---|---|")
        for name, expected, observed, ok in rows:
            mark = "skipped" if ok is None else ("as expected" if ok else "**NOT as expected**")
            print(f"| {name} | {expected} | {observed.replace('|', '/')} | {mark} |")
    else:
        for name, expected, observed, ok in rows:
            print(f"{'skip' if ok is None else 'ok' if ok else 'FAIL':4}  {name}\n      expected: {expected}\n"
                  f"      observed: {observed}")
    failed = sum(1 for r in rows if r[3] is False)
    print(f"{len(rows)} faults, {failed} not as expected, {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
