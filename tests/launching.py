"""Running ``python -m rljax.launch`` as a user does, for the end-to-end tests.

The child gets the test session's environment without ``JAX_PLATFORMS`` and without the
session's device count in ``XLA_FLAGS`` (the launcher must create the CPU devices itself), with
TensorFlow quiet, and compiling like the tests in this process (tests/conftest.py): LLVM at ``-O0``
and, where this jaxlib has them, XLA:CPU's classic emitters instead of its MLIR fusion emitters.
A short launch spends most of its time compiling: ``-O0`` compiles it in ~0.65x the CPU time
(``--mesh=dp2``, 2 steps, a cold cache: 37 -> 24 s user; docs/development.md) and the classic
emitters in ~0.65x again (``--mesh=dp8``, 3 steps, a cold cache: 22.4 / 25.4 -> 15.3 / 15.8 s
user, two alternations, 6 Dec 2026). Neither uses fast math; the emitters fuse differently, so a
sum may round differently in its last bits (that launch's step-3 pg_loss: rel 2e-5 apart; the
end-to-end tests compare launches with each other, or at rel 1e-5 / abs 1e-6). Programs run
slower, so a run whose time is mostly steps (tests/launch/test_learning.py: 300 of them; the 0.5B
preset's) passes ``compile_as_user=True`` and compiles as users' runs do: those launches keep
XLA's default code generation covered.
"""

import json
import os
import subprocess
import sys

import repo_paths

REPO = str(repo_paths.REPO)  # a str: the tests pass it as cwd and join it into PYTHONPATH


#: XLA flags of the runs the tests launch (see the module docstring): the classic emitters where
#: tests/conftest.py found this jaxlib's XLA defining the flag (an unknown flag aborts a process).
TEST_XLA_FLAGS = " ".join(["--xla_backend_optimization_level=0"] + [
    "--xla_cpu_use_fusion_emitters=false"] * ("--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")))


def launch_env(compile_as_user: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher must create the devices itself
    if not compile_as_user:
        env["XLA_FLAGS"] = TEST_XLA_FLAGS
    env.pop("JAX_PLATFORMS", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch(*args, timeout=600, compile_as_user=False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rljax.launch", *args], cwd=REPO,
                          env=launch_env(compile_as_user), capture_output=True, text=True, timeout=timeout)


def metrics(run_dir) -> list[dict]:
    """Every record of ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def assert_same_metrics(a: list[dict], b: list[dict], *, skip: tuple, least: int = 60) -> None:
    """Records ``b`` have the steps of records ``a`` and every numeric metric of ``a`` (but keys
    starting with one of ``skip``: wall clocks, per-process facts) equal to rel 1e-5 / abs 1e-6;
    at least ``least`` values compared, so an empty comparison cannot pass."""
    import math

    assert [r["step"] for r in a] == [r["step"] for r in b]
    compared = 0
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            if key.startswith(skip) or not isinstance(va, (int, float)):
                continue
            assert key in rb, (ra["step"], key)
            assert math.isclose(va, rb[key], rel_tol=1e-5, abs_tol=1e-6), (ra["step"], key, va, rb[key])
            compared += 1
    assert compared > least, compared


def train_rows(run_dir) -> list[dict]:
    """The per-step training records (not the data counts at step 0 nor the final validation)."""
    return [r for r in metrics(run_dir) if "actor/pg_loss" in r]


def full_and_resumed(base, tmp_path, steps: int = 4):
    """``base`` run for ``steps`` steps in one launch (``tmp_path/full``) and in two, stopped after
    half of them and continued with ``--resume`` (``tmp_path/split``); returns the two run
    directories. Every launch must succeed."""
    full, split = tmp_path / "full", tmp_path / "split"
    for args in ([f"trainer.total_steps={steps}", "--run-dir", str(full)],
                 [f"trainer.total_steps={steps // 2}", "--run-dir", str(split)],
                 [f"trainer.total_steps={steps}", "--resume", "--run-dir", str(split)]):
        out = launch(*base, *args)
        assert out.returncode == 0, out.stderr[-3000:]
    return full, split
