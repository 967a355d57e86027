"""The env section's own launch-time check (``check(cfg)``) and the python tool's sandbox of a run.

A run whose environment has the ``python`` tool probes its sandbox at start
(:meth:`~rljax.env.PythonSandbox.probe`: what model code can really do) and refuses to start
when a protection of ``env.sandbox.require`` does not hold, naming it and what gives it.
"""

from __future__ import annotations

from typing import Optional

from rljax.config import ConfigError
from rljax.env._protocol import ToolEnv, load_env
from rljax.env._sandbox import PythonSandbox, SandboxUnavailable


def run_sandbox(cfg, env_cls) -> Optional[PythonSandbox]:
    """The probed :class:`PythonSandbox` of ``env_cls`` (None when it has no ``python`` tool).

    Raises:
      ConfigError: a protection of ``env.sandbox.require`` does not hold (one line).
    """
    if not (isinstance(env_cls, type) and issubclass(env_cls, ToolEnv) and "python" in env_cls.tools):
        return None
    e = cfg.env
    sandbox = PythonSandbox(timeout_s=e.timeout_s, memory_mb=e.memory_mb, tmp_mb=e.sandbox.tmp_mb,
                            max_files=e.sandbox.max_files)
    try:
        sandbox.require(e.sandbox.require)
    except SandboxUnavailable as err:
        raise ConfigError(str(err)) from None
    return sandbox


def check(cfg) -> None:
    """``env.function`` loads and names an environment class; its python tool's sandbox has the
    protections ``env.sandbox.require`` names."""
    if cfg.env.function is not None:
        run_sandbox(cfg, load_env(cfg.env.function))
