"""Every test sees 8 simulated CPU devices.

The flag must be in the environment before JAX initialises its backends, so it is set at
import time of this module, which pytest loads before any test module imports jax.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} {_FLAG}".strip()
# Tests check numbers, not speed, and most of their time is XLA:CPU compiling tiny programs:
# LLVM at -O0 compiles them in ~0.6x the CPU time (tests/test_trainer_step.py: 98 -> 58 s
# user). XLA's own HLO passes and float semantics are unchanged (no fast math either way).
# Runs launched as subprocesses (tests/launching.py) get no XLA_FLAGS: they compile as users'.
if "xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow (pulled in by JetStream / TFDS) stays quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 CPU devices, found {len(devs)}: set XLA_FLAGS before JAX initialises"
    return devs
