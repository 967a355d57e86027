"""One launched training run for the learning benches: its metrics.jsonl records and wall time."""

import json
import os
import subprocess
import sys
import time


def launch_run(run_dir: str, args: list[str], *, name: str) -> tuple[list[dict], float]:
    """Runs ``python -m rljax.launch --run-dir RUN_DIR ARGS`` (the launcher sets up its own CPU
    devices: XLA_FLAGS is dropped) and returns ``(metrics records, seconds)``; exits naming the run
    and the tail of its stderr when it fails."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "rljax.launch", "--run-dir", run_dir, *args],
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return list(map(json.loads, fh)), time.perf_counter() - t
