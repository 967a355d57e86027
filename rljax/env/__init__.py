"""Multi-turn environments and tools (agentic RL): the environment protocol, the tool-call
convention, a safe calculator, a sandboxed Python tool, and the episode rollout.

See :mod:`rljax.env._protocol` (the protocol a user implements, ``env.function=file.py:Name``),
:mod:`rljax.env._sandbox` (the Python tool's limits) and :mod:`rljax.env._rollout` (the data
contract of a multi-turn trajectory).

The protocol, tools and sandbox are pure Python; the episode rollout (JAX) is imported on
first use, so the launcher can load and check a user's ``env.function`` file (which imports
``rljax.env``) before JAX starts.
"""

from rljax.env._calculator import CalculatorError, calculate, calculator
from rljax.env._protocol import (BUILTIN_ENVS, CalculatorPythonEnv, Environment, Example, LookupEnv, Step, Turn,
                                 ToolEnv, env_metrics, load_env, parse_tool_call, python_tool_code)
from rljax.env._sandbox import PythonSandbox, SandboxUnavailable, ToolResult
from rljax.env._check import check, run_sandbox

__all__ = ["BUILTIN_ENVS", "CalculatorError", "CalculatorPythonEnv", "EnvRuntime", "Environment", "EpisodeTrajectories",
           "Example", "LookupEnv", "PythonSandbox", "SandboxUnavailable", "Step", "ToolEnv", "ToolResult", "Turn",
           "calculate", "calculator", "check", "env_metrics", "episode_metrics", "episode_scores", "load_env",
           "parse_tool_call", "python_tool_code", "run_episodes", "run_sandbox"]

_ROLLOUT = ("EpisodeTrajectories", "episode_scores", "run_episodes")
_RUNTIME = ("EnvRuntime", "episode_metrics")


def __getattr__(name):
    if name in _ROLLOUT:
        from rljax.env import _rollout  # jax: the preflight loads env files before JAX may start

        return getattr(_rollout, name)
    if name in _RUNTIME:
        from rljax.env import _stage  # jax (through the episode rollout), as above

        return getattr(_stage, name)
    raise AttributeError(f"module 'rljax.env' has no attribute {name!r}")
