"""Every test sees 8 simulated CPU devices.

The flag must be in the environment before JAX initialises its backends, so it is set at
import time of this module, which pytest loads before any test module imports jax.
"""

import os
import pathlib

_TESTS = pathlib.Path(__file__).resolve().parent  # this file stays at the root of tests/
_FLAG = "--xla_force_host_platform_device_count=8"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} {_FLAG}".strip()
# Tests check numbers, not speed, and most of their time is XLA:CPU compiling tiny programs:
# LLVM at -O0 compiles them in ~0.6x the CPU time (tests/trainer/test_trainer_step.py: 98 -> 58 s
# user). XLA's own HLO passes and float semantics are unchanged (no fast math either way).
# Runs launched as subprocesses (tests/launching.py) get -O0 without the device count (the
# launcher creates their devices), except the learning curve's, which compiles as users' runs do.
if "xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} --xla_backend_optimization_level=0"


def _xla_defines(flag: str) -> bool:
    """Whether this jaxlib's XLA defines ``flag`` (its name is a string in jaxlib's shared
    libraries; ~0.2 s to look, without importing jax). An unknown flag in XLA_FLAGS aborts the
    process, and XLA renames and retires flags between releases (jax 0.10-0.12 here)."""
    import glob
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    name = b"\0" + flag.encode() + b"\0"
    for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "*.so")) if spec else ():
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as lib:
            if lib.find(name) >= 0:
                return True
    return False


# XLA:CPU's MLIR fusion emitters (its default code generator for fusions) spend most of the
# compile time of the tests' tiny programs: with the classic emitters a tiny-model update step
# compiles in ~1/3 of the CPU time and tests/trainer/test_trainer_step.py runs in 0.55x (docs/
# development.md). The operations are the same (the default wraps more of them into fusions of
# their own for the emitters) and neither uses fast math: that step's loss agreed to the last bit.
# The tests in this process check numbers (to their tolerances), not code generation. Runs launched as
# subprocesses (tests/launching.py) take the same two flags, except the ones launched with
# compile_as_user (the default 300-step run, the 0.5B preset's): those compile the way users' runs do.
if "xla_cpu_use_fusion_emitters" not in _flags and _xla_defines("xla_cpu_use_fusion_emitters"):
    _flags = f"{_flags} --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow (pulled in by JetStream / TFDS) stays quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    """One persistent compilation cache for the whole test session (rljax.compilation_cache):
    $JAX_COMPILATION_CACHE_DIR when set (.ci/run sets a fresh one, shared by its default and
    slow passes), else a fresh temporary directory made here, in the controller, before the
    xdist workers start (they inherit the variable). Every worker and every run the tests
    launch as a subprocess (trainer.compilation_cache_dir=auto reads the variable) loads a
    program another one compiled instead of compiling it again; JAX's file lock makes the
    shared directory safe. A fresh directory per session, so a run still compiles everything
    once and catches compile errors."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import tempfile

        os.environ["JAX_COMPILATION_CACHE_DIR"] = config._rljax_jax_cache = tempfile.mkdtemp(
            prefix="rljax-test-jax-cache-")
    from rljax.compilation_cache import setup

    setup("auto", echo=None, report_at_exit=False)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times", metavar="PATH", default=None,
        help="append one line per test to PATH: node id, CPU seconds (the test process and the "
             "processes it launched and waited for), wall seconds, 1-minute load average; tab-separated. "
             "On a shared machine CPU seconds compare runs that wall seconds cannot.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_times")
    if not path:
        yield
        return
    import resource
    import time

    def cpu():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.time()
    yield
    with open(path, "a") as fh:  # one short write per line: xdist workers may share the file
        fh.write(f"{item.nodeid}\t{cpu() - c0:.1f}\t{time.time() - t0:.1f}\t{os.getloadavg()[0]:.1f}\n")


def pytest_unconfigure(config):
    made = getattr(config, "_rljax_jax_cache", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default run, pyproject.toml): one worker per core, at most 4. Each worker
    compiles its own programs, and past a few workers memory grows faster than the run shrinks."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


#: Test files (paths below ``tests/``) in the order the default run starts them, most expensive first (CPU
#: seconds of ``pytest --cpu-times`` summed by file, 2 Dec 2026 03:36-03:51, load 6-18: test_models 47,
#: test_pallas 32, test_launch 32 with the shared dp8 run, test_sampler 25, test_trainer_step 19, ...). With
#: ``--dist loadfile`` a worker takes whole files in this order as it frees up (``--no-loadscope-reorder`` in
#: pyproject.toml keeps it: xdist would otherwise order files by their number of tests, which put the two most
#: expensive files last and left one worker running them alone at the end). ``test_launch`` comes first because
#: it starts the shared dp8 run that ``test_trace_run`` (placed after the heavy files) reads; a worker that got
#: both at once would wait for it. Files not listed follow in collection order.
HEAVY_FIRST = (
    "launch/test_launch.py",
    "models/test_models.py",
    "pallas/test_pallas.py",
    "rollout/test_sampler.py",
    "trainer/test_trainer_step.py",
    "models/test_lora.py",
    "loss/test_loss_properties.py",
    "loss/test_loss_values.py",
    "pallas/test_pallas_sharded.py",
    "trainer/test_prepare.py",
    "launch/test_disk_faults.py",
    "rollout/test_rollout_engine.py",
    "trace/test_trace_run.py",
    "rollout/test_rollout_partial.py",
    "launch/test_compilation_cache.py",
    "trace/test_trace_alerts.py",
    "models/test_peft.py",
    "models/test_hf.py",
)


#: The same for the slow pass (``pytest -m slow``, two workers in .ci/run): its files by the CPU
#: seconds of their slow tests (``--cpu-times``, 2 Dec 2026), so the longest files start first and
#: the two workers finish together. Files not listed follow in collection order.
SLOW_HEAVY_FIRST = (
    "sharding/test_preset_0_5b.py",  # the qwen2.5-0.5b run: the longest test (261 s in CI, 4 Dec)
    "launch/test_launch.py",
    "trainer/test_async_streaming.py",  # seven runs, ~390 s loaded (5 Dec): late in the alphabet, so named here
    "trainer/test_two_process_rollouts.py",
    "trainer/test_async_kill_resume.py",
    "sharding/test_fsdp.py",
    "launch/test_async_launch.py",
    "launch/test_reliability_e2e.py",
    "launch/test_learning.py",
    "reward/test_reward_model.py",  # 102 CPU s alone (6 Dec, session 19): unlisted, it started in the tail
    "config/test_config_honest.py",
    "trainer/test_distill_async.py",  # 64 CPU s alone (6 Dec, session 19): unlisted, it started near the end
    "trace/test_trace_faults.py",
    "launch/test_reliability_signals.py",
    "trainer/test_dynamic_sampling.py",
    "launch/test_export.py",
    "models/test_models.py",
    "reward/test_reward_judge.py",
    "trainer/test_trainer_packing.py",
    "models/test_lora.py",
    "trace/test_loggers_samples.py",
    "launch/test_disk_faults.py",
    "trace/test_trace_run.py",
)


def pytest_collection_modifyitems(config, items):
    heavy = SLOW_HEAVY_FIRST if config.getoption("markexpr", "") == "slow" else HEAVY_FIRST
    rank = {name: i for i, name in enumerate(heavy)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(_under_tests(item.path), len(rank)), order[id(item)]))


def _under_tests(path) -> str:
    """A test file's path below ``tests/`` as the start orders name it (``launch/test_launch.py``)."""
    return pathlib.Path(path).resolve().relative_to(_TESTS).as_posix()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 CPU devices, found {len(devs)}: set XLA_FLAGS before JAX initialises"
    return devs


def _shared_launch(tmp_path_factory, name: str, *args, **kw):
    """``python -m rljax.launch *args --run-dir <dir>`` once per test session, shared (read-only) by
    the tests that ask for it: ``(run_dir, completed process)``; the launch must succeed.

    Under pytest-xdist the run is shared by every worker too: the first to get here launches it
    under a file lock in the session's common temporary directory, the others wait and read it.
    """
    import fcntl
    import json
    import subprocess

    from launching import launch

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        base = tmp_path_factory.mktemp(name)
    else:
        base = tmp_path_factory.getbasetemp().parent / f"{name}_shared"
        base.mkdir(exist_ok=True)
    run_dir, record = base / "run", base / "completed.json"
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            out = launch(*args, "--run-dir", str(run_dir), **kw)
            record.write_text(json.dumps({"args": out.args, "returncode": out.returncode,
                                          "stdout": out.stdout, "stderr": out.stderr}))
    out = subprocess.CompletedProcess(**json.loads(record.read_text()))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out


@pytest.fixture(scope="session")
def small_dp8_run(tmp_path_factory):
    """One small embedded run, ``python -m rljax.launch --mesh=dp8`` for 2 steps with a checkpoint
    each step, shared by the end-to-end tests (:func:`_shared_launch`)."""
    from test_launch import SMALL

    return _shared_launch(tmp_path_factory, "small_dp8", "--mesh=dp8", *SMALL, "trainer.total_steps=2",
                          "trainer.save_freq=1")


@pytest.fixture(scope="session")
def gae_kl_dp2_tp2_sp2_run(tmp_path_factory):
    """One small run on ``--mesh=dp2,tp2,sp2`` with GAE's critic and KL in the reward and as a loss (a
    reference policy), 2 steps with a checkpoint each step, shared (:func:`_shared_launch`) by the slow
    smoke and GAE tests of tests/launch/test_launch.py and the trace check of tests/trace/test_trace_run.py."""
    from test_launch import GAE_KL, SMALL

    return _shared_launch(tmp_path_factory, "gae_kl_dp2_tp2_sp2", "--mesh=dp2,tp2,sp2", *SMALL, *GAE_KL,
                          "trainer.total_steps=2", "trainer.save_freq=1")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The default run as the README gives it (``python -m rljax.launch --mesh=dp8``: 300 steps,
    compiled as users' runs are), shared (:func:`_shared_launch`) by tests/launch/test_learning.py
    and the distillation learning test, whose teacher is its trained policy (slow tests only)."""
    # 300 steps: -O0's slower programs would cost more than its compile saves
    return _shared_launch(tmp_path_factory, "default_dp8", "--mesh=dp8", timeout=1800, compile_as_user=True)
