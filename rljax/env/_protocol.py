"""The environment protocol of multi-turn rollouts, the tool-call convention and the tool env.

An **environment** is a class; the rollout makes one instance per session (episode) from
its dataset example and calls :meth:`Environment.step` after every model turn::

    from rljax.env import Environment, Step

    class Echo(Environment):
        def step(self, turn):                      # turn: rljax.env.Turn
            if turn.stopped == "tool":             # the turn ended on env.stop
                return Step(observation=f"[{turn.text[::-1]}]")   # context, mask 0
            return Step(reward=float(turn.text.strip() == self.example.answer))  # ends

Name it on the command line as ``env.function=path/to/file.py:Echo``. ``step`` returns a
:class:`Step`: an ``observation`` (text appended to the context, never trained on) keeps
the episode going; ``observation=None`` ends it, with ``reward`` as the session's final
reward, or ``reward=None`` to let ``reward.function`` score the final turn's text. A
classmethod :meth:`Environment.step_many` gets every session's turn at once (override it
to run tools of many sessions concurrently, as :class:`ToolEnv` does).

**Tool-call convention** (:class:`ToolEnv`): a turn that ends on the stop token
(``env.stop``, one token of the tokenizer) is a tool call; the text before it is
``name(arguments)`` or ``name`` (the last line of the turn), and an empty call runs the
environment's ``default_tool``. The tool's output (or its error) becomes the observation;
a turn that ends on EOS or on the token budget is the answer and ends the episode.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from rljax.env._calculator import CalculatorError, calculator
from rljax.env._sandbox import PythonSandbox, ToolResult
from rljax.errors import ConfigError
from rljax.reward import load_function

STOP_REASONS = ("tool", "eos", "length")


@dataclasses.dataclass(frozen=True)
class Example:
    """The dataset example a session starts from."""

    prompt: str
    answer: str
    index: int = 0
    uid: str = ""
    session: int = 0


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn: its text (the stop / EOS token excluded), token ids, why it ended
    (``"tool"``: the stop token, ``"eos"``, ``"length"``: the turn or response budget) and its
    0-based number."""

    text: str
    token_ids: tuple
    stopped: str
    index: int


@dataclasses.dataclass(frozen=True)
class Step:
    """What the environment answers to a turn (see the module docstring)."""

    observation: Optional[str] = None
    reward: Optional[float] = None
    tool: Optional[str] = None  # the tool that ran (metrics)
    error: bool = False  # the call failed (bad call, tool error): counted in env/tool_errors
    timeout: bool = False  # the tool ran out of time: env/tool_timeouts
    seconds: float = 0.0  # tool latency


class Environment:
    """Base class of environments: one instance per session. Override :meth:`step`."""

    def __init__(self, example: Example):
        self.example = example

    def step(self, turn: Turn) -> Step:  # pragma: no cover - the default ends every episode
        return Step()

    @classmethod
    def step_many(cls, envs: Sequence["Environment"], turns: Sequence[Turn]) -> list[Step]:
        """Every active session's step at once (default: one after the other)."""
        return [e.step(t) for e, t in zip(envs, turns)]


_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$", re.S)


def parse_tool_call(text: str) -> tuple[str, str]:
    """``(name, arguments)`` of the call in a turn's text (its last non-empty line):
    ``name(arguments)`` or bare ``name``; ``("", "")`` for an empty call. ``ValueError`` when
    the line is not a call."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "", ""
    m = _CALL.match(lines[-1])
    if not m:
        raise ValueError(f"not a tool call: {lines[-1][:60]!r}; write name(arguments)")
    return m.group(1), m.group(2) or ""


def python_tool_code(args: str) -> str:
    """The source a ``python(...)`` call runs: its arguments, with a bare expression printed."""
    src = args.strip()
    try:
        compile(src, "<tool>", "eval")
        return f"print({src})"
    except SyntaxError:
        return src


class ToolEnv(Environment):
    """Tool use: turns ending on ``env.stop`` are calls of :attr:`tools`; the answer ends the episode.

    Class attributes (override in a subclass):
      tools: ``name -> fn(arguments: str) -> str`` run in the trainer process (they must be
        safe, like :func:`rljax.env.calculator`); ``"python"`` is special: its calls run in
        the :class:`PythonSandbox`.
      default_tool: the tool an empty call runs (``None``: an empty call is an error).
      sandbox: the :class:`PythonSandbox` of ``python`` calls (``configure`` sets it).

    The final reward is :meth:`final_reward` (default ``None``: ``reward.function`` scores
    the answer).
    """

    tools: Mapping[str, Callable[[str], str]] = {"calc": calculator}
    default_tool: Optional[str] = None
    sandbox: Optional[PythonSandbox] = None

    def final_reward(self, answer: Turn) -> Optional[float]:
        return None

    def call(self, name: str, args: str) -> Step:
        """Runs one in-process tool (``python`` goes through :meth:`step_many`)."""
        fn = self.tools.get(name)
        if fn is None:
            return Step(observation=f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.tools))}",
                        tool=name, error=True)
        t0 = time.perf_counter()
        try:
            out = str(fn(args))
            err = False
        except CalculatorError as e:
            out, err = f"error: {e}", True
        except Exception as e:  # noqa: BLE001 - a tool failure is an observation, not a crash
            out, err = f"error: {type(e).__name__}: {e}", True
        return Step(observation=out, tool=name, error=err, seconds=time.perf_counter() - t0)

    def step(self, turn: Turn) -> Step:
        return type(self).step_many([self], [turn])[0]

    @classmethod
    def step_many(cls, envs: Sequence["ToolEnv"], turns: Sequence[Turn]) -> list[Step]:
        steps: list[Optional[Step]] = [None] * len(envs)
        python: list[tuple[int, str]] = []
        for i, (env, turn) in enumerate(zip(envs, turns)):
            if turn.stopped != "tool":
                steps[i] = Step(reward=env.final_reward(turn))
                continue
            try:
                name, args = parse_tool_call(turn.text)
            except ValueError as e:
                steps[i] = Step(observation=f"error: {e}", error=True)
                continue
            name = name or env.default_tool or ""
            if not name:
                steps[i] = Step(observation="error: empty tool call; write name(arguments)", error=True)
            elif name == "python" and "python" in env.tools:
                python.append((i, python_tool_code(args)))
            else:
                steps[i] = env.call(name, args)
        if python:
            sandbox = cls.sandbox or PythonSandbox()
            results: list[ToolResult] = sandbox.run_many([code for _, code in python])
            for (i, _), r in zip(python, results):
                steps[i] = Step(observation=r.output, tool="python", error=r.error, timeout=r.timeout,
                                seconds=r.seconds)
        return steps  # type: ignore[return-value]


def _python_marker(args: str) -> str:  # pragma: no cover - never called: python runs in the sandbox
    raise RuntimeError("python tool calls run in the sandbox")


class CalculatorPythonEnv(ToolEnv):
    """Both built-in tools: ``calc(expression)`` and ``python(code)``."""

    tools = {"calc": calculator, "python": _python_marker}


class LookupEnv(ToolEnv):
    """The embedded tool task (``data.embedded.task=lookup``): the answer is a digit the prompt
    does not contain; the ``lookup`` tool (also the default tool, so a bare stop token calls
    it) returns it. An answer given without a lookup scores 0 (the environment accepts only
    looked-up answers; a guess would be right at chance); after a lookup, ``reward.function``
    scores the answer."""

    tools = {"lookup": lambda args: ""}  # replaced per instance
    default_tool = "lookup"

    def __init__(self, example: Example):
        super().__init__(example)
        self.looked_up = False

        def lookup(args: str) -> str:
            self.looked_up = True
            return example.answer

        self.tools = {"lookup": lookup, "calc": calculator}

    def final_reward(self, answer: Turn) -> Optional[float]:
        return None if self.looked_up else 0.0


BUILTIN_ENVS = {"tools": CalculatorPythonEnv, "lookup": LookupEnv}


def load_env(spec: str, *, key: str = "env.function") -> type:
    """The environment class a spec names: a built-in (``tools``, ``lookup``) or
    ``path/to/file.py:ClassName`` (a subclass of :class:`Environment`, or any class with a
    ``step(turn)`` method whose constructor takes the :class:`Example`)."""
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    if ":" not in spec:
        raise ConfigError(f"{key}={spec!r} is not a built-in environment ({', '.join(BUILTIN_ENVS)}) nor "
                          "path/to/file.py:ClassName")

    cls = load_function(spec, key=key, prefix="rljax_env")
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise ConfigError(f"{key}={spec!r}: {getattr(cls, '__name__', cls)!r} is not a class with a step(turn) "
                          "method (subclass rljax.env.Environment)")
    if not hasattr(cls, "step_many"):
        cls.step_many = classmethod(Environment.step_many.__func__)
    return cls


def env_metrics(steps: Sequence[Step]) -> dict[str, Any]:
    calls = [s for s in steps if s.tool is not None or s.error]
    return {"tool_calls": len(calls), "tool_errors": sum(s.error for s in steps),
            "tool_timeouts": sum(s.timeout for s in steps), "tool_s": sum(s.seconds for s in steps)}
