"""Running ``python -m rljax.launch`` as a user does, for the end-to-end tests.

The child gets the test session's environment without ``XLA_FLAGS`` / ``JAX_PLATFORMS``
(the launcher must create the CPU devices itself) and with TensorFlow quiet.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_env() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher must create the devices itself
    env.pop("JAX_PLATFORMS", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rljax.launch", *args], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=timeout)


def metrics(run_dir) -> list[dict]:
    """Every record of ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def train_rows(run_dir) -> list[dict]:
    """The per-step training records (not the data counts at step 0 nor the final validation)."""
    return [r for r in metrics(run_dir) if "actor/pg_loss" in r]
