"""``rljax/trainer`` stays readable: no class holds more than :data:`MAX_ATTRIBUTES` attributes and
no function is longer than :data:`MAX_LINES` lines (issue 22: orchestration a newcomer reads in
one screen; the state is one value, :class:`rljax.trainer.state.RunState`, not a bag of fields).

``ast`` only. A class's attributes are its annotated class-level fields (dataclasses) and the
distinct ``self.x = ...`` targets of its methods; a function's length is its whole ``def``,
docstring included. What remains over a limit is listed in :data:`ALLOWED` with its reason.
"""

import ast
import pathlib

from repo_paths import REPO

TRAINER = REPO / "rljax" / "trainer"
MAX_ATTRIBUTES = 10
MAX_LINES = 60

#: ``"file:Class"`` or ``"file:function"`` (``Class.method`` for methods) -> why it may exceed.
ALLOWED = {
    "step.py:StepConfig": "the update's hyper-parameters, a frozen record handed to one jitted function "
                          "(optax-style keyword hyper-parameters); it holds no state and no behaviour",
    "loop.py:RunSummary": "the record run() returns for the end-of-run table; no behaviour",
    "distribute.py:RolloutRows": "every process's per-row facts, read where a trajectory's own fields would be "
                                 "(metrics, tracer, staleness): one array per trajectory field it mirrors; a record",
    "step.py:make_train_step": "the whole update as one jitted pure function (epochs x mini-batches x micro-batch "
                               "scan), the room STYLE.md asks to copy; computation, not orchestration",
    "runner.py:StageSpec": "a stage's declaration, written once beside its function (issue 32): a frozen record "
                           "of what the stage is (name, fields, config keys, state, facts, condition); no state",
    "packing.py:pack": "the first-fit row packing algorithm with its balance pass; computation, not orchestration",
}


def _self_targets(fn: ast.AST) -> set:
    out = set()
    for node in ast.walk(fn):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                    out.add(n.attr)
    return out


def class_attributes(cls: ast.ClassDef) -> set:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" not in ast.unparse(node.annotation):
                names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= _self_targets(node)
    return names


def _functions(tree: ast.Module):
    """``(qualified name, node)`` of every function and method, nested ones included."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def violations(root: pathlib.Path = TRAINER) -> list:
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs = class_attributes(node)
                if len(attrs) > MAX_ATTRIBUTES and f"{path.name}:{node.name}" not in ALLOWED:
                    out.append(f"{path.name}:{node.lineno} class {node.name} has {len(attrs)} attributes "
                               f"(at most {MAX_ATTRIBUTES}): {', '.join(sorted(attrs))}")
        for name, fn in _functions(tree):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_LINES and f"{path.name}:{name}" not in ALLOWED:
                out.append(f"{path.name}:{fn.lineno} {name} is {lines} lines (at most {MAX_LINES})")
    return out


def test_trainer_classes_and_functions_stay_small():
    found = violations()
    assert not found, "\n".join(found)


def test_the_limits_are_measured(tmp_path):
    wide = "\n".join(f"    f{i}: int" for i in range(MAX_ATTRIBUTES + 1))
    long = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "bad.py").write_text(f"class Bag:\n{wide}\n\n\nclass Obj:\n    def __init__(self):\n"
                                     + "\n".join(f"        self.a{i} = {i}" for i in range(MAX_ATTRIBUTES + 1))
                                     + f"\n\n\ndef long():\n{long}\n    return 0\n")
    found = violations(tmp_path)
    assert len(found) == 3 and "class Bag has 11" in found[0] and "class Obj has 11" in found[1], found
    assert f"long is {MAX_LINES + 2} lines" in found[2], found
    assert not set(ALLOWED) - {f"{p.name}:{n}" for p in TRAINER.rglob("*.py") for n in _names(p)}, \
        "an ALLOWED entry names no class or function of rljax/trainer"


def _names(path: pathlib.Path) -> set:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} | {q for q, _ in _functions(tree)}
