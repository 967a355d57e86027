"""Time to the first finished step with the persistent compilation cache: cache off, first
launch into an empty cache, second launch of the same run, side by side.

    python bench/compile_cache.py [--tasks default,tool] [--steps 2] [--rounds 1]

Each launch is ``python -m rljax.launch`` as a user runs it (the default run: ``--mesh=dp8``;
the tool task: ``--config tool_lookup``), cut to ``--steps`` steps, in its own run directory.
A round is: cache off (``trainer.compilation_cache_dir=null``), a first launch into a fresh
cache directory, a second launch into the same directory. The time to the first step is from
the process start to the launcher's first progress line (``step 1/N``: start-up, data, the
validation before training when the preset has one, and the first step with every compile);
the second launch's programs come from the cache, so its compiles are loads. The metrics of
all three launches must be identical (timings aside); the bench says so per task.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from rljax.trace.metrics import is_wall_clock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = {"default": ["--mesh=dp8"], "tool": ["--config", "tool_lookup"]}


def _env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher makes the devices, as for a user
    env.pop("JAX_PLATFORMS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(args: list[str], run_dir: str, cache: str | None, steps: int) -> dict:
    """One launch: seconds to the first progress line and in all, the cache report, metrics."""
    cmd = [sys.executable, "-m", "rljax.launch", *args, "--run-dir", run_dir, f"trainer.total_steps={steps}",
           f"trainer.compilation_cache_dir={cache if cache else 'null'}"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first, lines = [None], []

    def read():
        for line in p.stdout:
            lines.append(line)
            if first[0] is None and re.search(r"\bstep 1/\d+", line):
                first[0] = time.perf_counter() - t0

    reader = threading.Thread(target=read)
    reader.start()
    rc = p.wait()
    reader.join()
    total = time.perf_counter() - t0
    out = "".join(lines)
    if rc != 0:
        raise SystemExit(f"launch failed ({rc}): {' '.join(cmd)}\n{out[-3000:]}")
    m = re.search(r"loaded (\d+) program\(s\) from it and compiled (\d+)", out)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(ln) for ln in fh if ln.strip()]
    rows = [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows if "actor/pg_loss" in r]
    return {"first_step_s": first[0], "total_s": total, "loaded": int(m[1]) if m else 0,
            "compiled": int(m[2]) if m else None, "rows": rows}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="default,tool", help="comma-separated: " + ", ".join(TASKS))
    ap.add_argument("--steps", type=int, default=2, help="steps per launch")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of (off, first, second) per task")
    a = ap.parse_args()
    tasks = [t for t in a.tasks.split(",") if t]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        ap.error(f"unknown task(s) {bad}; accepted: {', '.join(TASKS)}")
    print(f"load average at start: {_load()}; {os.cpu_count()} CPUs")
    work = tempfile.mkdtemp(prefix="rljax-bench-cache-")
    results = []
    try:
        for task in tasks:
            for r in range(a.rounds):
                cache = os.path.join(work, f"{task}-{r}-cache")
                runs = {}
                for name, c in (("off", None), ("first", cache), ("second", cache)):
                    runs[name] = launch(TASKS[task], os.path.join(work, f"{task}-{r}-{name}"), c, a.steps)
                    print(f"  {task} round {r} {name}: first step after {runs[name]['first_step_s']:.1f} s, "
                          f"{runs[name]['total_s']:.1f} s in all, loaded {runs[name]['loaded']} / compiled "
                          f"{runs[name]['compiled']}; load {_load()}", flush=True)
                same = runs["off"]["rows"] == runs["first"]["rows"] == runs["second"]["rows"]
                for name in ("first", "second"):
                    for i, (x, y) in enumerate(zip(runs["off"]["rows"], runs[name]["rows"])):
                        diff = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
                        if diff:
                            print(f"  {task} round {r}: step {i + 1} differs, off vs {name}: {diff}")
                results.append((task, r, runs, same))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at end: {_load()}")
    print("| task | round | cache off: s to step 1 | first launch | second launch | second / first | second / off "
          "| programs loaded / compiled (second) | metrics identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, r, runs, same in results:
        off, first, second = (runs[k]["first_step_s"] for k in ("off", "first", "second"))
        print(f"| {task} | {r} | {off:.1f} | {first:.1f} | {second:.1f} | {second / first:.2f}x | {second / off:.2f}x "
              f"| {runs['second']['loaded']} / {runs['second']['compiled']} | {'yes' if same else 'NO'} |")
    return 0 if all(s for *_, s in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
