"""The observers' rooms stay readable (issue 32): ``rljax/trace/tracer.py`` is at most
:data:`MAX_MODULE_LINES` lines with no class of more than :data:`MAX_ATTRIBUTES` attributes, and no
function in ``rljax/trace`` or ``rljax/launch.py`` is over :data:`MAX_OWN_LINES` lines of its own.

``ast`` only. A function's own lines are its ``def``'s lines less its docstring and the bodies of
the functions and classes nested in it (each of those is measured on its own). A class's
attributes are its annotated class-level fields and the distinct ``self.x = ...`` targets of its
methods (counted by ``tests/trainer/test_trainer_shape.py``'s ``class_attributes``).
"""

import ast
import pathlib

from repo_paths import REPO
from test_trainer_shape import class_attributes as attributes  # the trainer's count of a class's attributes

MAX_MODULE_LINES = 600
MAX_OWN_LINES = 80
MAX_ATTRIBUTES = 20
#: The modules whose size is limited, and where functions are measured.
MODULES = ("rljax/trace/tracer.py",)
FUNCTION_ROOTS = ("rljax/trace", "rljax/launch.py")


def own_lines(fn: ast.AST) -> int:
    """``fn``'s lines less its docstring and its nested functions' and classes' bodies."""
    lines = set(range(fn.lineno, fn.end_lineno + 1))
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines -= set(range(node.lineno, node.end_lineno + 1))
    return len(lines)


def _files(root: pathlib.Path, names) -> list:
    out = []
    for name in names:
        path = root / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def violations(root: pathlib.Path = REPO, modules=MODULES, function_roots=FUNCTION_ROOTS) -> list:
    out = []
    for path in _files(root, modules):
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root)} is {n} lines (at most {MAX_MODULE_LINES}): split it by job")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and len(attributes(node)) > MAX_ATTRIBUTES:
                out.append(f"{path.relative_to(root)}:{node.lineno} class {node.name} has {len(attributes(node))} "
                           f"attributes (at most {MAX_ATTRIBUTES})")
    for path in _files(root, function_roots):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and own_lines(node) > MAX_OWN_LINES:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} is {own_lines(node)} lines of its "
                           f"own (at most {MAX_OWN_LINES}, docstring and nested bodies aside): split it by what it "
                           "computes")
    return out


def test_tracer_and_launch_stay_small():
    found = violations()
    assert not found, "\n".join(found)


def test_the_limits_are_measured(tmp_path):
    """A long module, a wide class and a long function are found; a docstring and a nested
    function's body do not count toward their function's own lines."""
    pkg = tmp_path / "rljax" / "trace"
    pkg.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_OWN_LINES))
    doc = '    """' + "\n".join("doc" for _ in range(50)) + '"""\n'
    nested = "    def inner():\n" + "\n".join(f"        y{i} = {i}" for i in range(50)) + "\n"
    fields = "\n".join(f"        self.a{i} = {i}" for i in range(MAX_ATTRIBUTES + 1))
    wide = f"class Bag:\n    def __init__(self):\n{fields}\n"
    (pkg / "tracer.py").write_text(f"def long():\n{body}\n    return 0\n\n\ndef fine():\n{doc}{nested}    return 0\n\n\n"
                                   f"{wide}" + "\n" * MAX_MODULE_LINES)
    at_limit = "\n".join(f"    x{i} = {i}" for i in range(MAX_OWN_LINES - 1))
    (tmp_path / "rljax" / "launch.py").write_text(f"def fine():\n{at_limit}\n")  # the def line and 79: 80
    found = violations(tmp_path)
    assert len(found) == 3, found
    assert "tracer.py is" in found[0] and "class Bag has 21" in found[1], found
    assert f"long is {MAX_OWN_LINES + 2} lines of its own" in found[2], found
