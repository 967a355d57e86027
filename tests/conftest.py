"""Every test sees 8 simulated CPU devices.

The flag must be in the environment before JAX initialises its backends, so it is set at
import time of this module, which pytest loads before any test module imports jax.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_FLAG}".strip()
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
