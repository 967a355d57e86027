"""tests/conftest.py adds an XLA flag only where this jaxlib's XLA defines it (an unknown flag in
XLA_FLAGS aborts the process at JAX's start), and the tests in this process then run with it."""

import os

import conftest


def test_xla_flag_lookup_finds_known_flags_only():
    assert conftest._xla_defines("xla_backend_optimization_level")
    assert conftest._xla_defines("xla_force_host_platform_device_count")
    assert not conftest._xla_defines("xla_cpu_no_such_flag_in_any_release")
    assert not conftest._xla_defines("xla_cpu_use_fusion_emitter")  # a prefix of a real name is not a name


def test_the_test_process_compiles_with_the_classic_emitters_where_xla_has_the_flag():
    flags = os.environ["XLA_FLAGS"].split()
    assert ("--xla_cpu_use_fusion_emitters=false" in flags) == conftest._xla_defines("xla_cpu_use_fusion_emitters")
    assert "--xla_backend_optimization_level=0" in flags
