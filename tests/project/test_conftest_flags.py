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


def test_launched_runs_compile_like_this_process_unless_as_users():
    """tests/launching.py: the runs the tests launch take -O0 and the classic emitters (where XLA
    has the flag), without this process's device count; compile_as_user runs take no XLA flags."""
    import launching

    classic = ["--xla_cpu_use_fusion_emitters=false"] * conftest._xla_defines("xla_cpu_use_fusion_emitters")
    assert launching.launch_env()["XLA_FLAGS"].split() == ["--xla_backend_optimization_level=0", *classic]
    assert "XLA_FLAGS" not in launching.launch_env(compile_as_user=True)
