"""rljax.env without the model: the safe calculator, the tool-call convention, the tool
environments, loading a user's environment file and the env.* config checks."""

import os
import textwrap

import pytest

from rljax.config import ConfigError
from rljax.env import (CalculatorError, CalculatorPythonEnv, Environment, Example, LookupEnv, Step, ToolEnv, Turn,
                       calculate, calculator, load_env, parse_tool_call, python_tool_code)


def turn(text, stopped="tool", index=0):
    return Turn(text=text, token_ids=(), stopped=stopped, index=index)


EX = Example(prompt="key ab=", answer="7", index=3, uid="u", session=1)


@pytest.mark.parametrize("expr,value", [("1+2*3", 7), ("(1+2)*3", 9), ("-4**2", -16), ("7//2", 3), ("7/2", 3.5),
                                        ("123456789*987654321", 121932631112635269), ("2**64", 2**64), ("10%4", 2),
                                        (" 3 ", 3), ("1.5*2", 3.0)])
def test_calculator_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os').system('touch /tmp/agent_t/pwned')", "open('/etc/passwd').read()", "x", "x+1",
    "(lambda: 1)()", "[1,2][0]", "'a'*3", "1 if 1 else 2", "abs(-1)", "(1).__class__", "9**9**9", "2**0.5**99",
    "10**100*10**100", "1/0", "", "1+", "import os", "a=1", "{1: 2}", "f'{1}'", "1<2", "True+1", "1"*300])
def test_calculator_rejects_anything_but_arithmetic(expr):
    with pytest.raises(CalculatorError):
        calculate(expr)
    assert not os.path.exists("/tmp/agent_t/pwned")


def test_calculator_tool_text():
    assert calculator("6*7") == "42" and calculator("1/4") == "0.25" and calculator("4/2") == "2"


@pytest.mark.parametrize("text,call", [("calc(1+2)", ("calc", "1+2")), ("I will compute\ncalc( 3*4 )", ("calc", " 3*4 ")),
                                       ("lookup", ("lookup", "")), ("", ("", "")), ("  \n ", ("", "")),
                                       ("python(print((1, 2)))", ("python", "print((1, 2))"))])
def test_parse_tool_call(text, call):
    assert parse_tool_call(text) == call


@pytest.mark.parametrize("text", ["1+2", "calc(1+2", "two words", "calc(1) tail"])
def test_parse_tool_call_rejects(text):
    with pytest.raises(ValueError, match="not a tool call"):
        parse_tool_call(text)


def test_python_tool_code_prints_expressions():
    assert python_tool_code("2**10") == "print(2**10)"
    assert python_tool_code("x = 3\nprint(x)") == "x = 3\nprint(x)"


def test_tool_env_steps():
    env = CalculatorPythonEnv(EX)
    steps = CalculatorPythonEnv.step_many(
        [env] * 6, [turn("calc(12345*6789)"), turn("calc(__import__('os'))"), turn("nope(1)"), turn("1 +"),
                    turn(""), turn("the answer is 3", stopped="eos")])
    assert steps[0] == Step(observation="83810205", tool="calc", seconds=steps[0].seconds)
    assert steps[1].error and steps[1].observation.startswith("error: not arithmetic") and steps[1].tool == "calc"
    assert steps[2].error and "unknown tool 'nope'" in steps[2].observation
    assert steps[3].error and "not a tool call" in steps[3].observation
    assert steps[4].error and "empty tool call" in steps[4].observation  # no default tool
    assert steps[5].observation is None and steps[5].reward is None  # the answer ends the episode


@pytest.mark.slow
def test_tool_env_python_calls_run_concurrently_in_the_sandbox():
    env = CalculatorPythonEnv(EX)
    steps = CalculatorPythonEnv.step_many([env] * 3, [turn("python(2**100)"), turn("python(import os; print(1/0))"),
                                                     turn("calc(2+2)")])
    assert steps[0].observation == f"{2**100}\n" and not steps[0].error and steps[0].tool == "python"
    assert steps[1].error and "ZeroDivisionError" in steps[1].observation
    assert steps[2].observation == "4"


def test_lookup_env_default_tool_reveals_the_answer():
    env = LookupEnv(EX)
    assert env.step(turn("")).observation == "7"  # a bare stop token calls lookup
    assert env.step(turn("lookup")).observation == "7"
    assert LookupEnv(Example(prompt="key zz=", answer="2")).step(turn("")).observation == "2"
    end = env.step(turn("7", stopped="eos"))
    assert end.observation is None and end.reward is None  # reward.function scores the answer
    guess = LookupEnv(EX).step(turn("7", stopped="eos"))  # no lookup: a guess scores 0
    assert guess.observation is None and guess.reward == 0.0


def test_load_env_builtin_and_user_file(tmp_path):
    assert load_env("lookup") is LookupEnv and load_env("tools") is CalculatorPythonEnv
    f = tmp_path / "my_env.py"
    f.write_text(textwrap.dedent("""
        from rljax.env import Environment, Step

        class Echo(Environment):
            def step(self, turn):
                if turn.stopped == "tool":
                    return Step(observation=turn.text[::-1])
                return Step(reward=float(turn.text == self.example.answer))

        class Plain:  # not a subclass: step(turn) and a constructor taking the example are enough
            def __init__(self, example):
                self.example = example
            def step(self, turn):
                return Step()

        def not_a_class(turn):
            return None
    """))
    echo = load_env(f"{f}:Echo")
    assert issubclass(echo, Environment)
    e = echo(EX)
    assert e.step(turn("abc")).observation == "cba" and e.step(turn("7", stopped="eos")).reward == 1.0
    plain = load_env(f"{f}:Plain")
    assert plain.step_many([plain(EX)], [turn("x")]) == [Step()]
    with pytest.raises(ConfigError, match="not a class with a step"):
        load_env(f"{f}:not_a_class")
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        load_env(f"{f}:Missing")
    with pytest.raises(ConfigError, match="not a built-in environment"):
        load_env("lokup")


def test_env_config_checks():
    from rljax.config import resolve

    with pytest.raises(ConfigError, match="env.function=lookup"):
        resolve(overrides=["data.embedded.task=lookup"])
    with pytest.raises(ConfigError, match="env.function='lokup' is not a built-in"):
        resolve(overrides=["env.function=lokup"])
    cfg = resolve(overrides=["data.embedded.task=lookup", "env.function=lookup", "env.max_turns=3"])[0]
    assert cfg.env.function == "lookup" and cfg.env.max_turns == 3 and cfg.env.stop == "?"
    with pytest.raises(ConfigError, match="env.max_turns"):
        resolve(overrides=["env.max_turns=0"])


def test_env_stop_must_be_one_token():
    from rljax.config import resolve
    from rljax.env import EnvRuntime
    from rljax.tokenizer import CharTokenizer

    cfg = resolve(overrides=["data.embedded.task=lookup", "env.function=lookup", "env.stop=<call>"])[0]
    with pytest.raises(ConfigError, match="env.stop='<call>' is 6 tokens"):
        EnvRuntime.from_config(cfg, CharTokenizer())
    rt = EnvRuntime.from_config(resolve(overrides=["data.embedded.task=lookup", "env.function=lookup"])[0],
                                CharTokenizer())
    assert rt.stop_id == CharTokenizer().encode("?")[0] and issubclass(rt.env_cls, LookupEnv)
    assert rt.env_cls.sandbox is None and rt.sandbox_probe is None  # no python tool: no sandbox to probe
    rt = EnvRuntime.from_config(resolve(overrides=["env.function=tools", "env.sandbox.require=[non_root]"])[0],
                                CharTokenizer())
    assert rt.env_cls.sandbox.timeout_s == 5.0 and rt.sandbox_probe["non_root"]
    assert rt.sandbox_probe["line"].startswith("sandbox: non_root yes")


def test_tool_env_subclass_with_own_tools():
    class Upper(ToolEnv):
        tools = {"up": str.upper, "boom": lambda a: 1 / 0}

    steps = Upper.step_many([Upper(EX)] * 2, [turn("up(abc)"), turn("boom(1)")])
    assert steps[0].observation == "ABC"
    assert steps[1].error and steps[1].observation == "error: ZeroDivisionError: division by zero"
