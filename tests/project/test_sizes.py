"""Size and shape limits of the code (issue 32) outside the observers' rooms (``rljax/trace`` and
``rljax/launch.py``: ``tests/project/test_code_size.py``, whose measure of a function's own lines
this file shares): no module of ``rljax/trainer`` over 600 lines, no function of ``rljax/`` over
80 lines of its own, no stage function replaced by name. Each failure names the file and the
limit. The lists below are what exceeds a limit today, each with the work that removes it; an
entry that no longer exceeds its limit fails too (remove it), so the lists only shrink."""

import ast

from repo_paths import REPO
from test_code_size import own_lines

MODULE_LINES = 600
FUNCTION_LINES = 80
#: Measured by tests/project/test_code_size.py.
OBSERVED = ("rljax/trace/", "rljax/launch.py")

#: Modules of rljax/trainer over MODULE_LINES today, and what splits them.
LONG_MODULES: dict = {}
#: Entries of LONG_MODULES in other rooms: not checked for staleness here.
NOT_OURS: tuple = ()


def _sources(*dirs):
    for d in dirs:
        yield from sorted((REPO / d).rglob("*.py"))


def _rel(path) -> str:
    return path.relative_to(REPO).as_posix()


def test_no_trainer_module_over_600_lines():
    long = {_rel(p): len(p.read_text().splitlines()) for p in _sources("rljax/trainer")}
    bad = [f"{k}: {n} lines, over {MODULE_LINES}: split it by job" for k, n in long.items()
           if n > MODULE_LINES and k not in LONG_MODULES]
    assert not bad, "\n".join(bad)
    stale = [k for k in LONG_MODULES if long.get(k, 0) <= MODULE_LINES and k not in NOT_OURS]
    assert not stale, f"{stale} no longer exceed {MODULE_LINES} lines: remove them from LONG_MODULES"


def test_no_function_over_80_lines_of_its_own():
    bad = []
    for p in _sources("rljax"):
        if _rel(p).startswith(OBSERVED):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and own_lines(node) > FUNCTION_LINES:
                bad.append(f"{_rel(p)}:{node.lineno}: {node.name} has {own_lines(node)} lines of its own, over "
                           f"{FUNCTION_LINES} (docstring and nested bodies aside): split it")
    assert not bad, "\n".join(bad)
def _replaces_fn(tree) -> list:
    """Calls of ``replace(..., fn=...)`` (``dataclasses.replace`` of a stage with another function)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "fn" for k in node.keywords):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "replace":
                out.append(node.lineno)
    return out


#: Files that still replace stage functions by name, and what removes it.
REPLACING: dict = {}


def test_no_stage_function_is_replaced_by_name():
    bad, seen = [], set()
    for p in _sources("rljax"):
        lines = _replaces_fn(ast.parse(p.read_text()))
        if lines:
            seen.add(_rel(p))
            if _rel(p) not in REPLACING:
                bad.append(f"{_rel(p)}:{lines[0]}: a stage's function replaced (replace(..., fn=...)): declare "
                           "another stage (or a variant with its own `when`) instead")
    assert not bad, "\n".join(bad)
    stale = sorted(set(REPLACING) - seen)
    assert not stale, f"{stale} no longer replace a stage: remove them from REPLACING"
    assert _replaces_fn(ast.parse("import dataclasses\ndataclasses.replace(s, fn=g)\n")) == [2]
